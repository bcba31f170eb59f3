//! The RESP2 gateway: unmodified Redis clients (`redis-cli`,
//! `redis-benchmark`, client libraries) talk to the cache cluster through it.
//! Replies are byte for byte what Redis 7 sends for the same command,
//! including error texts; the supported commands are in [`COMMANDS`].
//!
//! A connection's requests are answered in order. Runs of pipelined GETs are
//! issued at once (their one-sided reads overlap) and answered in order;
//! every other command runs after the ones before it finished.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::future::join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::client::{Client, GetPath, KvError};
use crate::node::Ttl;
use crate::resp::{decode, Reply};
use crate::store::{parse_i64, Cond};

/// Every command the gateway answers (others get Redis's unknown-command error).
pub const COMMANDS: &[&str] = &[
    "ping", "echo", "get", "set", "setex", "del", "exists", "mget", "mset", "incr", "incrby",
    "decr", "decrby", "expire", "pexpire", "ttl", "pttl", "touch", "dbsize", "flushall", "flushdb",
    "info", "command", "config", "select", "quit", "hello",
];

/// Gateway settings.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Largest bulk string accepted in a request (a larger one is a protocol
    /// error that closes the connection; values above a node's item size get
    /// an error reply instead).
    pub max_bulk: usize,
    /// How GETs read.
    pub get_path: GetPath,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            max_bulk: 16 << 20,
            get_path: GetPath::OneSided,
        }
    }
}

/// Gateway counters.
#[derive(Debug, Default)]
pub struct GatewayCounters {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Commands answered.
    pub commands: AtomicU64,
    /// Connections closed for a protocol error.
    pub protocol_errors: AtomicU64,
}

/// The cluster client a gateway uses; replaced whole when membership is
/// reloaded (connections pick up the new one at their next request).
pub type SharedClient = Arc<parking_lot::RwLock<Client>>;

/// Prometheus text of a gateway's families: its own counters and its
/// client's per-path counters.
pub fn metrics(out: &mut String, client: &Client, counters: &GatewayCounters) {
    use std::fmt::Write as _;
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let c = client.counters();
    let rows: [(&str, &str, u64); 12] = [
        (
            "gateway_connections",
            "Redis client connections accepted.",
            l(&counters.connections),
        ),
        (
            "gateway_commands",
            "Commands answered.",
            l(&counters.commands),
        ),
        (
            "gateway_protocol_errors",
            "Connections closed for malformed RESP.",
            l(&counters.protocol_errors),
        ),
        (
            "one_sided_hits",
            "GETs by one-sided reads that found a value.",
            l(&c.one_sided_hits),
        ),
        (
            "one_sided_misses",
            "GETs by one-sided reads that found none.",
            l(&c.one_sided_misses),
        ),
        (
            "one_sided_retries",
            "One-sided reads retried (torn, overwritten or reused items).",
            l(&c.one_sided_retries),
        ),
        (
            "one_sided_reads",
            "READs issued by one-sided GETs (index buckets and items).",
            l(&c.one_sided_reads),
        ),
        (
            "one_sided_fallbacks",
            "One-sided GETs that gave up and asked by RPC.",
            l(&c.one_sided_fallbacks),
        ),
        (
            "client_rpc_hits",
            "GETs by RPC that found a value.",
            l(&c.rpc_hits),
        ),
        (
            "client_rpc_misses",
            "GETs by RPC that found none.",
            l(&c.rpc_misses),
        ),
        (
            "nodes_marked_down",
            "Times a node was marked down.",
            l(&c.nodes_marked_down),
        ),
        (
            "nodes_back",
            "Times a down node came back.",
            l(&c.nodes_back),
        ),
    ];
    for (name, help, v) in rows {
        let _ = writeln!(out, "# HELP rdmx_kv_{name}_total {help}\n# TYPE rdmx_kv_{name}_total counter\nrdmx_kv_{name}_total {v}");
    }
    let _ = writeln!(
        out,
        "# HELP rdmx_kv_nodes_up Cache nodes up.\n# TYPE rdmx_kv_nodes_up gauge\nrdmx_kv_nodes_up {}",
        client.nodes_up().len()
    );
}

