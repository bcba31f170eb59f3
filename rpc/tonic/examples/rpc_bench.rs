//! Unary echo benchmark, one run, every system on this host:
//! rdmx-rpc over TCP and over soft RoCE, tonic over its own TCP, and tonic
//! over rdmx (TCP and soft RoCE). Prints one JSON line per point:
//! QPS, p50 and p99 latency, MB/s.
//!
//! ```text
//! cargo run --release -p rdmx-rpc-tonic --example rpc_bench -- [--duration-ms 1000]
//! ```

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

const SIZES: [usize; 4] = [64, 4096, 65_536, 1 << 20];
const CONCURRENCY: [usize; 2] = [1, 64];

/// Run `conc` loops of `call` for `dur`; (calls, elapsed, merged histogram in ns).
async fn drive<F, Fut>(conc: usize, dur: Duration, call: F) -> (u64, Duration, Histogram<u64>)
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let call = Arc::new(call);
    // Warm up.
    for _ in 0..20 {
        call().await;
    }
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
    (total, t0.elapsed(), all)
}

fn report(system: &str, size: usize, conc: usize, r: (u64, Duration, Histogram<u64>)) {
    let (n, el, h) = r;
    let qps = n as f64 / el.as_secs_f64();
    println!(
        "{{\"system\":\"{system}\",\"size\":{size},\"concurrency\":{conc},\"calls\":{n},\"qps\":{qps:.1},\
         \"p50_us\":{:.2},\"p99_us\":{:.2},\"mb_per_s\":{:.1}}}",
        h.value_at_quantile(0.5) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0,
        qps * size as f64 / 1e6
    );
}

async fn rdmx_rpc(name: &str, t: Arc<dyn Transport>, dur: Duration) {
    let service =
        Service::new("bench", 1).method_bytes("echo", |b: Bytes| async move { Ok::<_, String>(b) });
    let server = Server::new(
        service,
        ServerOptions {
            max_in_flight: 256,
            ..ServerOptions::default()
        },
    );
    let l = t.listen("127.0.0.1:0", &Options::default()).await.unwrap();
    let addr = l.local_addr().to_string();
    let s = server.clone();
    tokio::spawn(async move { s.serve(l).await });
    let conn = t.connect(&addr, &Options::default()).await.unwrap();
    let client = Client::connect(conn, "bench", 1, &["echo"]).await.unwrap();
    for size in SIZES {
        let body = Bytes::from(vec![0x5au8; size]);
        for conc in CONCURRENCY {
            let (c, b) = (client.clone(), body.clone());
            let r = drive(conc, dur, move || {
                let (c, b) = (c.clone(), b.clone());
                async move {
                    let back = c.call_bytes("echo", b).await.unwrap();
                    assert_eq!(back.len(), size);
                }
            })
            .await;
            report(name, size, conc, r);
        }
    }
    server.shutdown();
}

async fn tonic_bench(name: &str, mut client: EchoClient<tonic::transport::Channel>, dur: Duration) {
    client = client
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    for size in SIZES {
        let payload = vec![0x5au8; size];
        for conc in CONCURRENCY {
            let (c, p) = (client.clone(), payload.clone());
            let r = drive(conc, dur, move || {
                let (mut c, p) = (c.clone(), p.clone());
                async move {
                    let back = c.unary(EchoRequest { payload: p }).await.unwrap();
                    assert_eq!(back.into_inner().payload.len(), size);
                }
            })
            .await;
            report(name, size, conc, r);
        }
    }
}

fn echo_server() -> EchoServer<Svc> {
    EchoServer::new(Svc)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
}

async fn tonic_over_rdmx(name: &str, t: Arc<dyn Transport>, dur: Duration) {
    let l = t.listen("127.0.0.1:0", &Options::default()).await.unwrap();
    let addr = l.local_addr().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(echo_server())
            .serve_with_incoming(rdmx_rpc_tonic::incoming(l)),
    );
    let conn = t.connect(&addr, &Options::default()).await.unwrap();
    let ch = rdmx_rpc_tonic::channel(conn).await.unwrap();
    tonic_bench(name, EchoClient::new(ch), dur).await;
}

async fn tonic_over_tcp(dur: Duration) {
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
    tonic_bench("tonic/tcp", EchoClient::new(ch), dur).await;
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let ms = args
        .iter()
        .position(|a| a == "--duration-ms")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000u64);
    let dur = Duration::from_millis(ms);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        tokio::spawn(async move {
            let tcp: Arc<dyn Transport> = Arc::new(rdmx_transport_tcp::TcpTransport::new());
            let rdma: Arc<dyn Transport> = Arc::new(rdmx_transport_rdma::RdmaTransport::new());
            rdmx_rpc("rdmx-rpc/tcp", tcp.clone(), dur).await;
            rdmx_rpc("rdmx-rpc/soft-roce", rdma.clone(), dur).await;
            tonic_over_tcp(dur).await;
            tonic_over_rdmx("tonic/rdmx-tcp", tcp, dur).await;
            tonic_over_rdmx("tonic/rdmx-soft-roce", rdma, dur).await;
        })
        .await
        .unwrap();
    });
}
