//! The RESP gateway against the real thing: the same command script sent to
//! `redis-server` (Redis 7, Debian's) and to the gateway over a cache node
//! gets byte-identical replies; malformed requests get Redis's errors and a
//! closed connection; unmodified `redis-cli` and `redis-benchmark` work.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmx_core::{Options, Transports};
use rdmx_kv::gateway::{serve, GatewayConfig, GatewayCounters};
use rdmx_kv::{Client, ClientConfig, Node};

fn transports() -> Transports {
    Transports::new()
        .with(rdmx_transport_tcp::TcpTransport::new())
        .with(rdmx_transport_rdma::RdmaTransport::new())
}

/// Two nodes over `scheme` and a gateway in front of them, on a runtime of
/// their own; returns the gateway's address.
fn gateway(scheme: &'static str) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut urls = Vec::new();
            for _ in 0..2 {
                let (node, l) = Node::listen(
                    &transports(),
                    &format!("{scheme}://127.0.0.1:0"),
                    32 << 20,
                    Options::default(),
                )
                .await
                .unwrap();
                urls.push(format!("{scheme}://{}", l.local_addr()));
                tokio::spawn(async move { node.serve(l).await });
            }
            let client = Client::with_transports(ClientConfig::new(urls), transports()).await;
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap().to_string()).unwrap();
            serve(
                l,
                Arc::new(parking_lot::RwLock::new(client)),
                GatewayConfig::default(),
                Arc::new(GatewayCounters::default()),
            )
            .await;
        });
    });
    rx.recv().unwrap()
}

struct Redis(Child, String);

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn redis_server() -> Redis {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--databases",
            "1",
        ])
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server");
    let addr = format!("127.0.0.1:{port}");
    let t = Instant::now();
    while TcpStream::connect(&addr).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "redis-server did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Redis(child, addr)
}

fn request(args: &[&[u8]]) -> Vec<u8> {
    let mut w = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        w.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        w.extend_from_slice(a);
        w.extend_from_slice(b"\r\n");
    }
    w
}

/// Read one whole RESP2 reply, returning its exact bytes.
fn reply(r: &mut BufReader<TcpStream>) -> Vec<u8> {
    let mut line = Vec::new();
    r.read_until(b'\n', &mut line).unwrap();
    assert!(line.ends_with(b"\r\n"), "reply line {line:?}");
    let body = &line[1..line.len() - 2];
    let n = || std::str::from_utf8(body).unwrap().parse::<i64>().unwrap();
    match line[0] {
        b'+' | b'-' | b':' => {}
        b'$' => {
            if n() >= 0 {
                let mut b = vec![0u8; n() as usize + 2];
                r.read_exact(&mut b).unwrap();
                line.extend_from_slice(&b);
            }
        }
        b'*' => {
            for _ in 0..n().max(0) {
                line.extend(reply(r));
            }
        }
        other => panic!("not a reply: {:?}", other as char),
    }
    line
}

struct Conn {
    w: TcpStream,
    r: BufReader<TcpStream>,
}

fn conn(addr: &str) -> Conn {
    let w = TcpStream::connect(addr).unwrap();
    w.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    Conn {
        r: BufReader::new(w.try_clone().unwrap()),
        w,
    }
}

impl Conn {
    fn call(&mut self, args: &[&[u8]]) -> Vec<u8> {
        self.w.write_all(&request(args)).unwrap();
        reply(&mut self.r)
    }
}