/// Accept Redis clients on `listener` forever.
pub async fn serve(
    listener: TcpListener,
    client: SharedClient,
    cfg: GatewayConfig,
    counters: Arc<GatewayCounters>,
) {
    loop {
        let s = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "gateway accept failed; still accepting");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = s.set_nodelay(true);
        counters.connections.fetch_add(1, Ordering::Relaxed);
        let (client, cfg, counters) = (client.clone(), cfg.clone(), counters.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(s, client, cfg, counters).await {
                tracing::debug!(error = %e, "gateway connection closed");
            }
        });
    }
}

fn is_get(args: &[Bytes]) -> bool {
    args.len() == 2 && args[0].eq_ignore_ascii_case(b"get")
}

async fn connection(
    mut s: TcpStream,
    shared: SharedClient,
    cfg: GatewayConfig,
    counters: Arc<GatewayCounters>,
) -> std::io::Result<()> {
    let mut buf = BytesMut::with_capacity(16 << 10);
    let mut out = Vec::with_capacity(16 << 10);
    loop {
        if s.read_buf(&mut buf).await? == 0 {
            return Ok(());
        }
        let mut batch = Vec::new();
        let mut fatal = None;
        loop {
            match decode(&mut buf, cfg.max_bulk) {
                Ok(Some(args)) if args.is_empty() => {}
                Ok(Some(args)) => batch.push(args),
                Ok(None) => break,
                Err(e) => {
                    fatal = Some(e);
                    break;
                }
            }
        }
        let client = shared.read().clone();
        let mut i = 0;
        let mut quit = false;
        while i < batch.len() && !quit {
            // A run of GETs goes out at once.
            let run = batch[i..].iter().take_while(|a| is_get(a)).count();
            if run > 1 {
                let keys: Vec<&[u8]> = batch[i..i + run].iter().map(|a| &a[1][..]).collect();
                for r in client.mget(&keys, cfg.get_path).await {
                    get_reply(r).encode(&mut out);
                }
                i += run;
                continue;
            }
            let (reply, close) = execute(&client, &cfg, &batch[i]).await;
            reply.encode(&mut out);
            quit = close;
            i += 1;
        }
        counters.commands.fetch_add(i as u64, Ordering::Relaxed);
        if let Some(e) = fatal.filter(|_| !quit) {
            counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
            Reply::err(e).encode(&mut out);
            s.write_all(&out).await?;
            return Ok(());
        }
        s.write_all(&out).await?;
        out.clear();
        if quit {
            return Ok(());
        }
        // Keep the buffer from holding a large request's memory forever.
        if buf.is_empty() && buf.capacity() > 1 << 20 {
            buf = BytesMut::with_capacity(16 << 10);
        }
    }
}

fn get_reply(r: Result<Option<Bytes>, KvError>) -> Reply {
    match r {
        Ok(Some(v)) => Reply::Bulk(v),
        Ok(None) => Reply::Nil,
        Err(e) => kv_error(e),
    }
}

fn kv_error(e: KvError) -> Reply {
    Reply::err(e)
}

fn arity(name: &str) -> Reply {
    Reply::err(format!("wrong number of arguments for '{name}' command"))
}

fn not_integer() -> Reply {
    Reply::err("value is not an integer or out of range")
}

fn int_arg(b: &[u8]) -> Result<i64, Reply> {
    parse_i64(b).ok_or_else(not_integer)
}

/// Redis's reply to a command it does not know.
fn unknown(args: &[Bytes]) -> Reply {
    let mut rest = String::new();
    for a in &args[1..] {
        if rest.len() >= 128 {
            break;
        }
        let room = 128 - rest.len();
        let text = String::from_utf8_lossy(a);
        let cut: String = text.chars().take(room).collect();
        rest.push_str(&format!("'{cut}' "));
    }
    let name: String = String::from_utf8_lossy(&args[0])
        .chars()
        .take(128)
        .collect();
    Reply::err(format!(
        "unknown command '{name}', with args beginning with: {rest}"
    ))
}

