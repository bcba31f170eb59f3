//! `rdmx block`: the NVMe over Fabrics target (rdmx-block).
//!
//! ```text
//! rdmx block serve --ram 1g --nvme-tcp 0.0.0.0:4420 --discovery 0.0.0.0:8009
//! nvme discover -t tcp -a 198.18.0.1 -s 8009          # on a Linux host
//! nvme connect -t tcp -a 198.18.0.1 -s 4420 -n nqn.2026-11.io.rdmx:block
//! rdmx block serve --ram 1g --rdmx rdma://0.0.0.0:4430   # NVMe over rdmx too
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use rdmx_block::backend::{Backend, FileBackend, FileOptions, RamBackend};
use rdmx_block::target::{Target, TargetConfig};
use rdmx_core::Error;

use crate::perf::parse_size;

/// Arguments of `rdmx block`.
#[derive(clap::Args, Debug)]
pub(crate) struct BlockArgs {
    #[command(subcommand)]
    cmd: BlockCmd,
}

#[derive(clap::Subcommand, Debug)]
enum BlockCmd {
    /// Serve namespaces over NVMe/TCP (and a discovery controller).
    #[command(
        after_help = "Each --ram and --file adds a namespace (NSID 1, 2, ... in the \
        order given). Flush and FUA on a file namespace call fdatasync: data acknowledged \
        after either survives a crash of the target. --direct opens them with O_DIRECT \
        (no copy in the page cache; Flush and FUA still call fdatasync for the device's \
        own cache).\n\nExample:\n  \
        rdmx block serve --file /var/lib/rdmx/ns1.img --size 10g --nvme-tcp 0.0.0.0:4420 \
        --discovery 0.0.0.0:8009 --metrics 127.0.0.1:9500"
    )]
    Serve {
        /// A namespace in memory of this size (k/m/g); repeatable.
        #[arg(long)]
        ram: Vec<String>,
        /// A namespace in this file (or block device); repeatable.
        #[arg(long)]
        file: Vec<PathBuf>,
        /// Create or grow --file namespaces to this size (k/m/g).
        #[arg(long)]
        size: Option<String>,
        /// Open --file namespaces with O_DIRECT (no page cache); the file's
        /// direct I/O alignment must divide --block-size.
        #[arg(long)]
        direct: bool,
        /// NVMe/TCP I/O controller address.
        #[arg(long, default_value = "0.0.0.0:4420")]
        nvme_tcp: String,
        /// NVMe/TCP discovery controller address (8009 is the standard port).
        #[arg(long)]
        discovery: Option<String>,
        /// Also serve NVMe over rdmx at this URL (rdma:// or tcp://): command
        /// capsules by SEND, data by one-sided READ and WRITE.
        #[arg(long)]
        rdmx: Option<String>,
        /// The subsystem's NQN.
        #[arg(long, default_value = "nqn.2026-11.io.rdmx:block")]
        nqn: String,
        /// Logical block size: 512 or 4096.
        #[arg(long, default_value_t = 512)]
        block_size: u32,
        /// Serve Prometheus metrics (GET /metrics) on this address.
        #[arg(long)]
        metrics: Option<String>,
        /// Spin this long on an idle NVMe over rdmx connection before sleeping (busy
        /// polling: lower latency for CPU; unset: sleep at once).
        #[arg(long)]
        busy_poll_us: Option<u64>,
    },
    /// Measure a remote namespace through the native Initiator (NVMe over
    /// rdmx): IOPS, MB/s and latency percentiles at a queue depth.
    #[command(after_help = "Example:\n  \
        rdmx block bench --target rdma://127.0.0.1:4430 --rw randread --bs 4k --qd 32 --json")]
    Bench {
        /// The target's NVMe over rdmx URL (rdma:// or tcp://).
        #[arg(long)]
        target: String,
        /// The subsystem NQN.
        #[arg(long, default_value = "nqn.2026-11.io.rdmx:block")]
        nqn: String,
        /// randread, randwrite, read or write.
        #[arg(long, default_value = "randread", value_parser = ["randread", "randwrite", "read", "write"])]
        rw: String,
        /// Bytes per I/O (k/m; a multiple of the block size, at most 1m).
        #[arg(long, default_value = "4k")]
        bs: String,
        /// I/Os in flight.
        #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
        qd: u32,
        /// How long to run, in milliseconds.
        #[arg(long, default_value_t = 5000)]
        duration_ms: u64,
        /// Bytes of the namespace to use, from its start (k/m/g; default all).
        #[arg(long)]
        span: Option<String>,
        /// NVMe I/O queues (one connection each).
        #[arg(long, default_value_t = 2)]
        queues: u16,
        /// Spin this long on an idle connection before sleeping (busy
        /// polling: lower latency for CPU; unset: sleep at once).
        #[arg(long)]
        busy_poll_us: Option<u64>,
        /// One JSON object instead of a line of text.
        #[arg(long)]
        json: bool,
    },
    /// Export a remote namespace over NBD, through NVMe over rdmx (for
    /// nbd-client, qemu-img, qemu-io, nbdinfo, nbdcopy, fio's nbd engine).
    #[command(after_help = "Example:\n  \
        rdmx block serve --ram 1g --rdmx rdma://127.0.0.1:4430 &\n  \
        rdmx block nbd --listen 127.0.0.1:10809 --target rdma://127.0.0.1:4430 --metrics 127.0.0.1:9501 &\n  \
        qemu-img info nbd://127.0.0.1:10809/rdmx")]
    Nbd {
        /// Address for NBD clients.
        #[arg(long, default_value = "127.0.0.1:10809")]
        listen: String,
        /// The target's NVMe over rdmx URL (rdma:// or tcp://).
        #[arg(long)]
        target: String,
        /// The subsystem NQN.
        #[arg(long, default_value = "nqn.2026-11.io.rdmx:block")]
        nqn: String,
        /// The namespace to export.
        #[arg(long, default_value_t = 1)]
        nsid: u32,
        /// The export's name (the empty name works too).
        #[arg(long, default_value = "rdmx")]
        export: String,
        /// NVMe I/O queues to the target (one connection each).
        #[arg(long, default_value_t = 2)]
        queues: u16,
        /// Spin this long on an idle connection before sleeping (busy
        /// polling: lower latency for CPU; unset: sleep at once).
        #[arg(long)]
        busy_poll_us: Option<u64>,
        /// Serve Prometheus metrics (GET /metrics) on this address: NBD
        /// connections, requests, bytes, errors and latency, and the rdmx
        /// connections to the target.
        #[arg(long)]
        metrics: Option<String>,
    },
}

