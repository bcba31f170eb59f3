//! `rdmx kv`: the distributed cache (rdmx-kv) from the command line.
//!
//! ```text
//! rdmx kv server --listen tcp://127.0.0.1:7601 --memory 256m
//! rdmx kv server --listen tcp://127.0.0.1:7602 --memory 256m
//! rdmx kv resp --listen 127.0.0.1:6380 --nodes tcp://127.0.0.1:7601,tcp://127.0.0.1:7602
//! redis-cli -p 6380 set greeting hello
//! rdmx kv bench --nodes tcp://127.0.0.1:7601,tcp://127.0.0.1:7602 --value 100 --path one-sided
//! ```

use std::sync::Arc;
use std::time::Duration;

use rdmx_core::{Error, Options};
use rdmx_kv::bench::{self, BenchConfig};
use rdmx_kv::gateway::{self, GatewayConfig, GatewayCounters};
use rdmx_kv::{Client, ClientConfig, GetPath, Node};

use crate::perf::{parse_size, transports};

/// Arguments of `rdmx kv`.
#[derive(clap::Args, Debug)]
pub(crate) struct KvArgs {
    #[command(subcommand)]
    cmd: KvCmd,
}

#[derive(clap::Subcommand, Debug)]
enum KvCmd {
    /// Run a cache node: items in registered memory, GETs served by one-sided
    /// reads, writes by RPC.
    Server {
        /// URL to listen on (tcp:// or rdma://).
        #[arg(long, default_value = "tcp://127.0.0.1:7600")]
        listen: String,
        /// Memory for items, index included (k/m/g = KiB/MiB/GiB); full means eviction.
        #[arg(long, default_value = "256m")]
        memory: String,
        /// Shared secret clients must prove.
        #[arg(long)]
        secret: Option<String>,
        /// Serve Prometheus metrics (GET /metrics) on this address.
        #[arg(long)]
        metrics: Option<String>,
    },
    /// Run a RESP2 gateway (Redis protocol) in front of the nodes.
    Resp {
        /// Address for Redis clients.
        #[arg(long, default_value = "127.0.0.1:6380")]
        listen: String,
        /// Node URLs (comma-separated).
        #[arg(long, value_delimiter = ',')]
        nodes: Vec<String>,
        /// A file of node URLs (one per line, # comments), reloaded on SIGHUP.
        #[arg(long)]
        nodes_file: Option<String>,
        /// Shared secret of the nodes.
        #[arg(long)]
        secret: Option<String>,
        /// How GETs read: one-sided or rpc.
        #[arg(long, default_value = "one-sided", value_parser = ["one-sided", "rpc"])]
        get_path: String,
        /// Serve Prometheus metrics (GET /metrics) on this address.
        #[arg(long)]
        metrics: Option<String>,
    },
    /// Drive the nodes with the native client (YCSB-style) and report.
    Bench {
        /// Node URLs (comma-separated).
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<String>,
        /// Distinct keys.
        #[arg(long, default_value_t = 1_000_000)]
        keys: u64,
        /// Zipf constant of the key choice (0: uniform).
        #[arg(long, default_value_t = 0.99)]
        zipf: f64,
        /// Percentage of GETs (the rest are SETs): 95 is YCSB-B, 100 read-only.
        #[arg(long, default_value_t = 95.0)]
        get_percent: f64,
        /// Value size (k/m suffixes).
        #[arg(long, default_value = "100")]
        value: String,
        /// GET path: one-sided or rpc.
        #[arg(long, default_value = "one-sided", value_parser = ["one-sided", "rpc"])]
        path: String,
        /// Run length in milliseconds (after loading and the warm-up).
        #[arg(long, default_value_t = 5000)]
        duration_ms: u64,
        /// Run the same mix this long first, unmeasured: a long-running
        /// client's state (connections, the pointer cache of where items
        /// are) rather than a fresh process's.
        #[arg(long, default_value_t = 0)]
        warmup_ms: u64,
        /// Operations in flight.
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
        /// Keys to load first, hottest first (default: all keys).
        #[arg(long)]
        load: Option<u64>,
        /// Skip loading (the keys are there from an earlier run).
        #[arg(long)]
        no_load: bool,
        /// Shared secret of the nodes.
        #[arg(long)]
        secret: Option<String>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

fn options(secret: &Option<String>) -> Options {
    let mut o = ClientConfig::new(Vec::new()).options;
    if let Some(s) = secret {
        o = o.secret(s);
    }
    o
}

fn path(p: &str) -> GetPath {
    if p == "rpc" {
        GetPath::Rpc
    } else {
        GetPath::OneSided
    }
}

/// Node URLs from a file: one per line, blank lines and `#` comments skipped.
fn read_nodes(file: &str) -> Result<Vec<String>, Error> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| Error::InvalidArgument(format!("--nodes-file {file}: {e}")))?;
    Ok(text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect())
}

async fn client(nodes: Vec<String>, secret: &Option<String>) -> Result<Client, Error> {
    if nodes.is_empty() {
        return Err(Error::InvalidArgument(
            "no nodes: give --nodes URL,URL or --nodes-file".into(),
        ));
    }
    for n in &nodes {
        n.parse::<rdmx_core::Endpoint>()?;
    }
    let cfg = ClientConfig {
        options: options(secret),
        ..ClientConfig::new(nodes)
    };
    Ok(Client::with_transports(cfg, transports()).await)
}