/// Run one command; the flag says to close the connection after the reply.
pub async fn execute(client: &Client, cfg: &GatewayConfig, args: &[Bytes]) -> (Reply, bool) {
    let name = String::from_utf8_lossy(&args[0]).to_ascii_lowercase();
    let n = args.len();
    // Arity as Redis declares it: exact (n) or at least (-n).
    let want: i64 = match name.as_str() {
        "ping" | "command" | "flushall" | "flushdb" | "info" | "hello" | "quit" => -1,
        "get" | "incr" | "decr" | "ttl" | "pttl" | "echo" | "select" => 2,
        "incrby" | "decrby" => 3,
        "setex" => 4,
        "set" | "mset" | "expire" | "pexpire" => -3,
        "del" | "exists" | "mget" | "touch" | "config" => -2,
        "dbsize" => 1,
        _ => return (unknown(args), false),
    };
    if (want > 0 && n as i64 != want) || (want < 0 && (n as i64) < -want) {
        return (arity(&name), false);
    }
    let keys = || args[1..].iter().map(|k| &k[..]).collect::<Vec<&[u8]>>();
    let reply = match name.as_str() {
        "ping" => match n {
            1 => Reply::Simple("PONG"),
            2 => Reply::Bulk(args[1].clone()),
            _ => arity("ping"),
        },
        "echo" => Reply::Bulk(args[1].clone()),
        "quit" => return (Reply::Simple("OK"), true),
        "select" => match parse_i64(&args[1]) {
            None => not_integer(),
            Some(0) => Reply::Simple("OK"),
            Some(_) => Reply::err("DB index is out of range"),
        },
        "hello" => hello(args),
        "command" => command(args),
        "config" => config(args),
        "info" => info(client).await,
        "get" => get_reply(client.get_with(&args[1], cfg.get_path).await),
        "mget" => Reply::Array(
            client
                .mget(&keys(), cfg.get_path)
                .await
                .into_iter()
                .map(get_reply)
                .collect(),
        ),
        "set" => set(client, args).await,
        "setex" => match parse_i64(&args[2]) {
            None => not_integer(),
            Some(s) if s <= 0 || s.checked_mul(1000).is_none() => {
                Reply::err("invalid expire time in 'setex' command")
            }
            Some(s) => match client
                .set(&args[1], &args[3], Ttl::In(s as u64 * 1000), Cond::Always)
                .await
            {
                Ok(_) => Reply::Simple("OK"),
                Err(e) => kv_error(e),
            },
        },
        "mset" => {
            if n % 2 != 1 {
                arity("mset")
            } else {
                let sets = args[1..]
                    .chunks(2)
                    .map(|kv| client.set(&kv[0], &kv[1], Ttl::Never, Cond::Always));
                match join_all(sets).await.into_iter().find_map(Result::err) {
                    None => Reply::Simple("OK"),
                    Some(e) => kv_error(e),
                }
            }
        }
        "del" => count(client.del(&keys()).await),
        "exists" => count(client.exists(&keys()).await),
        "touch" => count(client.touch(&keys()).await),
        "incr" => incr(client, &args[1], Ok(1)).await,
        "decr" => incr(client, &args[1], Ok(-1)).await,
        "incrby" => incr(client, &args[1], int_arg(&args[2])).await,
        "decrby" => {
            let d = int_arg(&args[2]).and_then(|d| {
                d.checked_neg()
                    .ok_or_else(|| Reply::err("decrement would overflow"))
            });
            incr(client, &args[1], d).await
        }
        "expire" | "pexpire" => expire(client, &name, args).await,
        "ttl" | "pttl" => match client.pttl(&args[1]).await {
            Ok(ms) if ms < 0 => Reply::Int(ms),
            Ok(ms) if name == "ttl" => Reply::Int((ms + 500) / 1000),
            Ok(ms) => Reply::Int(ms),
            Err(e) => kv_error(e),
        },
        "dbsize" => count(client.dbsize().await),
        "flushall" | "flushdb" => {
            let opt = args.get(1).map(|a| a.to_ascii_lowercase());
            if n > 2
                || opt
                    .as_deref()
                    .is_some_and(|o| o != b"async" && o != b"sync")
            {
                Reply::err("syntax error")
            } else {
                match client.flush().await {
                    Ok(()) => Reply::Simple("OK"),
                    Err(e) => kv_error(e),
                }
            }
        }
        _ => unknown(args),
    };
    (reply, false)
}