/// The command script: every supported command, its options, and the
/// errors Redis gives for wrong arity, non-integers, bad options and
/// unknown commands.
fn script() -> Vec<Vec<Vec<u8>>> {
    let lines: &[&str] = &[
        "PING",
        "PING hello",
        "ping a b",
        "ECHO hi",
        "ECHO",
        "SET k v",
        "GET k",
        "GET missing",
        "SET k v2 NX",
        "SET k v3 XX",
        "GET k",
        "SET k v4 XX GET",
        "SET fresh v GET",
        "GET fresh",
        "SET n 10",
        "INCR n",
        "INCRBY n 5",
        "DECR n",
        "DECRBY n 3",
        "INCR k",
        "INCRBY n x",
        "INCRBY n 1.5",
        "SET big 9223372036854775807",
        "INCR big",
        "DECRBY n -9223372036854775808",
        "SET lead 007",
        "INCR lead",
        "SET sp 1",
        "INCRBY sp +1",
        "INCR newcounter",
        "DECR newneg",
        "EXISTS k n missing k",
        "DEL k missing",
        "EXISTS k",
        "MSET a 1 b 2 c 3",
        "MGET a b missing c",
        "MSET a",
        "MSET a 1 b",
        "GET",
        "SET",
        "SET x",
        "GET a b",
        "SET k v EX 0",
        "SET k v EX -5",
        "SET k v EX abc",
        "SET k v PX 100 EX 5",
        "SET k v NX XX",
        "SET k v BOGUS",
        "SET k v EX",
        "SET k v KEEPTTL EX 5",
        "SETEX s 100 v",
        "TTL s",
        "SETEX s 0 v",
        "SETEX s x v",
        "SETEX s 10",
        "PTTL missing",
        "TTL missing",
        "TTL a",
        "EXPIRE a 100",
        "TTL a",
        "EXPIRE missing 10",
        "EXPIRE a abc",
        "EXPIRE a 10 NX",
        "EXPIRE a 50 XX",
        "TTL a",
        "EXPIRE a 10 BOGUS",
        "EXPIRE a 10 NX XX",
        "EXPIRE a 10 GT LT",
        "EXPIRE a",
        "PEXPIRE b 100000",
        "TTL b",
        "EXPIRE b -1",
        "GET b",
        "SET kt v EX 100",
        "SET kt w KEEPTTL",
        "TTL kt",
        "GET kt",
        "SET kt z",
        "TTL kt",
        "SELECT 0",
        "SELECT 1",
        "SELECT x",
        "FOOBAR a b",
        "foobar",
        "TOUCH a c missing",
        "DBSIZE",
        "DBSIZE x",
        "INCR",
        "TTL",
        "HELLO x",
        "GET a",
        "FLUSHALL",
        "DBSIZE",
        "GET a",
        "FLUSHALL bogus",
        "SET  v",
        "DEL",
        "EXISTS",
    ];
    lines
        .iter()
        .map(|l| {
            l.split(' ')
                .filter(|a| !a.is_empty() || l.contains("  "))
                .map(|a| a.as_bytes().to_vec())
                .collect()
        })
        .collect()
}

#[test]
#[cfg_attr(
    rdmx_missing_redis,
    ignore = "needs redis-server, redis-cli and redis-benchmark (apt-get install redis-server redis-tools); CI runs it"
)]
fn replies_match_redis_byte_for_byte() {
    let redis = redis_server();
    for scheme in ["tcp", "rdma"] {
        let gw = gateway(scheme);
        let mut theirs = conn(&redis.1);
        let mut ours = conn(&gw);
        theirs.call(&[b"FLUSHALL"]);
        let mut all_theirs = Vec::new();
        for cmd in script() {
            let args: Vec<&[u8]> = cmd.iter().map(|a| &a[..]).collect();
            let want = theirs.call(&args);
            let got = ours.call(&args);
            assert_eq!(
                String::from_utf8_lossy(&got),
                String::from_utf8_lossy(&want),
                "{scheme}: reply to {:?}",
                cmd.iter()
                    .map(|a| String::from_utf8_lossy(a).to_string())
                    .collect::<Vec<_>>()
            );
            all_theirs.extend(want);
        }
        // The whole script pipelined in one write: the same bytes, in order.
        ours.call(&[b"FLUSHALL"]);
        let mut batch = Vec::new();
        for cmd in script() {
            let args: Vec<&[u8]> = cmd.iter().map(|a| &a[..]).collect();
            batch.extend(request(&args));
        }
        ours.w.write_all(&batch).unwrap();
        let mut got = Vec::new();
        for _ in 0..script().len() {
            got.extend(reply(&mut ours.r));
        }
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&all_theirs),
            "{scheme}: pipelined"
        );
    }
}

