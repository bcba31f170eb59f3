//! Unary echo benchmark, one run, every system on this host (each point,
//! a size and a number of calls in flight, runs every system in turn):
//! rdmx-rpc over TCP (with and without coalescing) and over soft RoCE, tonic over its own TCP, and tonic
//! over rdmx (TCP and soft RoCE). Prints one JSON line per point:
//! QPS, p50 and p99 latency, MB/s, and this process's CPU time and context
//! switches per call (client and server together: both run here).
//!
//! ```text
//! cargo run --release -p rdmx-rpc-tonic --example rpc_bench -- [--duration-ms 1000]
//!     [--systems rdmx-rpc/tcp,tonic/tcp] [--sizes 64,4096] [--concurrency 1,64] [--threads 2]
//! ```
//!
//! `--threads` sets the runtime's worker threads (default 2, as the
//! benchmark runs): with one, no call waits for a thread to wake.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use rdmx_core::{Options, Transport};
use rdmx_rpc::{Client, Server, ServerOptions, Service};
use rdmx_rpc_tonic::echo::echo_client::EchoClient;
use rdmx_rpc_tonic::echo::echo_server::{Echo, EchoServer};
use rdmx_rpc_tonic::echo::{EchoReply, EchoRequest, StreamRequest};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

struct Svc;

#[tonic::async_trait]
impl Echo for Svc {
    async fn unary(&self, r: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        Ok(Response::new(EchoReply {
            payload: r.into_inner().payload,
            seq: 0,
        }))
    }
    type StreamStream = ReceiverStream<Result<EchoReply, Status>>;
    async fn stream(
        &self,
        _: Request<StreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        Err(Status::unimplemented("not benchmarked"))
    }
}

/// What to run: systems by name (empty: all), sizes, calls in flight.
#[derive(Clone)]
struct Plan {
    dur: Duration,
    systems: Vec<String>,
    sizes: Vec<usize>,
    concurrency: Vec<usize>,
}

impl Plan {
    fn wants(&self, system: &str) -> bool {
        self.systems.is_empty() || self.systems.iter().any(|s| s == system)
    }
}

/// CPU seconds (user + system), context switches (voluntary and not) and
/// write-family system calls (`write`, `writev`: `syscw` of /proc/self/io;
/// socket reads by `recvfrom` are not counted there) of this process so far,
/// summed over its threads.
fn process_usage() -> (f64, u64, u64) {
    let cpu = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the command name, which is in parentheses.
            let rest = &s[s.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some(ticks / 100.0)
        })
        .unwrap_or(0.0);
    let mut switches = 0;
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for t in tasks.flatten() {
            let Ok(st) = std::fs::read_to_string(t.path().join("status")) else {
                continue;
            };
            for line in st.lines() {
                if line.starts_with("voluntary_ctxt_switches")
                    || line.starts_with("nonvoluntary_ctxt_switches")
                {
                    switches += line
                        .split_whitespace()
                        .last()
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0);
                }
            }
        }
    }
    let writes = std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("syscw:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    (cpu, switches, writes)
}

/// One measured point: calls, elapsed, latency histogram (ns), CPU seconds
/// context switches and write system calls over the run.
struct Run {
    calls: u64,
    elapsed: Duration,
    hist: Histogram<u64>,
    cpu: f64,
    switches: u64,
    writes: u64,
}