pub(crate) async fn run(a: BlockArgs) -> Result<(), Error> {
    match a.cmd {
        BlockCmd::Bench {
            target,
            nqn,
            rw,
            bs,
            qd,
            duration_ms,
            span,
            queues,
            busy_poll_us,
            json,
        } => {
            bench(BenchArgs {
                target,
                nqn,
                rw,
                bs: parse_size(&bs)?,
                qd,
                duration: std::time::Duration::from_millis(duration_ms),
                span: span.as_deref().map(parse_size).transpose()?,
                queues,
                busy_poll: busy_poll_us.map(std::time::Duration::from_micros),
                json,
            })
            .await
        }
        BlockCmd::Nbd {
            listen,
            target,
            nqn,
            nsid,
            export,
            queues,
            busy_poll_us,
            metrics,
        } => {
            use rdmx_block::fabric::{BlockError, Initiator, InitiatorConfig};
            let cfg = InitiatorConfig {
                nqn,
                nsid,
                queues,
                options: rdmx_core::Options {
                    busy_poll: busy_poll_us.map(std::time::Duration::from_micros),
                    ..rdmx_core::Options::default()
                },
                ..InitiatorConfig::default()
            };
            let dev = Initiator::connect(&crate::perf::transports(), &target, cfg)
                .await
                .map_err(|e| match e {
                    BlockError::Transport(e) => e,
                    other => Error::Connect(format!("{target}: {other}")),
                })?;
            let (t, p) = dev.transport();
            eprintln!(
                "rdmx block nbd: {} blocks of {} bytes from {target} ({t}, {p}), {} queues",
                dev.blocks(),
                dev.block_size(),
                dev.queues()
            );
            let l = tokio::net::TcpListener::bind(&listen)
                .await
                .map_err(|e| Error::Connect(format!("listen on {listen}: {e}")))?;
            let cfg = rdmx_block::nbd::NbdConfig {
                export,
                ..Default::default()
            };
            if let Some(m) = &metrics {
                let stats = cfg.stats.clone();
                let extra: rdmx_core::metrics::Extra =
                    Arc::new(move |out: &mut String| stats.render(out));
                let at = rdmx_core::metrics::serve(m, Some(extra)).await?;
                eprintln!("rdmx block nbd: metrics on http://{at}/metrics");
            }
            eprintln!("rdmx block nbd: export {:?} on {listen}", cfg.export);
            rdmx_block::nbd::serve(l, Arc::new(dev), cfg).await;
            Ok(())
        }
        BlockCmd::Serve {
            ram,
            file,
            size,
            direct,
            nvme_tcp,
            discovery,
            rdmx,
            nqn,
            block_size,
            metrics,
            busy_poll_us,
        } => {
            if ram.is_empty() && file.is_empty() {
                return Err(Error::InvalidArgument(
                    "give at least one namespace: --ram SIZE or --file PATH".into(),
                ));
            }
            if direct && file.is_empty() {
                return Err(Error::InvalidArgument(
                    "--direct applies to --file namespaces; give at least one".into(),
                ));
            }
            let lba_shift = match block_size {
                512 => 9,
                4096 => 12,
                other => {
                    return Err(Error::InvalidArgument(format!(
                        "--block-size {other}: use 512 or 4096"
                    )))
                }
            };
            let target = Target::new(TargetConfig {
                nqn,
                lba_shift,
                ..TargetConfig::default()
            });
            let size = size.as_deref().map(parse_size).transpose()?;
            let io = |e: std::io::Error| Error::InvalidArgument(e.to_string());
            let mut backends: Vec<Arc<dyn Backend>> = Vec::new();
            for r in &ram {
                backends.push(Arc::new(RamBackend::new(parse_size(r)?).map_err(io)?));
            }
            for f in &file {
                let opts = FileOptions { direct };
                backends.push(Arc::new(FileBackend::open_with(f, size, opts).map_err(io)?));
            }
            for b in backends {
                let what = b.describe();
                let nsid = target.add_namespace(b).map_err(Error::InvalidArgument)?;
                eprintln!("rdmx block: namespace {nsid}: {what}");
            }
            if let Some(m) = &metrics {
                let t = target.clone();
                let extra: rdmx_core::metrics::Extra =
                    Arc::new(move |out: &mut String| t.metrics(out));
                let at = rdmx_core::metrics::serve(m, Some(extra)).await?;
                eprintln!("rdmx block: metrics on http://{at}/metrics");
            }
            let bind = |addr: String| async move {
                tokio::net::TcpListener::bind(&addr)
                    .await
                    .map_err(|e| Error::Connect(format!("listen on {addr}: {e}")))
            };
            let l = bind(nvme_tcp).await?;
            eprintln!(
                "rdmx block: NVMe/TCP on {} for {}",
                l.local_addr().map_err(|e| Error::Connect(e.to_string()))?,
                target.nqn()
            );
            if let Some(d) = discovery {
                let dl = bind(d).await?;
                eprintln!(
                    "rdmx block: discovery on {}",
                    dl.local_addr().map_err(|e| Error::Connect(e.to_string()))?
                );
                tokio::spawn(rdmx_block::tcp::serve(dl, target.clone(), false));
            }
            if let Some(url) = rdmx {
                let opts = rdmx_core::Options {
                    busy_poll: busy_poll_us.map(std::time::Duration::from_micros),
                    ..rdmx_core::Options::default()
                };
                let rl = crate::perf::transports().listen(&url, &opts).await?;
                eprintln!(
                    "rdmx block: NVMe over rdmx on {}://{}{}",
                    rl.transport(),
                    rl.local_addr(),
                    rl.fallback_reason()
                        .map(|r| format!(" (TCP instead: {r})"))
                        .unwrap_or_default()
                );
                tokio::spawn(rdmx_block::fabric::serve(rl, target.clone()));
            }
            rdmx_block::tcp::serve(l, target, true).await;
            Ok(())
        }
    }
}

