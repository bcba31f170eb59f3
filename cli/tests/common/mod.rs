//! Helpers the CLI's integration tests share: the binary, free ports, a
//! server process whose stderr is kept, metrics scrapes, and assertion text.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The `rdmx` binary under test.
pub(crate) fn rdmx() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rdmx"))
}

/// Status, stdout and stderr of a finished command, for assertion messages.
pub(crate) fn explain(out: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A free port p whose neighbour p + 1 is free too (rdmx on p, the raw
/// baseline on p + 1).
pub(crate) fn free_port() -> u16 {
    loop {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < 65000 && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
}

/// A server process whose stderr is kept (and drained, so it never blocks);
/// killed when dropped.
pub(crate) struct Spawned {
    pub(crate) child: Child,
    pub(crate) log: Arc<Mutex<String>>,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Spawned {
    /// Run `rdmx args…` and wait until its stderr shows `ready`.
    pub(crate) fn start(args: &[&str], ready: &str) -> Spawned {
        let mut child = rdmx()
            .args(args)
            .env("RDMX_LOG", "warn")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (err, l2) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                l2.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let s = Spawned { child, log };
        s.wait_for(ready);
        s
    }

    /// Wait (30 s at most) until stderr shows `text`.
    pub(crate) fn wait_for(&self, text: &str) {
        let t = Instant::now();
        while !self.log.lock().unwrap().contains(text) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "no {text:?} in the server's stderr:\n{}",
                self.log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Still running?
    pub(crate) fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

/// Send `bytes` and read until the peer closes (or 5 s pass).
pub(crate) fn probe(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

/// GET /metrics from `addr`; the whole HTTP answer, checked to be a 200.
pub(crate) fn scrape(addr: &str) -> String {
    let out = probe(addr, b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n");
    let text = String::from_utf8(out).unwrap();
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    text
}

/// The value of an unlabelled metric.
pub(crate) fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}