fn count(r: Result<u64, KvError>) -> Reply {
    match r {
        Ok(n) => Reply::Int(n as i64),
        Err(e) => kv_error(e),
    }
}

async fn incr(client: &Client, key: &[u8], delta: Result<i64, Reply>) -> Reply {
    let delta = match delta {
        Ok(d) => d,
        Err(r) => return r,
    };
    match client.incr(key, delta).await {
        Ok(v) => Reply::Int(v),
        Err(e) => kv_error(e),
    }
}

/// SET key value [NX|XX] [GET] [EX s|PX ms|EXAT s|PXAT ms|KEEPTTL]
/// (Redis 7.0 `parseExtendedStringArgumentsOrReply`).
async fn set(client: &Client, args: &[Bytes]) -> Reply {
    let mut cond = Cond::Always;
    let mut ttl = Ttl::Never;
    let mut expire_set = false;
    let mut get = false;
    let mut i = 3;
    while i < args.len() {
        let opt = args[i].to_ascii_lowercase();
        let next = args.get(i + 1);
        match opt.as_slice() {
            b"nx" if cond != Cond::IfPresent => cond = Cond::IfAbsent,
            b"xx" if cond != Cond::IfAbsent => cond = Cond::IfPresent,
            b"get" => get = true,
            b"keepttl" if !expire_set => {
                ttl = Ttl::Keep;
                expire_set = true;
            }
            b"ex" | b"px" | b"exat" | b"pxat" if !expire_set && next.is_some() => {
                let Some(v) = parse_i64(next.expect("checked")) else {
                    return not_integer();
                };
                let now = crate::node::now_ms() as i64;
                let ms = match opt.as_slice() {
                    b"ex" => v.checked_mul(1000),
                    b"px" => Some(v),
                    b"exat" => v.checked_mul(1000).map(|at| at - now),
                    _ => Some(v - now),
                };
                let invalid = v <= 0
                    || ms.is_none()
                    || (matches!(opt.as_slice(), b"ex" | b"px")
                        && ms.and_then(|m| m.checked_add(now)).is_none());
                if invalid {
                    return Reply::err("invalid expire time in 'set' command");
                }
                // An absolute time already past: store, then it is gone
                // (Redis deletes at once).
                ttl = Ttl::In(ms.expect("checked").max(1) as u64);
                expire_set = true;
                i += 1;
            }
            _ => return Reply::err("syntax error"),
        }
        i += 1;
    }
    let done = if get {
        client.set_get(&args[1], &args[2], ttl, cond).await
    } else {
        client
            .set(&args[1], &args[2], ttl, cond)
            .await
            .map(|s| (s, None))
    };
    match done {
        Ok((stored, old)) => {
            if get {
                old.map_or(Reply::Nil, Reply::Bulk)
            } else if stored {
                Reply::Simple("OK")
            } else {
                Reply::Nil
            }
        }
        Err(e) => kv_error(e),
    }
}

/// EXPIRE / PEXPIRE key time [NX|XX|GT|LT] (Redis 7.0 `expireGenericCommand`).
async fn expire(client: &Client, name: &str, args: &[Bytes]) -> Reply {
    let Some(t) = parse_i64(&args[2]) else {
        return not_integer();
    };
    let mut flag: Option<Vec<u8>> = None;
    for a in &args[3..] {
        let o = a.to_ascii_lowercase();
        match o.as_slice() {
            b"nx" | b"xx" | b"gt" | b"lt" => {
                if let Some(prev) = &flag {
                    let pair = [prev.as_slice(), o.as_slice()];
                    return Reply::err(if pair.contains(&&b"nx"[..]) {
                        "NX and XX, GT or LT options at the same time are not compatible"
                    } else {
                        "GT and LT options at the same time are not compatible"
                    });
                }
                flag = Some(o);
            }
            _ => return Reply::err(format!("Unsupported option {}", String::from_utf8_lossy(a))),
        }
    }
    let Some(ms) = (if name == "expire" {
        t.checked_mul(1000)
    } else {
        Some(t)
    })
    .filter(|ms| ms.checked_add(crate::node::now_ms() as i64).is_some()) else {
        return Reply::err(format!("invalid expire time in '{name}' command"));
    };
    if let Some(f) = &flag {
        // The options compare with the current expiry (-1: none), as Redis does.
        let cur = match client.pttl(&args[1]).await {
            Ok(c) => c,
            Err(e) => return kv_error(e),
        };
        if cur == -2 {
            return Reply::Int(0);
        }
        let ok = match f.as_slice() {
            b"nx" => cur == -1,
            b"xx" => cur != -1,
            b"gt" => cur != -1 && ms > cur,
            _ => cur == -1 || ms < cur,
        };
        if !ok {
            return Reply::Int(0);
        }
    }
    match client.expire(&args[1], Some(ms)).await {
        Ok(had) => Reply::Int(i64::from(had)),
        Err(e) => kv_error(e),
    }
}