pub(crate) async fn run(a: KvArgs) -> Result<(), Error> {
    match a.cmd {
        KvCmd::Server {
            listen,
            memory,
            secret,
            metrics,
        } => {
            let memory = parse_size(&memory)?;
            let mut opts = Options::default();
            if let Some(s) = &secret {
                opts = opts.secret(s);
            }
            let (node, listener) = Node::listen(&transports(), &listen, memory, opts).await?;
            if let Some(m) = metrics {
                let n = node.clone();
                let extra: rdmx_core::metrics::Extra =
                    Arc::new(move |out: &mut String| n.metrics(out));
                let at = rdmx_core::metrics::serve(&m, Some(extra)).await?;
                eprintln!("rdmx kv server: metrics on http://{at}/metrics");
            }
            if let Some(f) = listener.fallback_reason() {
                eprintln!("rdmx kv server: listening on TCP instead ({f})");
            }
            eprintln!(
                "rdmx kv server: {}://{} with {memory} bytes for items",
                listener.transport(),
                listener.local_addr()
            );
            node.serve(listener)
                .await
                .map_err(|e| Error::Protocol(e.to_string()))
        }
        KvCmd::Resp {
            listen,
            nodes,
            nodes_file,
            secret,
            get_path,
            metrics,
        } => {
            let initial = match &nodes_file {
                Some(f) => read_nodes(f)?,
                None => nodes,
            };
            let shared = Arc::new(parking_lot::RwLock::new(client(initial, &secret).await?));
            let counters = Arc::new(GatewayCounters::default());
            let l = tokio::net::TcpListener::bind(&listen)
                .await
                .map_err(|e| Error::Connect(format!("listen on {listen}: {e}")))?;
            if let Some(m) = metrics {
                let (sh, c) = (shared.clone(), counters.clone());
                let extra: rdmx_core::metrics::Extra =
                    Arc::new(move |out: &mut String| gateway::metrics(out, &sh.read(), &c));
                let at = rdmx_core::metrics::serve(&m, Some(extra)).await?;
                eprintln!("rdmx kv resp: metrics on http://{at}/metrics");
            }
            if let Some(file) = nodes_file {
                let (sh, secret) = (shared.clone(), secret.clone());
                tokio::spawn(async move {
                    let Ok(mut hup) =
                        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
                    else {
                        return;
                    };
                    while hup.recv().await.is_some() {
                        match read_nodes(&file) {
                            Ok(nodes) => match client(nodes.clone(), &secret).await {
                                Ok(c) => {
                                    *sh.write() = c;
                                    eprintln!("rdmx kv resp: nodes reloaded: {}", nodes.join(","));
                                }
                                Err(e) => eprintln!("rdmx kv resp: reload refused: {e}"),
                            },
                            Err(e) => eprintln!("rdmx kv resp: reload refused: {e}"),
                        }
                    }
                });
            }
            let up = shared.read().nodes_up();
            eprintln!(
                "rdmx kv resp: RESP2 on {} for {} node(s) up: {}",
                l.local_addr().map_err(|e| Error::Connect(e.to_string()))?,
                up.len(),
                up.join(",")
            );
            let cfg = GatewayConfig {
                get_path: path(&get_path),
                ..GatewayConfig::default()
            };
            gateway::serve(l, shared, cfg, counters).await;
            Ok(())
        }
        KvCmd::Bench {
            nodes,
            keys,
            zipf,
            get_percent,
            value,
            path: p,
            duration_ms,
            warmup_ms,
            concurrency,
            load,
            no_load,
            secret,
            json,
        } => {
            let cfg = BenchConfig {
                keys: keys.max(1),
                zipf,
                get_ratio: (get_percent / 100.0).clamp(0.0, 1.0),
                value: parse_size(&value)? as usize,
                path: path(&p),
                duration: Duration::from_millis(duration_ms),
                concurrency: concurrency.max(1),
                load: if no_load {
                    0
                } else {
                    load.unwrap_or(keys).min(keys)
                },
            };
            let c = client(nodes, &secret).await?;
            let kv = |e: rdmx_kv::KvError| Error::Protocol(e.to_string());
            bench::load(&c, &cfg).await.map_err(kv)?;
            if warmup_ms > 0 {
                let warmup = BenchConfig {
                    duration: Duration::from_millis(warmup_ms),
                    ..cfg.clone()
                };
                bench::run(&c, &warmup).await.map_err(kv)?;
            }
            let r = bench::run(&c, &cfg).await.map_err(kv)?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string(&r).map_err(|e| Error::Protocol(e.to_string()))?
                );
            } else {
                println!(
                    "{} GET, {} B values, {:.0}% GET: {:.0} ops/s, GET p50 {:.1} µs p99 {:.1} µs, hit ratio {:.3}, \
                     node CPU {:.2} s per million GETs, {} one-sided retries",
                    r.path,
                    r.value,
                    r.get_ratio * 100.0,
                    r.ops_per_s,
                    r.get_p50_us,
                    r.get_p99_us,
                    r.hit_ratio,
                    r.node_cpu_s_per_m_gets,
                    r.retries
                );
            }
            Ok(())
        }
    }
}