struct BenchArgs {
    target: String,
    nqn: String,
    rw: String,
    bs: u64,
    qd: u32,
    duration: std::time::Duration,
    span: Option<u64>,
    queues: u16,
    busy_poll: Option<std::time::Duration>,
    json: bool,
}

/// `rdmx block bench`: keep `qd` I/Os in flight for the duration; random
/// offsets come from a xorshift generator, sequential ones wrap at the span.
/// Writes carry a fixed pattern (the point is the transport, not the data).
async fn bench(a: BenchArgs) -> Result<(), Error> {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    use rdmx_block::fabric::{Initiator, InitiatorConfig};
    use std::time::Instant;
    let cfg = InitiatorConfig {
        nqn: a.nqn.clone(),
        queues: a.queues,
        queue_depth: 128,
        options: rdmx_core::Options {
            busy_poll: a.busy_poll,
            ..rdmx_core::Options::default()
        },
        ..InitiatorConfig::default()
    };
    let dev = Initiator::connect(&crate::perf::transports(), &a.target, cfg)
        .await
        .map_err(|e| Error::Connect(format!("{}: {e}", a.target)))?;
    let bsz = u64::from(dev.block_size());
    if a.bs == 0 || a.bs % bsz != 0 || a.bs > 1 << 20 {
        return Err(Error::InvalidArgument(format!(
            "--bs {}: a multiple of {bsz} bytes, at most 1m",
            a.bs
        )));
    }
    let blocks = (a.bs / bsz) as u32;
    let span_blocks = a.span.map_or(dev.blocks(), |s| (s / bsz).min(dev.blocks()));
    let slots = span_blocks / u64::from(blocks);
    if slots == 0 {
        return Err(Error::InvalidArgument(
            "--span is smaller than one I/O".into(),
        ));
    }
    let write = a.rw.ends_with("write");
    let random = a.rw.starts_with("rand");
    let payload = bytes::Bytes::from(vec![0x5au8; a.bs as usize]);
    let mut rng: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut seq = 0u64;
    let mut next_lba = move || {
        let slot = if random {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % slots
        } else {
            seq = (seq + 1) % slots;
            seq
        };
        slot * u64::from(blocks)
    };
    let mut hist = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
    let dev = &dev;
    let one = |lba: u64| {
        let p = payload.clone();
        async move {
            let t = Instant::now();
            let r = if write {
                dev.write(lba, p, false).await
            } else {
                dev.read(lba, blocks).await.map(|_| ())
            };
            (r, t.elapsed())
        }
    };
    let mut inflight = FuturesUnordered::new();
    let t0 = Instant::now();
    let mut done = 0u64;
    for _ in 0..a.qd {
        inflight.push(one(next_lba()));
    }
    while let Some((r, took)) = inflight.next().await {
        r.map_err(|e| Error::Protocol(format!("I/O failed: {e}")))?;
        done += 1;
        let _ = hist.record(took.as_nanos() as u64);
        if t0.elapsed() < a.duration {
            inflight.push(one(next_lba()));
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let iops = done as f64 / secs;
    let mbs = iops * a.bs as f64 / 1e6;
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    let (transport, provider) = dev.transport();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "target": a.target, "transport": transport, "provider": provider,
                "rw": a.rw, "bs": a.bs, "qd": a.qd, "ios": done, "seconds": secs,
                "iops": iops, "mb_per_s": mbs,
                "p50_us": us(0.5), "p99_us": us(0.99), "p999_us": us(0.999),
            })
        );
    } else {
        println!(
            "{} {} bs={} qd={} over {transport} ({provider}): {:.0} IOPS, {:.1} MB/s, \
             p50 {:.1} µs, p99 {:.1} µs ({done} I/Os in {secs:.2} s)",
            a.target,
            a.rw,
            a.bs,
            a.qd,
            iops,
            mbs,
            us(0.5),
            us(0.99)
        );
    }
    Ok(())
}
