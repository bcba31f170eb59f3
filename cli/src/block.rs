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

use rdmx_block::backend::{Backend, FileBackend, RamBackend};
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
        after either survives a crash of the target.\n\nExample:\n  \
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
    },
    /// Export a remote namespace over NBD, through NVMe over rdmx (for
    /// nbd-client, qemu-img, qemu-io, nbdinfo, nbdcopy, fio's nbd engine).
    #[command(after_help = "Example:\n  \
        rdmx block serve --ram 1g --rdmx rdma://127.0.0.1:4430 &\n  \
        rdmx block nbd --listen 127.0.0.1:10809 --target rdma://127.0.0.1:4430 &\n  \
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
    },
}

pub(crate) async fn run(a: BlockArgs) -> Result<(), Error> {
    match a.cmd {
        BlockCmd::Nbd {
            listen,
            target,
            nqn,
            nsid,
            export,
            queues,
        } => {
            use rdmx_block::fabric::{BlockError, Initiator, InitiatorConfig};
            let cfg = InitiatorConfig {
                nqn,
                nsid,
                queues,
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
            eprintln!("rdmx block nbd: export {export:?} on {listen}");
            rdmx_block::nbd::serve(
                l,
                Arc::new(dev),
                rdmx_block::nbd::NbdConfig {
                    export,
                    ..Default::default()
                },
            )
            .await;
            Ok(())
        }
        BlockCmd::Serve {
            ram,
            file,
            size,
            nvme_tcp,
            discovery,
            rdmx,
            nqn,
            block_size,
            metrics,
        } => {
            if ram.is_empty() && file.is_empty() {
                return Err(Error::InvalidArgument(
                    "give at least one namespace: --ram SIZE or --file PATH".into(),
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
                backends.push(Arc::new(FileBackend::open(f, size).map_err(io)?));
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
                let rl = crate::perf::transports()
                    .listen(&url, &rdmx_core::Options::default())
                    .await?;
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