/// Run `conc` loops of `call` for `dur`.
async fn drive<F, Fut>(conc: usize, dur: Duration, call: F) -> Run
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let call = Arc::new(call);
    // Warm up.
    for _ in 0..20 {
        call().await;
    }
    let (cpu0, sw0, wr0) = process_usage();
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..conc)
        .map(|_| {
            let call = call.clone();
            tokio::spawn(async move {
                let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
                let mut n = 0u64;
                while t0.elapsed() < dur {
                    let s = Instant::now();
                    call().await;
                    h.record(s.elapsed().as_nanos() as u64).unwrap();
                    n += 1;
                }
                (n, h)
            })
        })
        .collect();
    let mut total = 0;
    let mut all = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    for t in tasks {
        let (n, h) = t.await.unwrap();
        total += n;
        all.add(h).unwrap();
    }
    let elapsed = t0.elapsed();
    let (cpu1, sw1, wr1) = process_usage();
    Run {
        calls: total,
        elapsed,
        hist: all,
        cpu: cpu1 - cpu0,
        switches: sw1.saturating_sub(sw0),
        writes: wr1.saturating_sub(wr0),
    }
}

fn report(system: &str, size: usize, conc: usize, r: Run) {
    let n = r.calls;
    let qps = n as f64 / r.elapsed.as_secs_f64();
    let per = n.max(1) as f64;
    println!(
        "{{\"system\":\"{system}\",\"size\":{size},\"concurrency\":{conc},\"calls\":{n},\"qps\":{qps:.1},\
         \"p50_us\":{:.2},\"p99_us\":{:.2},\"mb_per_s\":{:.1},\"cpu_us_per_call\":{:.2},\
         \"switches_per_call\":{:.3},\"writes_per_call\":{:.3}}}",
        r.hist.value_at_quantile(0.5) as f64 / 1000.0,
        r.hist.value_at_quantile(0.99) as f64 / 1000.0,
        qps * size as f64 / 1e6,
        r.cpu * 1e6 / per,
        r.switches as f64 / per,
        r.writes as f64 / per,
    );
}

/// A system under test, set up once: `point(size, conc)` measures one point.
/// Every point runs each system in turn (see `main`), so the ratios between
/// systems compare measurements seconds apart, not a whole sweep apart.
struct System {
    name: &'static str,
    point: Box<dyn Fn(usize, usize) -> futures_util::future::BoxFuture<'static, Run> + Send + Sync>,
    stop: Option<Box<dyn FnOnce() + Send + Sync>>,
}

async fn rdmx_rpc(
    name: &'static str,
    t: Arc<dyn Transport>,
    plan: &Plan,
    coalesce: bool,
) -> Option<System> {
    if !plan.wants(name) {
        return None;
    }
    let service =
        Service::new("bench", 1).method_bytes("echo", |b: Bytes| async move { Ok::<_, String>(b) });
    let server = Server::new(
        service,
        ServerOptions {
            max_in_flight: 256,
            coalesce,
            ..ServerOptions::default()
        },
    );
    let l = t.listen("127.0.0.1:0", &Options::default()).await.unwrap();
    let addr = l.local_addr().to_string();
    let s = server.clone();
    tokio::spawn(async move { s.serve(l).await });
    let conn = t.connect(&addr, &Options::default()).await.unwrap();
    let client = Client::connect(conn, "bench", 1, &["echo"]).await.unwrap();
    client.set_coalescing(coalesce);
    let dur = plan.dur;
    Some(System {
        name,
        point: Box::new(move |size, conc| {
            let (c, b) = (client.clone(), Bytes::from(vec![0x5au8; size]));
            Box::pin(drive(conc, dur, move || {
                let (c, b) = (c.clone(), b.clone());
                async move {
                    let back = c.call_bytes("echo", b).await.unwrap();
                    assert_eq!(back.len(), size);
                }
            }))
        }),
        stop: Some(Box::new(move || server.shutdown())),
    })
}

fn tonic_system(
    name: &'static str,
    client: EchoClient<tonic::transport::Channel>,
    plan: &Plan,
) -> System {
    let client = client
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    let dur = plan.dur;
    System {
        name,
        point: Box::new(move |size, conc| {
            let (c, p) = (client.clone(), vec![0x5au8; size]);
            Box::pin(drive(conc, dur, move || {
                let (mut c, p) = (c.clone(), p.clone());
                async move {
                    let back = c.unary(EchoRequest { payload: p }).await.unwrap();
                    assert_eq!(back.into_inner().payload.len(), size);
                }
            }))
        }),
        stop: None,
    }
}

