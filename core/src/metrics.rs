//! Prometheus text exposition (format 0.0.4) of rdmx's counters, and a small
//! HTTP endpoint that serves it, for every rdmx server (`--metrics ADDR`).
//!
//! * `rdmx_<counter>_total`: the process-wide [`crate::stats::global`] set.
//! * `rdmx_connection_<counter>_total{conn, transport, provider, peer}`: each
//!   open [`Connection`](crate::Connection), labelled by the transport carrying it and its
//!   provider (`kernel-tcp`, `soft-roce:4791`, a NIC's device name).
//! * `rdmx_connections_open`: how many connections are open.
//!
//! Servers add their own families through the `extra` hook of [`serve`].

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::conn::{ConnectionInfo, RawConnection};
use crate::error::{Error, Result};
use crate::stats::{global, StatsSnapshot};

/// Extra metric text a server appends to every scrape.
pub type Extra = Arc<dyn Fn(&mut String) + Send + Sync>;

struct Tracked {
    id: u64,
    raw: Weak<dyn RawConnection>,
    info: Arc<ConnectionInfo>,
}

fn registry() -> &'static Mutex<(u64, Vec<Tracked>)> {
    static REG: OnceLock<Mutex<(u64, Vec<Tracked>)>> = OnceLock::new();
    REG.get_or_init(|| Mutex::new((0, Vec::new())))
}

/// Remember a connection for per-connection metrics (weakly: a closed and
/// dropped connection disappears from the next scrape).
pub(crate) fn track(raw: &Arc<dyn RawConnection>, info: &Arc<ConnectionInfo>) {
    let mut reg = registry().lock();
    reg.1.retain(|t| t.raw.strong_count() > 0);
    reg.0 += 1;
    let id = reg.0;
    reg.1.push(Tracked {
        id,
        raw: Arc::downgrade(raw),
        info: info.clone(),
    });
}

/// A label value escaped as the exposition format requires.
fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// The provider label: the device part of [`ConnectionInfo::provider`]
/// (`"soft-roce:4791 (QPN …)"` is `soft-roce:4791`).
fn provider_label(info: &ConnectionInfo) -> &str {
    info.provider.split(" (").next().unwrap_or("")
}

/// Render every rdmx counter: the process-wide set, then each open connection.
pub fn render(out: &mut String) {
    let g = global().snapshot();
    let conns: Vec<(u64, Arc<ConnectionInfo>, StatsSnapshot)> = {
        let reg = registry().lock();
        reg.1
            .iter()
            .filter_map(|t| {
                let raw = t.raw.upgrade()?;
                let snap = raw.stats().snapshot();
                Some((t.id, t.info.clone(), snap))
            })
            .collect()
    };
    for (name, help, value) in g.fields() {
        let _ = writeln!(out, "# HELP rdmx_{name}_total {help} (process-wide)");
        let _ = writeln!(out, "# TYPE rdmx_{name}_total counter");
        let _ = writeln!(out, "rdmx_{name}_total {value}");
    }
    let _ = writeln!(out, "# HELP rdmx_connections_open Connections open now.");
    let _ = writeln!(out, "# TYPE rdmx_connections_open gauge");
    let _ = writeln!(out, "rdmx_connections_open {}", conns.len());
    let names = g.fields();
    for (i, (name, help, _)) in names.iter().enumerate() {
        let _ = writeln!(
            out,
            "# HELP rdmx_connection_{name}_total {help} (one connection)"
        );
        let _ = writeln!(out, "# TYPE rdmx_connection_{name}_total counter");
        for (id, info, snap) in &conns {
            let peer = info.peer_addr.map(|a| a.to_string()).unwrap_or_default();
            let _ = writeln!(
                out,
                "rdmx_connection_{name}_total{{conn=\"{id}\",transport=\"{}\",provider=\"{}\",peer=\"{}\"}} {}",
                escape(&info.transport),
                escape(provider_label(info)),
                escape(&peer),
                snap.fields()[i].2
            );
        }
    }
}

/// The whole exposition text, with a server's `extra` families appended.
pub fn text(extra: Option<&Extra>) -> String {
    let mut out = String::with_capacity(16 << 10);
    render(&mut out);
    if let Some(f) = extra {
        f(&mut out);
    }
    out
}

/// The largest request head the endpoint reads before answering 431.
const MAX_REQUEST: usize = 8 << 10;

/// Serve `GET /metrics` on `addr` (HTTP/1.1, one request per connection) in
/// a background task; returns the bound address. Any other path is 404, a
/// request head over 8 KiB is 431, and a client that sends nothing for 5 s
/// is dropped: a scraper gets text, nobody else gets the server's memory.
pub async fn serve(addr: &str, extra: Option<Extra>) -> Result<SocketAddr> {
    let l = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Connect(format!("listen on {addr} for metrics: {e}")))?;
    let local = l
        .local_addr()
        .map_err(|e| Error::Connect(format!("metrics listener address: {e}")))?;
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let extra = extra.clone();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(5), answer(s, extra)).await;
            });
        }
    });
    Ok(local)
}

async fn answer(mut s: TcpStream, extra: Option<Extra>) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_REQUEST {
            return reply(
                &mut s,
                "431 Request Header Fields Too Large",
                "text/plain",
                "",
            )
            .await;
        }
        let n = s.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    match (method, path) {
        (b"GET", b"/metrics") => {
            let body = text(extra.as_ref());
            reply(
                &mut s,
                "200 OK",
                "text/plain; version=0.0.4; charset=utf-8",
                &body,
            )
            .await
        }
        (b"GET", _) => reply(&mut s, "404 Not Found", "text/plain", "try /metrics\n").await,
        _ => reply(&mut s, "405 Method Not Allowed", "text/plain", "").await,
    }
}

async fn reply(s: &mut TcpStream, status: &str, ctype: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(body.as_bytes()).await?;
    s.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape(r#"a"b\c"#), r#"a\"b\\c"#);
        assert_eq!(escape("x\ny"), "x\\ny");
    }

    #[tokio::test]
    async fn scrape_over_http_and_refuse_the_rest() {
        global().add(|s| &s.sends, 1);
        let extra: Extra = Arc::new(|o: &mut String| o.push_str("demo_metric 7\n"));
        let addr = serve("127.0.0.1:0", Some(extra)).await.unwrap();
        let get = |req: &'static [u8]| async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(req).await.unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        let ok = get(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("# TYPE rdmx_sends_total counter"), "{ok}");
        let sends: u64 = ok
            .lines()
            .find_map(|l| l.strip_prefix("rdmx_sends_total "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(sends >= 1);
        assert!(ok.ends_with("demo_metric 7\n"), "{ok}");
        let body_len = ok.split("\r\n\r\n").nth(1).unwrap().len();
        assert!(ok.contains(&format!("Content-Length: {body_len}\r\n")));
        assert!(get(b"GET / HTTP/1.1\r\n\r\n")
            .await
            .starts_with("HTTP/1.1 404"));
        assert!(get(b"POST /metrics HTTP/1.1\r\n\r\n")
            .await
            .starts_with("HTTP/1.1 405"));
        let big = [b'a'; 20_000];
        let mut s = TcpStream::connect(addr).await.unwrap();
        let _ = s.write_all(&big).await;
        let mut out = String::new();
        let _ = s.read_to_string(&mut out).await;
        assert!(out.starts_with("HTTP/1.1 431"), "{out}");
    }
}