/// Malformed requests: Redis's error, then the connection closes; the
/// gateway keeps serving others and never allocates a claimed length.
#[test]
#[cfg_attr(
    rdmx_missing_redis,
    ignore = "needs redis-server, redis-cli and redis-benchmark (apt-get install redis-server redis-tools); CI runs it"
)]
fn malformed_requests_match_redis_and_close() {
    let redis = redis_server();
    let gw = gateway("tcp");
    let cases: &[&[u8]] = &[
        b"*x\r\n",
        b"*1\r\n+x\r\n",
        b"*1\r\n$-5\r\n",
        b"*1\r\n$2000000000\r\n",
        b"*99999999999\r\n",
        b"*2\r\n$3\r\nGET\r\n:1\r\n",
    ];
    for case in cases {
        let run = |addr: &str| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(case).unwrap();
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out);
            out
        };
        let (want, got) = (run(&redis.1), run(&gw));
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&want),
            "{:?}",
            String::from_utf8_lossy(case)
        );
        assert!(want.starts_with(b"-ERR Protocol error"), "{want:?}");
    }
    // Binary garbage and a truncated frame: an error or a wait, never a crash.
    let mut s = TcpStream::connect(&gw).unwrap();
    s.write_all(&[0u8, 0xff, 0x13, b'\n', b'*', b'3']).unwrap();
    drop(s);
    let mut c = conn(&gw);
    assert_eq!(c.call(&[b"PING"]), b"+PONG\r\n");
    // A value above the cache's item size: an error reply, connection kept.
    let big = vec![b'x'; 9 << 20];
    let r = c.call(&[b"SET", b"big", &big]);
    assert!(
        String::from_utf8_lossy(&r).starts_with("-ERR value is too large"),
        "{}",
        String::from_utf8_lossy(&r)
    );
    assert_eq!(c.call(&[b"GET", b"big"]), b"$-1\r\n");
}

fn cli(gw: &str, args: &[&str]) -> String {
    let (host, port) = gw.rsplit_once(':').unwrap();
    let out = Command::new("redis-cli")
        .args(["-h", host, "-p", port])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
#[cfg_attr(
    rdmx_missing_redis,
    ignore = "needs redis-server, redis-cli and redis-benchmark (apt-get install redis-server redis-tools); CI runs it"
)]
fn redis_cli_and_redis_benchmark_work_unmodified() {
    for scheme in ["tcp", "rdma"] {
        let gw = gateway(scheme);
        assert_eq!(cli(&gw, &["set", "greeting", "hello world"]), "OK\n");
        assert_eq!(cli(&gw, &["get", "greeting"]), "hello world\n");
        assert_eq!(cli(&gw, &["incrby", "visits", "41"]), "41\n");
        assert_eq!(cli(&gw, &["incr", "visits"]), "42\n");
        assert_eq!(cli(&gw, &["--no-raw", "get", "nothing"]), "(nil)\n");
        assert!(cli(&gw, &["--no-raw", "lpush", "l", "x"]).contains("unknown command 'lpush'"));
        let (host, port) = gw.rsplit_once(':').unwrap();
        let out = Command::new("redis-benchmark")
            .args([
                "-h", host, "-p", port, "-t", "set,get", "-n", "4000", "-c", "8", "-d", "100",
                "-r", "1000", "-P", "8", "-q",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        for t in ["SET:", "GET:"] {
            let line = text
                .lines()
                .find(|l| l.contains(t))
                .unwrap_or_else(|| panic!("no {t} in {text}"));
            assert!(line.contains("requests per second"), "{line}");
        }
        let n: u64 = cli(&gw, &["dbsize"]).trim().parse().unwrap();
        assert!(
            (500..=1002).contains(&n),
            "{n} keys after 4000 SETs over 1000 random keys"
        );
    }
}