fn echo_server() -> EchoServer<Svc> {
    EchoServer::new(Svc)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
}

async fn tonic_over_rdmx(name: &'static str, t: Arc<dyn Transport>, plan: &Plan) -> Option<System> {
    if !plan.wants(name) {
        return None;
    }
    let l = t.listen("127.0.0.1:0", &Options::default()).await.unwrap();
    let addr = l.local_addr().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(echo_server())
            .serve_with_incoming(rdmx_rpc_tonic::incoming(l)),
    );
    let conn = t.connect(&addr, &Options::default()).await.unwrap();
    let ch = rdmx_rpc_tonic::channel(conn).await.unwrap();
    Some(tonic_system(name, EchoClient::new(ch), plan))
}

async fn tonic_over_tcp(plan: &Plan) -> Option<System> {
    if !plan.wants("tonic/tcp") {
        return None;
    }
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    // TCP_NODELAY on accepted sockets too, as on the client: otherwise Nagle
    // and delayed ACKs add ~40 ms to small exchanges.
    let incoming =
        tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(l), |s| {
            s.inspect(|s| {
                let _ = s.set_nodelay(true);
            })
        });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(echo_server())
            .serve_with_incoming(incoming),
    );
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap();
    Some(tonic_system("tonic/tcp", EchoClient::new(ch), plan))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let list = |name: &str, dflt: &[usize]| -> Vec<usize> {
        flag(name).map_or_else(
            || dflt.to_vec(),
            |v| v.split(',').map(|x| x.parse().expect(name)).collect(),
        )
    };
    let plan = Plan {
        dur: Duration::from_millis(flag("--duration-ms").map_or(1000, |v| v.parse().unwrap())),
        systems: flag("--systems")
            .map(|v| v.split(',').map(str::to_string).collect())
            .unwrap_or_default(),
        sizes: list("--sizes", &[64, 4096, 65_536, 1 << 20]),
        concurrency: list("--concurrency", &[1, 64]),
    };
    let threads = flag("--threads").map_or(2, |v| v.parse().expect("--threads"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        // Soft RoCE ACKs held for the answer leave when a worker runs dry.
        .on_thread_park(rdmx_transport_rdma::soft::on_thread_park)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        tokio::spawn(async move {
            let tcp: Arc<dyn Transport> = Arc::new(rdmx_transport_tcp::TcpTransport::new());
            let rdma: Arc<dyn Transport> = Arc::new(rdmx_transport_rdma::RdmaTransport::new());
            let systems: Vec<System> = [
                rdmx_rpc("rdmx-rpc/tcp", tcp.clone(), &plan, true).await,
                // The same without coalescing (one send per frame): what it buys.
                rdmx_rpc("rdmx-rpc/tcp-uncoalesced", tcp.clone(), &plan, false).await,
                rdmx_rpc("rdmx-rpc/soft-roce", rdma.clone(), &plan, true).await,
                tonic_over_tcp(&plan).await,
                tonic_over_rdmx("tonic/rdmx-tcp", tcp, &plan).await,
                tonic_over_rdmx("tonic/rdmx-soft-roce", rdma, &plan).await,
            ]
            .into_iter()
            .flatten()
            .collect();
            // Each point runs every system, starting one further along the
            // list from point to point, so that no system always goes first
            // after a change of size (or always follows the same one).
            let mut k = 0;
            for &size in &plan.sizes {
                for &conc in &plan.concurrency {
                    for i in 0..systems.len() {
                        let sys = &systems[(k + i) % systems.len()];
                        let run = (sys.point)(size, conc).await;
                        report(sys.name, size, conc, run);
                    }
                    k += 1;
                }
            }
            for sys in systems {
                if let Some(stop) = sys.stop {
                    stop();
                }
            }
        })
        .await
        .unwrap();
    });
}
