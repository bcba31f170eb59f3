//! An unmodified tonic service from `proto/echo.proto` (unary and server
//! streaming) served and called over an rdmx connection: soft RoCE by
//! default, or the TCP transport with `tcp`.
//!
//! ```text
//! cargo run -p rdmx-rpc-tonic --example echo          # over soft RoCE
//! cargo run -p rdmx-rpc-tonic --example echo -- tcp   # over rdmx's TCP transport
//! ```

use rdmx_core::{Options, Transports};
use rdmx_rpc_tonic::echo::echo_client::EchoClient;
use rdmx_rpc_tonic::echo::echo_server::{Echo, EchoServer};
use rdmx_rpc_tonic::echo::{EchoReply, EchoRequest, StreamRequest};
use rdmx_rpc_tonic::{channel, incoming, RdmxConnectInfo};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

/// An ordinary tonic service: nothing in it knows about rdmx.
struct EchoService;

#[tonic::async_trait]
impl Echo for EchoService {
    async fn unary(&self, r: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        // rdmx tells handlers which transport carried the call.
        if let Some(info) = r.extensions().get::<RdmxConnectInfo>() {
            println!(
                "server: unary call over {} ({})",
                info.transport, info.provider
            );
        }
        Ok(Response::new(EchoReply {
            payload: r.into_inner().payload,
            seq: 0,
        }))
    }

    type StreamStream = ReceiverStream<Result<EchoReply, Status>>;

    async fn stream(
        &self,
        r: Request<StreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let r = r.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            for seq in 0..u64::from(r.count) {
                let reply = EchoReply {
                    payload: r.payload.clone(),
                    seq,
                };
                if tx.send(Ok(reply)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let scheme = std::env::args().nth(1).unwrap_or_else(|| "rdma".into());
    let ts = Transports::new()
        .with(rdmx_transport_tcp::TcpTransport::new())
        .with(rdmx_transport_rdma::RdmaTransport::new());
    let listener = ts
        .listen(&format!("{scheme}://127.0.0.1:0"), &Options::default())
        .await?;
    let url = format!("{scheme}://{}", listener.local_addr());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(EchoServer::new(EchoService))
            .serve_with_incoming(incoming(listener)),
    );

    let conn = ts.connect(&url, &Options::default()).await?;
    let mut client = EchoClient::new(channel(conn).await?);
    let reply = client
        .unary(EchoRequest {
            payload: b"hello over rdmx".to_vec(),
        })
        .await?
        .into_inner();
    assert_eq!(reply.payload, b"hello over rdmx");
    println!(
        "client: unary reply {:?}",
        String::from_utf8_lossy(&reply.payload)
    );

    let mut stream = client
        .stream(StreamRequest {
            payload: b"tick".to_vec(),
            count: 5,
        })
        .await?
        .into_inner();
    while let Some(r) = stream.next().await {
        let r = r?;
        println!(
            "client: stream message {} {:?}",
            r.seq,
            String::from_utf8_lossy(&r.payload)
        );
    }
    Ok(())
}