fn hello(args: &[Bytes]) -> Reply {
    if let Some(v) = args.get(1) {
        match parse_i64(v) {
            None => return Reply::err("Protocol version is not an integer or out of range"),
            Some(2) => {}
            Some(_) => return Reply::Error("NOPROTO unsupported protocol version".into()),
        }
        if args.len() > 2 {
            return Reply::err("syntax error");
        }
    }
    let s = |t: &'static str| Reply::Bulk(Bytes::from_static(t.as_bytes()));
    Reply::Array(vec![
        s("server"),
        s("redis"),
        s("version"),
        s("7.0.15"),
        s("proto"),
        Reply::Int(2),
        s("id"),
        Reply::Int(1),
        s("mode"),
        s("standalone"),
        s("role"),
        s("master"),
        s("modules"),
        Reply::Array(Vec::new()),
    ])
}

fn command(args: &[Bytes]) -> Reply {
    match args.get(1).map(|a| a.to_ascii_lowercase()) {
        None => Reply::Array(Vec::new()),
        Some(sub) if sub == b"count" => Reply::Int(COMMANDS.len() as i64),
        Some(sub) if sub == b"docs" || sub == b"info" => Reply::Array(Vec::new()),
        Some(_) => Reply::err(format!(
            "unknown subcommand '{}'. Try COMMAND HELP.",
            String::from_utf8_lossy(&args[1])
        )),
    }
}

/// CONFIG GET: the few parameters clients ask about (redis-benchmark reads
/// `save` and `appendonly`), with this cache's values; others are absent,
/// as Redis answers for a pattern that matches nothing.
fn config(args: &[Bytes]) -> Reply {
    const KNOWN: &[(&str, &str)] = &[("save", ""), ("appendonly", "no"), ("databases", "1")];
    let sub = args[1].to_ascii_lowercase();
    match sub.as_slice() {
        b"get" if args.len() >= 3 => {
            let mut out = Vec::new();
            for (name, value) in KNOWN {
                if args[2..]
                    .iter()
                    .any(|p| p.eq_ignore_ascii_case(name.as_bytes()))
                {
                    out.push(Reply::Bulk(Bytes::from_static(name.as_bytes())));
                    out.push(Reply::Bulk(Bytes::from_static(value.as_bytes())));
                }
            }
            Reply::Array(out)
        }
        b"get" => Reply::err("wrong number of arguments for 'config|get' command"),
        _ => Reply::err(format!(
            "unknown subcommand '{}'. Try CONFIG HELP.",
            String::from_utf8_lossy(&args[1])
        )),
    }
}

async fn info(client: &Client) -> Reply {
    let items = client.dbsize().await.unwrap_or(0);
    let c = client.counters();
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let text = format!(
        "# Server\r\nredis_version:7.0.15\r\nrdmx_kv_gateway:1\r\nnodes_up:{}\r\n\r\n# Keyspace\r\ndb0:keys={items},expires=0,avg_ttl=0\r\n\r\n# Stats\r\none_sided_hits:{}\r\none_sided_misses:{}\r\none_sided_retries:{}\r\nrpc_hits:{}\r\nrpc_misses:{}\r\n",
        client.nodes_up().len(),
        l(&c.one_sided_hits),
        l(&c.one_sided_misses),
        l(&c.one_sided_retries),
        l(&c.rpc_hits),
        l(&c.rpc_misses),
    );
    Reply::Bulk(Bytes::from(text))
}
