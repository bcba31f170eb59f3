//! An unmodified tonic service (unary and server streaming) served and called
//! over rdmx connections, on the TCP transport and on soft RoCE.

use rdmx_core::{Options, Transport};
use rdmx_rpc_tonic::echo::echo_client::EchoClient;
use rdmx_rpc_tonic::echo::echo_server::{Echo, EchoServer};
use rdmx_rpc_tonic::echo::{EchoReply, EchoRequest, StreamRequest};
use rdmx_rpc_tonic::{channel, incoming, RdmxConnectInfo};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

struct Svc;

#[tonic::async_trait]
impl Echo for Svc {
    async fn unary(&self, r: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        let who = r
            .extensions()
            .get::<RdmxConnectInfo>()
            .map(|i| i.transport.to_string())
            .ok_or_else(|| Status::internal("no rdmx connect info"))?;
        let mut payload = r.into_inner().payload;
        payload.reverse();
        Ok(Response::new(EchoReply {
            payload,
            seq: who.len() as u64,
        }))
    }

    type StreamStream = ReceiverStream<Result<EchoReply, Status>>;

    async fn stream(
        &self,
        r: Request<StreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        let r = r.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(8);
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

async fn run(t: &dyn Transport) {
    let listener = t.listen("127.0.0.1:0", &Options::default()).await.unwrap();
    let addr = listener.local_addr().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(EchoServer::new(Svc).max_decoding_message_size(64 << 20))
            .serve_with_incoming(incoming(listener)),
    );
    // A peer that is no rdmx client (an HTTP probe): refused by the
    // handshake; tonic keeps serving (incoming yields the error, tonic skips it).
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut junk = tokio::net::TcpStream::connect(&addr).await.unwrap();
        junk.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            junk.read_to_end(&mut sink),
        )
        .await;
    }
    let conn = t.connect(&addr, &Options::default()).await.unwrap();
    let transport = conn.transport().to_string();
    let mut client = EchoClient::new(channel(conn).await.unwrap())
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    for size in [0usize, 1, 64, 4096, 65_536, 1 << 20, 4 << 20] {
        let payload: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        let reply = client
            .unary(EchoRequest {
                payload: payload.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        let mut want = payload;
        want.reverse();
        assert!(reply.payload == want, "size {size}");
        assert_eq!(
            reply.seq,
            transport.len() as u64,
            "the handler saw the rdmx transport"
        );
    }
    // Many concurrent unary calls over the one connection (HTTP/2 streams).
    let calls: Vec<_> = (0..64u8)
        .map(|i| {
            let mut c = client.clone();
            tokio::spawn(async move {
                let r = c
                    .unary(EchoRequest {
                        payload: vec![i; 100],
                    })
                    .await
                    .unwrap();
                assert_eq!(r.into_inner().payload, vec![i; 100]);
            })
        })
        .collect();
    for c in calls {
        c.await.unwrap();
    }
    let mut stream = client
        .stream(StreamRequest {
            payload: b"tick".to_vec(),
            count: 500,
        })
        .await
        .unwrap()
        .into_inner();
    let mut n = 0;
    while let Some(r) = stream.next().await {
        let r = r.unwrap();
        assert_eq!((r.seq, r.payload.as_slice()), (n, &b"tick"[..]));
        n += 1;
    }
    assert_eq!(n, 500);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tonic_over_tcp_transport() {
    run(&rdmx_transport_tcp::TcpTransport::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tonic_over_soft_roce() {
    run(&rdmx_transport_rdma::RdmaTransport::new()).await;
}
