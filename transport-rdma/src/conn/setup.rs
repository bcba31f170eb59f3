//! Bringing a connection up: the RDMA bootstrap on the authenticated TCP
//! stream (PARAMS exchanged, the QP connected, receives posted, READY), and
//! the control channel's tasks that run for the connection's life (reading
//! and writing control messages, and the drive task that waits on the
//! completion queue's events).

use super::*;

pub(super) fn random_psn() -> u32 {
    rand::random::<u32>() & 0xFF_FFFF
}

pub(super) fn post_receives(
    qp: &dyn QueuePair,
    st_next: &mut u64,
    n: u32,
    max_len: u64,
) -> Result<()> {
    for _ in 0..n {
        let id = RECV_BIT | *st_next;
        *st_next += 1;
        qp.post_recv(id, max_len as usize)?;
    }
    Ok(())
}

/// Run the RDMA bootstrap on an authenticated TCP stream and start the connection.
pub(crate) async fn start(s: Setup) -> Result<RdmaConnection> {
    let Setup {
        mut stream,
        domain,
        provider,
        qp_opts,
        agreed,
        max_inflight,
        connect_timeout,
        busy_poll,
        server,
    } = s;
    let ours = agreed.ours;
    let local_addr = stream.local_addr().ok();
    let peer_addr = stream
        .peer_addr()
        .map_err(|e| Error::Disconnected(format!("bootstrap: {e}")))?;
    let local_ip = local_addr
        .map(|a| a.ip().to_canonical())
        .ok_or_else(|| Error::Connect("bootstrap socket has no local address".into()))?;
    let port = provider.port_for(local_ip, peer_addr.ip())?;
    // The send queue holds every operation in flight (see `Shared::inflight`).
    let qp_opts = QpOptions {
        max_send_wr: max_inflight.max(1),
        ..qp_opts
    };
    let pd = provider.alloc_pd(&domain)?;
    let cq = provider.create_cq(ours.credits as usize + max_inflight as usize)?;
    let qp = pd.create_qp(&cq, qp_opts)?;
    let mut next_recv = 0;
    post_receives(&*qp, &mut next_recv, ours.credits, ours.max_message)?;
    let mine = Params {
        version: RDMA_VERSION,
        selective_repeat: provider.selective_repeat(),
        bundles: true,
        qpn: qp.qpn(),
        psn: random_psn(),
        udp_port: port.udp_port,
        mtu: port.mtu,
        gid: port.gid,
        timers: QpTimers::of(&qp_opts),
        max_rd_atomic: qp_opts
            .max_rd_atomic
            .min(port.max_rd_atomic)
            .clamp(1, u32::from(u8::MAX)) as u8,
    };
    let exchange = async {
        let mut theirs = [0u8; PARAMS_LEN];
        let io = |e: std::io::Error| Error::Disconnected(format!("RDMA bootstrap: {e}"));
        // The server connects its QP before answering and the client before
        // READY, so no packet reaches a QP that cannot take it yet.
        if server {
            let peer = read_params(&mut stream, &mut theirs).await?;
            let path = connect_qp(&*qp, &mine, &peer, local_ip)?;
            stream.write_all(&mine.encode()).await.map_err(io)?;
            let mut ready = [0u8; 1];
            stream.read_exact(&mut ready).await.map_err(io)?;
            Ok::<_, Error>((peer, path))
        } else {
            stream.write_all(&mine.encode()).await.map_err(io)?;
            let peer = read_params(&mut stream, &mut theirs).await?;
            let path = connect_qp(&*qp, &mine, &peer, local_ip)?;
            stream.write_all(&[1]).await.map_err(io)?;
            Ok((peer, path))
        }
    };
    let (peer, path) = tokio::time::timeout(connect_timeout, exchange)
        .await
        .map_err(|_| Error::TimedOut(connect_timeout))??;
    let mode = if path.selective_repeat {
        "selective repeat"
    } else {
        "go-back-N"
    };
    let info = ConnectionInfo {
        transport: "rdma".into(),
        provider: format!(
            "{} (QPN {:#x} -> {:#x}, MTU {}, {mode}, {} READs/atomics outstanding)",
            provider.device_name(),
            mine.qpn,
            peer.qpn,
            path.mtu,
            path.max_rd_atomic
        ),
        fallback_reason: None,
        local_addr,
        peer_addr: Some(peer_addr),
        capabilities: Capabilities {
            counts_remote_ops: provider.kind() == ProviderKind::Soft,
            ..capabilities(agreed.peer.max_message, max_inflight, agreed.peer.credits)
        },
        authenticated: agreed.authenticated,
        lane: agreed.lane,
        lanes: 1,
    };
    let _ = stream.set_nodelay(true);
    let (rd, wr) = stream.into_split();
    let (ctl_tx, ctl_rx) = mpsc::unbounded_channel();
    let stats = new_stats();
    stats.add(|s| &s.connections, 1);
    qp.attach_stats(stats.clone());
    let sh = Arc::new(Shared {
        _provider: provider.clone(),
        info,
        stats,
        domain,
        pd,
        cq: cq.clone(),
        qp_opts,
        server,
        ours,
        peer_limits: agreed.peer,
        path,
        st: Mutex::new(State {
            qp,
            gen: 0,
            next_psn: mine.psn,
            next_wr: 1,
            next_recv,
            pending: ByWrId::default(),
            resetting: false,
            fresh: None,
            buffered: 0,
            consumed: (0, 0),
            classifying: FxHashMap::default(),
        }),
        ctl: ctl_tx,
        inbox: Mutex::new(Inbox {
            queue: VecDeque::new(),
            waiters: Waiters::new(),
            closed: false,
        }),
        peer_bundles: peer.bundles,
        credits: Mutex::new(Credits {
            msgs: agreed.peer.credits,
            bytes: agreed.peer.window,
        }),
        credit_notify: Notify::new(),
        send_order: tokio::sync::Mutex::new(()),
        inflight: Arc::new(Semaphore::new(max_inflight.max(1) as usize)),
        inflight_max: max_inflight.max(1),
        dead: Mutex::new(None),
        is_dead: AtomicBool::new(false),
        stop: Notify::new(),
        dispatching: Mutex::new(Vec::with_capacity(64)),
    });
    // An in-process provider (soft RoCE) hands completions over in the task
    // that produced them; a NIC's, or a busy-polling waiter's, come through
    // the drive task.
    let weak = Arc::downgrade(&sh);
    let handler: std::sync::Weak<dyn CompletionHandler> = weak;
    let inline = busy_poll.is_none() && cq.set_handler(handler);
    let waiter = CqWaiter::new(cq)?.with_busy_poll(busy_poll);
    let span = info_span!("rdma_conn", peer = %peer_addr, qpn = mine.qpn, server);
    let (msg_tx, msg_rx) = mpsc::unbounded_channel();
    tokio::spawn(ctl_reader(rd, msg_tx).instrument(span.clone()));
    tokio::spawn(ctl_writer(wr, ctl_rx).instrument(span.clone()));
    tokio::spawn(drive(sh.clone(), waiter, inline, msg_rx).instrument(span));
    debug!(
        qpn = mine.qpn,
        peer_qpn = peer.qpn,
        mtu = path.mtu,
        mode,
        "RDMA connection up"
    );
    Ok(RdmaConnection { sh })
}

