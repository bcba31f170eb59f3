//! `rdmx`: the rdmx command-line tool.
//!
//! * `rdmx perf` — perftest-style latency and bandwidth for any transport,
//!   against a peer (`server` / `client URL`) or on this host (`--loopback`).
//! * `rdmx pcap check` — verify every RoCEv2 packet of a capture.
//! * `rdmx doctor` — RDMA devices, GIDs, limits and settings, with advice.
//! * `rdmx soak` — a checked write/read/send mix over a path, with goodput
//!   and protocol counters (retransmits, NAKs, CNPs).
//! * `rdmx block serve` — the NVMe over Fabrics target (NVMe/TCP, discovery).
//! * `rdmx kv` — the distributed cache: `server` (a node), `resp` (a Redis
//!   protocol gateway), `bench` (the native client under a YCSB-style load).
//!
//! Logs go to stderr (`RDMX_LOG=debug` for more), coloured only on a terminal;
//! a failure is printed once, as `rdmx: <error>`, with a non-zero exit.

#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]

/// mimalloc as the global allocator (see Cargo.toml).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod block;
mod counters;
mod doctor;
mod kv;
mod oob;
mod pcap;
mod perf;
mod perftest;
mod pingpong;
mod plot;
mod raw;
mod soak;
mod wakeup;

use clap::{Parser, Subcommand};

/// rdmx: RDMA-speed transport for distributed services, with TCP fallback.
#[derive(Parser, Debug)]
#[command(
    name = "rdmx",
    version,
    about = "rdmx: RDMA-speed transport for distributed services, with TCP fallback.\n\
             perf measures any transport against a raw-TCP baseline, soak checks a path's \
             integrity and goodput, pcap checks RoCEv2 captures, doctor explains this host's RDMA setup, \
             kv runs the distributed cache (nodes, a Redis-protocol gateway, a benchmark).",
    after_help = "Logs: RDMX_LOG=debug|info|warn (default warn), on stderr."
)]
struct Cli {
    /// Worker threads of the async runtime. 1 keeps every wake-up on one
    /// thread (no hand-over between threads): the lowest latency where a
    /// server shares a few cores with its clients
    #[arg(long, global = true, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: u16,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Measure latency and bandwidth of send, write, read, cas and faa.
    Perf(Box<perf::PerfArgs>),
    /// Inspect RoCEv2 captures.
    Pcap(pcap::PcapArgs),
    /// Move a checked mix of writes, reads and sends over a path; report goodput.
    Soak(soak::SoakArgs),
    /// Report this host's RDMA devices, GIDs, limits and settings, with advice.
    Doctor(doctor::DoctorArgs),
    /// The distributed cache: nodes, the RESP (Redis) gateway, a benchmark.
    Kv(kv::KvArgs),
    /// The NVMe over Fabrics target: namespaces over NVMe/TCP for the Linux kernel's host.
    Block(block::BlockArgs),
    /// The peer of rdma-core's ibv_rc_pingpong (its exchange, on the soft engine).
    Pingpong(pingpong::PingpongArgs),
}

/// `rdmx doctor | head`: a reader that goes away ends the program quietly
/// with the status a C tool killed by SIGPIPE has (141), instead of a panic
/// (Rust ignores SIGPIPE, so `println!` to a closed pipe panics).
fn exit_quietly_when_stdout_closes() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let p = info.payload();
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

fn main() -> std::process::ExitCode {
    use std::io::IsTerminal;
    exit_quietly_when_stdout_closes();
    tracing_subscriber::fmt()
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RDMX_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(usize::from(cli.threads))
        // Soft RoCE ACKs held for the answer leave when a worker runs dry.
        .on_thread_park(rdmx_transport_rdma::soft::on_thread_park)
        .enable_all()
        .build()
        .expect("tokio runtime");
    // Run on a worker thread (not block_on's thread) so wake-ups stay on the
    // runtime's workers.
    let res = rt.block_on(async {
        tokio::spawn(async move {
            match cli.cmd {
                Cmd::Perf(a) => perf::run(*a).await,
                Cmd::Pcap(a) => pcap::run(a),
                Cmd::Soak(a) => soak::run(a).await,
                Cmd::Doctor(a) => doctor::run(a),
                Cmd::Kv(a) => kv::run(a).await,
                Cmd::Block(a) => block::run(a).await,
                Cmd::Pingpong(a) => pingpong::run(a).await,
            }
        })
        .await
        .unwrap_or_else(|e| Err(rdmx_core::Error::Protocol(format!("task failed: {e}"))))
    });
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdmx: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