/// Read the peer's PARAMS: magic and version first, so a peer of another
/// version (whose PARAMS may be shorter) gets a clear mismatch, not a hang.
pub(super) async fn read_params(
    stream: &mut TcpStream,
    buf: &mut [u8; PARAMS_LEN],
) -> Result<Params> {
    let io = |e: std::io::Error| Error::Disconnected(format!("RDMA bootstrap: {e}"));
    stream.read_exact(&mut buf[..6]).await.map_err(io)?;
    Params::check_header(&buf[..6])?;
    stream.read_exact(&mut buf[6..]).await.map_err(io)?;
    Params::decode(buf)
}

fn connect_qp(qp: &dyn QueuePair, mine: &Params, peer: &Params, local: IpAddr) -> Result<QpPeer> {
    let path = QpPeer {
        local,
        qpn: peer.qpn,
        psn: peer.psn,
        addr: SocketAddr::new(peer.gid, peer.udp_port),
        mtu: mine.mtu.min(peer.mtu),
        selective_repeat: mine.selective_repeat && peer.selective_repeat,
        timers: mine.timers.agree(peer.timers),
        max_rd_atomic: u32::from(mine.max_rd_atomic.min(peer.max_rd_atomic)),
    };
    qp.connect(path, mine.psn)?;
    Ok(path)
}

async fn ctl_reader(mut rd: OwnedReadHalf, tx: mpsc::UnboundedSender<std::io::Result<Ctl>>) {
    loop {
        let m = read_ctl(&mut rd).await;
        let end = m.is_err();
        if tx.send(m).is_err() || end {
            return;
        }
    }
}

async fn ctl_writer(mut wr: OwnedWriteHalf, mut rx: mpsc::UnboundedReceiver<Ctl>) {
    let mut buf = Vec::new();
    while let Some(m) = rx.recv().await {
        buf.clear();
        m.encode(&mut buf);
        let mut close = m == Ctl::Close;
        while let Ok(m) = rx.try_recv() {
            m.encode(&mut buf);
            close |= m == Ctl::Close;
        }
        if wr.write_all(&buf).await.is_err() || close {
            let _ = wr.shutdown().await;
            return;
        }
    }
}

/// The connection's own task: completions (unless the provider hands them
/// over itself, `inline`: then only those the provider's tasks did not
/// produce) and control messages.
async fn drive(
    sh: Arc<Shared>,
    mut waiter: CqWaiter,
    inline: bool,
    mut ctl: mpsc::UnboundedReceiver<std::io::Result<Ctl>>,
) {
    let mut wcs = Vec::with_capacity(64);
    loop {
        let cq = &sh.cq;
        let pending = std::future::poll_fn(|cx| {
            if cq.register_waker(cx.waker()) && cq.req_notify().is_ok() && cq.pending() == Some(0) {
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(())
            }
        });
        tokio::select! {
            _ = pending, if inline => sh.dispatch(true),
            r = waiter.next(&mut wcs, 64), if !inline => {
                if let Err(e) = r {
                    sh.die(e);
                    return;
                }
                for wc in wcs.drain(..) {
                    sh.on_completion(wc);
                }
            }
            m = ctl.recv() => match m {
                Some(Ok(Ctl::Close)) => {
                    // Deliver what arrived before the close first.
                    sh.drain_cq();
                    sh.die(Error::Disconnected("peer closed the connection".into()));
                    return;
                }
                Some(Ok(m)) => sh.on_ctl(m),
                Some(Err(e)) => {
                    sh.drain_cq();
                    let why = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        "peer went away (control connection closed)".to_string()
                    } else {
                        format!("control connection: {e}")
                    };
                    sh.die(Error::Disconnected(why));
                    return;
                }
                None => return,
            },
            _ = sh.stop.notified() => return,
        }
        if sh.is_dead.load(Ordering::Acquire) {
            return;
        }
    }
}
