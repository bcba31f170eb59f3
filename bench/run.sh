#!/usr/bin/env bash
# Measure rdmx over TCP against raw TCP, UCX over TCP (ucx_perftest) and
# libfabric's tcp provider (fi_pingpong), in one run on this machine, and
# write BENCHMARKS.md from the results. Everything runs on 127.0.0.1.
#
#   bash bench/run.sh            # full run (several minutes)
#   QUICK=1 BENCH_MD=/tmp/b.md bash bench/run.sh   # short smoke run (CI), report elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=bench/out
# The figure beside the report: the committed one only for BENCHMARKS.md, so
# a run reported elsewhere (BENCH_MD: CI's quick pass) leaves it as it is.
if [ -z "${BENCH_MD:-}" ]; then BENCH_SVG=bench/perf-tcp.svg; else BENCH_SVG=$OUT/perf-tcp.svg; fi
export BENCH_SVG
mkdir -p "$OUT"
rm -f "$OUT"/*
# What was measured, and when: the report names this commit and time, not
# the checkout's or clock's when it is regenerated from $OUT.
printf '%s\n%s\n' "$(git rev-parse --short HEAD)" "$(date -u '+%Y-%m-%d %H:%M UTC')" > "$OUT/run.info"

need() { command -v "$1" >/dev/null 2>&1; }
# The baselines and the loss rules. A missing one used to drop its rows
# silently (each section skips itself without its tools): a fresh machine
# gets them all.
if ! need ucx_perftest || ! need fi_pingpong || ! need qemu-nbd || ! need nbdkit || ! need fio \
  || ! need redis-server || ! need redis-benchmark || ! need memcached || ! need nft; then
  echo "installing ucx-utils, libfabric-bin, qemu-utils, nbdkit, fio, redis, memcached and nftables" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ucx-utils libfabric-bin \
    qemu-utils nbdkit fio redis-server redis-tools memcached nftables >/dev/null
fi

cargo build --release -q -p rdmx-cli
RDMX=target/release/rdmx

# One TCP congestion control for every TCP row, rdmx and baselines alike,
# stated in the report. BBR (this VM's default) paces even on loopback, and
# its pacing rate is a per-connection coin flip: the same 1 MiB round trip
# measured 160-230 µs on one connection and 400-650 µs on the next, raw TCP
# and rdmx alike, and only the local-timer interrupt count told the runs
# apart (about 80 against 2000 per run); under cubic it measured 170-230 µs
# every time. The run moves into a network namespace of its own with that
# algorithm (the sysctl is per namespace), so the host's setting is
# untouched; BENCH_CC picks another one.
BENCH_CC=${BENCH_CC:-cubic}
# pin_cc NS ALGO ROUTE...: make ALGO namespace NS's TCP congestion control.
# The sysctl works where the host lets namespaces choose ALGO
# (net.ipv4.tcp_allowed_congestion_control, in the host's namespace only);
# elsewhere (a host allowing "reno bbr" answers EPERM) each ROUTE of NS
# that the run's connections take gets `congctl ALGO` instead, which the
# kernel honours for every TCP connection over it and which changes nothing
# outside NS.
pin_cc() {
  local ns=$1 cc=$2 r
  shift 2
  ip netns exec "$ns" sysctl -qw net.ipv4.tcp_congestion_control="$cc" 2>/dev/null && return 0
  for r in "$@"; do
    # shellcheck disable=SC2086 # a route is several words
    ip -n "$ns" route replace $r congctl "$cc" || return 1
  done
  echo "bench: $ns: $cc set on its routes (the host lets namespaces choose only: $(sysctl -n net.ipv4.tcp_allowed_congestion_control 2>/dev/null))" >&2
}
LO_ROUTES=("local 127.0.0.0/8 dev lo table local proto kernel scope host src 127.0.0.1"
           "local 127.0.0.1 dev lo table local proto kernel scope host src 127.0.0.1")
if [ -z "${RDMX_BENCH_NETNS:-}" ] && [ "$(id -u)" = 0 ] && need ip; then
  # The namespace has no route to the crate registry: every crate the run's
  # builds need is fetched first.
  cargo fetch -q
  NS=rdmxbench$$
  ip netns add $NS
  # Deleted however the run ends (an interrupt included), not only after it.
  trap 'ip netns del $NS 2>/dev/null || true' EXIT
  rc=0
  if ip -n $NS link set lo up && pin_cc $NS "$BENCH_CC" "${LO_ROUTES[@]}"; then
    RDMX_BENCH_NETNS=$NS RDMX_BENCH_CC=$BENCH_CC ip netns exec $NS bash "$PWD/bench/run.sh" "$@" || rc=$?
  else
    echo "bench: could not set up network namespace $NS with $BENCH_CC" >&2
    rc=1
  fi
  exit $rc
fi
# The namespace's algorithm: its sysctl, or the one pinned on its routes.
CC=${RDMX_BENCH_CC:-$(sysctl -n net.ipv4.tcp_congestion_control 2>/dev/null || echo unknown)}
echo "$CC" >> "$OUT/run.info"
echo "TCP congestion control for this run: $CC${RDMX_BENCH_NETNS:+ (network namespace $RDMX_BENCH_NETNS)}" >&2
if [ -n "${QUICK:-}" ]; then DUR=200; ITERS=500; UN=2000; FI=500; else DUR=1000; ITERS=5000; UN=20000; FI=10000; fi

# listening PORT: wait until something listens on TCP PORT (10 s at most;
# checked with ss, not by connecting: a server such as ucx_perftest takes the
# first connection as its client)
listening() {
  for _ in $(seq 100); do
    [ -n "$(ss -Hltn "sport = :$1" 2>/dev/null)" ] && return 0
    sleep 0.1
  done
  echo "warning: nothing listens on port $1" >&2
  return 1
}
# free_port: a TCP port nothing holds now (the kernel's pick for port 0). A
# random one could be the local port of an open connection (the ephemeral
# range starts at 32768), and a server then never listened there: a CI
# run's quick pass stopped at ucx_perftest on port 32932.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# start_server ARG...: run ARG... in the background ({PORT} in it replaced
# by a free port) until it listens, on up to three ports; sets SRV_PORT and
# SRV_PID, or returns 1 if none listened.
start_server() {
  local try arg argv
  for try in 1 2 3; do
    SRV_PORT=$(free_port)
    argv=()
    for arg in "$@"; do argv+=("${arg//"{PORT}"/$SRV_PORT}"); done
    "${argv[@]}" > /dev/null 2>&1 &
    SRV_PID=$!
    listening "$SRV_PORT" && return 0
    stop_server
  done
  return 1
}
stop_server() { kill "$SRV_PID" 2>/dev/null || true; wait "$SRV_PID" 2>/dev/null || true; }
run() { # name, command...   (records the command for the report)
  local name=$1; shift
  printf '%s\n' "$*" > "$OUT/$name.cmd"
  timeout 600 "$@" > "$OUT/$name.out" 2> "$OUT/$name.err" || echo "warning: $name failed (see $OUT/$name.err)" >&2
}

# What this host charges to wake a thread, on one CPU and across CPUs: the
# context of every row where processes hand work to each other.
echo "rdmx doctor (wake-up probe)" >&2
run doctor $RDMX doctor --json

echo "rdmx perf (interrupt mode, full sweep)" >&2
run rdmx_irq $RDMX perf --loopback --baseline raw-tcp --json --duration-ms $DUR --iters $ITERS \
  --op send,write,read,cas,faa --sizes 8,64,512,4k,32k,256k,1m --window 16
echo "rdmx perf (busy-poll mode, 8 B)" >&2
run rdmx_poll $RDMX perf --loopback --baseline raw-tcp --json --busy-poll-us 100 --mode lat \
  --iters $((ITERS * 4)) --op send,write,read,cas,faa --sizes 8
echo "rdmx perf 8 B round trips against raw TCP (tcp interrupt and busy-poll, soft RoCE) and 1 MiB ones (tcp), three rounds interleaved (one when quick)" >&2
for r in $(if [ -n "${QUICK:-}" ]; then echo 1; else echo 1 2 3; fi); do
  run rdmx_lat8_irq_r$r $RDMX perf --loopback --baseline raw-tcp --json --mode lat --iters $((ITERS * 2)) \
    --op send,write,read --sizes 8
  run rdmx_lat8_poll_r$r $RDMX perf --loopback --baseline raw-tcp --json --busy-poll-us 100 --mode lat \
    --iters $((ITERS * 2)) --op send,write,read --sizes 8
  run rdmx_rdma_lat8_r$r $RDMX perf --loopback --transport rdma --baseline raw-tcp --json --mode lat \
    --iters $((ITERS * 2)) --op send,write,read,cas,faa --sizes 8
  run rdmx_lat1m_r$r $RDMX perf --loopback --baseline raw-tcp --json --mode lat --iters $ITERS \
    --op write,read --sizes 1m
done
echo "rdmx perf over soft RoCE (rdma transport)" >&2
run rdmx_rdma $RDMX perf --loopback --transport rdma --baseline raw-tcp --json --duration-ms $DUR \
  --iters $ITERS --op send,write,read,cas,faa --sizes 8,4k,32k,256k,1m --window 16
echo "1 MiB write and read, soft RoCE against the TCP transport, three rounds interleaved (one when quick)" >&2
for r in $(if [ -n "${QUICK:-}" ]; then echo 1; else echo 1 2 3; fi); do
  for t in tcp rdma; do
    run rdmx_bw1m_${t}_r$r $RDMX perf --loopback --transport $t --json --duration-ms $DUR --iters $ITERS \
      --op write,read --sizes 1m --window 16
  done
done
echo "rdmx perf over soft RoCE with adaptive busy polling (8 B)" >&2
run rdmx_rdma_poll $RDMX perf --loopback --transport rdma --baseline raw-tcp --json --busy-poll-us 100 \
  --mode lat --iters $((ITERS * 4)) --op send,write,read,cas,faa --sizes 8
echo "lanes: 1, 2 and 4 per connection over TCP and soft RoCE, three rounds (one when quick)" >&2
for r in $(if [ -n "${QUICK:-}" ]; then echo 1; else echo 1 2 3; fi); do
  for t in tcp rdma; do
    for l in 1 2 4; do
      run lanes_${t}_${l}_r$r $RDMX perf --loopback --transport $t --lanes $l --json --duration-ms $DUR \
        --iters $((ITERS / 10)) --op write,read --sizes 1m,16m --window 16
    done
  done
done
$RDMX perf --loopback --baseline raw-tcp --duration-ms $DUR --iters $ITERS --op write,read \
  --sizes 8,512,4k,32k,256k,1m --svg "$BENCH_SVG" > /dev/null 2>&1 || true

export UCX_TLS=tcp UCX_NET_DEVICES=lo
ucx() { # name, ucx_perftest client args...
  local name=$1; shift
  if ! start_server timeout 300 ucx_perftest -p {PORT}; then
    echo "warning: $name: no ucx_perftest server listened; its rows are left out" >&2
    return 0
  fi
  run "$name" ucx_perftest 127.0.0.1 -p $SRV_PORT "$@" -f -v
  stop_server
}
echo "UCX over TCP" >&2
ucx ucx_put_lat -t ucp_put_lat -s 8 -n $UN -w 1000
ucx ucx_get_lat -t ucp_get -s 8 -n $((UN / 10)) -w 100
ucx ucx_tag_lat -t tag_lat -s 8 -n $UN -w 1000
ucx ucx_put_lat_sleep -t ucp_put_lat -s 8 -n $UN -w 1000 -E sleep
ucx ucx_put_bw_1m -t ucp_put_bw -s 1048576 -n $((FI / 5)) -w 100
ucx ucx_get_bw_1m -t ucp_get -s 1048576 -n $((FI / 5)) -w 100 -O 16
# Tagged messages (UCX's send/receive), the issue-14 bandwidth baseline.
# 1 MiB streaming against UCX tag_bw in UCX's own shape (a server process and
# a client process, one thread each, 16 in flight, every operation on the
# same 1 MiB buffer of each side, as ucx_perftest allocates one send and one
# receive buffer), three rounds back to back (one when quick): this VM's
# noise is larger than the differences.
for r in $(if [ -n "${QUICK:-}" ]; then echo 1; else echo 1 2 3; fi); do
  ucx ucx_tag_bw_1m_r$r -t tag_bw -s 1048576 -n $((FI / 5)) -w 100
  if ! start_server $RDMX --threads 1 perf server --listen 127.0.0.1:{PORT}; then
    echo "warning: round $r: no rdmx perf server listened; its rows are left out" >&2
    continue
  fi
  port=$SRV_PORT
  run rdmx_stream_r$r $RDMX --threads 1 perf client tcp://127.0.0.1:$port --json --mode bw \
    --duration-ms $DUR --op write,read,send --sizes 1m --window 16 --slots 1
  # Reads into a registered region of the client (read_into), as ib_read_bw's.
  run rdmx_stream_into_r$r $RDMX --threads 1 perf client tcp://127.0.0.1:$port --json --mode bw \
    --duration-ms $DUR --op read --sizes 1m --window 16 --slots 1 --into-region
  # A buffer per operation in flight (16 MiB on the server): what a larger
  # working set costs the caches.
  run rdmx_stream_slots16_r$r $RDMX --threads 1 perf client tcp://127.0.0.1:$port --json \
    --mode bw --duration-ms $DUR --op write,read --sizes 1m --window 16 --slots 16
  stop_server
done

fabric() { # name, size
  local name=$1 size=$2
  if ! start_server timeout 300 fi_pingpong -p tcp -e msg -B {PORT} -S "$size" -I $FI; then
    echo "warning: $name: no fi_pingpong server listened; its rows are left out" >&2
    return 0
  fi
  run "$name" fi_pingpong -p tcp -e msg -P $SRV_PORT -S "$size" -I $FI 127.0.0.1
  stop_server
}
echo "libfabric tcp" >&2
fabric fi_pingpong_8 8
fabric fi_pingpong_1m 1048576

echo "RPC: rdmx-rpc and tonic, over TCP and soft RoCE" >&2
cargo build --release -q -p rdmx-rpc-tonic --example rpc_bench
if [ -n "${QUICK:-}" ]; then RPCDUR=100; else RPCDUR=1000; fi
run rpc_bench target/release/examples/rpc_bench --duration-ms $RPCDUR
# The loaded row (64 B, 64 in flight), three times back to back (noisy on this
# VM): rdmx-rpc with and without frame coalescing, and tonic.
for r in 1 2 3; do
  run rpc_load_r$r target/release/examples/rpc_bench --duration-ms $RPCDUR --sizes 64 --concurrency 64 \
    --systems rdmx-rpc/tcp,rdmx-rpc/tcp-uncoalesced,tonic/tcp
done
# tonic over rdmx against tonic over its own TCP, three times back to back.
for r in 1 2 3; do
  run rpc_tonic_r$r target/release/examples/rpc_bench --duration-ms $RPCDUR --sizes 64,4096,65536,1048576 \
    --concurrency 1,64 --systems tonic/tcp,tonic/rdmx-tcp,tonic/rdmx-soft-roce
done

# Goodput under loss: two network namespaces joined by a veth pair
# (198.18.0.0/15), nftables dropping a random share of UDP 4791 each way,
# `rdmx soak` moving a checked 256 MiB write/read/send mix. Needs root and nft.
if [ "$(id -u)" = 0 ] && need nft && need ip; then
  echo "soft RoCE goodput under loss (netns)" >&2
  NA=rdmxbencha NB=rdmxbenchb
  cleanup() { ip netns del $NA 2>/dev/null || true; ip netns del $NB 2>/dev/null || true; }
  trap cleanup EXIT
  cleanup
  ip netns add $NA && ip netns add $NB
  ip link add rdmxbva type veth peer name rdmxbvb
  ip link set rdmxbva netns $NA && ip link set rdmxbvb netns $NB
  ip -n $NA addr add 198.18.1.1/24 dev rdmxbva && ip -n $NB addr add 198.18.1.2/24 dev rdmxbvb
  for n in $NA $NB; do
    ip -n $n link set lo up
    ip netns exec $n nft add table inet rdmx
    ip netns exec $n nft add chain inet rdmx input '{ type filter hook input priority 0 ; }'
  done
  # No GSO across the veth: nftables must see (and drop) single RoCE packets,
  # not 64 KiB bursts of them.
  ip -n $NA link set rdmxbva gso_max_segs 1 && ip -n $NB link set rdmxbvb gso_max_segs 1
  ip -n $NA link set rdmxbva up && ip -n $NB link set rdmxbvb up
  # (a new namespace starts with the host's algorithm, not ours)
  pin_cc $NA "$CC" "198.18.1.0/24 dev rdmxbva proto kernel scope link src 198.18.1.1" || true
  pin_cc $NB "$CC" "198.18.1.0/24 dev rdmxbvb proto kernel scope link src 198.18.1.2" || true
  # nftables drops PERMILLE/1000 of UDP 4791 each way. The lossless rounds
  # (0) pass through the same rule, which then drops nothing: the rule costs
  # the sending CPU the same per packet at any rate (5-8% of a full
  # window's goodput on this VM, by hand and in the "no rule" rows), and a
  # lossless baseline without it charged that cost to loss recovery. `none`
  # takes the rule away, for one row that shows the injector's own cost.
  set_loss() {
    for n in $NA $NB; do
      ip netns exec $n nft flush chain inet rdmx input
      [ "$1" = none ] || ip netns exec $n nft add rule inet rdmx input udp dport 4791 numgen random mod 1000 '<' "$1" drop
    done
  }
  ip netns exec $NB $RDMX soak server --listen 198.18.1.2:7500 > /dev/null 2>&1 &
  SOAK_RDMA=$!
  ip netns exec $NB $RDMX soak server --transport tcp --listen 198.18.1.2:7501 > /dev/null 2>&1 &
  SOAK_TCP=$!
  sleep 0.5
  BYTES=256m; [ -n "${QUICK:-}" ] && BYTES=32m
  run soak_tcp_0 ip netns exec $NA $RDMX soak client tcp://198.18.1.2:7501 --bytes $BYTES --json
  for permille in 0 1 10 50; do
    set_loss $permille
    run soak_sr_$permille ip netns exec $NA $RDMX soak client rdma://198.18.1.2:7500 --bytes $BYTES --json
    run soak_gbn_$permille ip netns exec $NA $RDMX soak client rdma://198.18.1.2:7500 --bytes $BYTES --json --go-back-n
  done
  # The issue-14 loss targets compare selective repeat at 1% and 5% with its
  # lossless goodput: two more rounds of those three (single runs on this VM
  # vary by a third), interleaved so that a slow spell hits every loss rate.
  if [ -z "${QUICK:-}" ]; then
    for r in 2 3; do
      for permille in 0 10 50; do
        set_loss $permille
        run soak_sr_${permille}_r$r ip netns exec $NA $RDMX soak client rdma://198.18.1.2:7500 --bytes $BYTES --json
      done
    done
  fi
  kill $SOAK_RDMA $SOAK_TCP 2>/dev/null || true
  wait $SOAK_RDMA $SOAK_TCP 2>/dev/null || true
  # A full window (issue 14's shape): 16 writes, then 16 reads, of 1 MiB in
  # flight, selective repeat, three rounds interleaved over the loss rates
  # (and over no rule at all).
  # The perf server's soft device takes UDP 4791 (the soak server's is gone),
  # where nftables drops.
  ip netns exec $NB $RDMX perf server --transport rdma --listen 198.18.1.2:7471 > /dev/null 2>&1 &
  PERF_RDMA=$!
  sleep 0.5
  for r in $(if [ -n "${QUICK:-}" ]; then echo 1; else echo 1 2 3; fi); do
    for permille in none 0 10 50; do
      set_loss $permille
      run loss_window_${permille}_r$r ip netns exec $NA $RDMX perf client rdma://198.18.1.2:7471 --json --mode bw \
        --duration-ms 2000 --op write,read --sizes 1m --window 16
    done
  done
  kill $PERF_RDMA 2>/dev/null || true
  wait $PERF_RDMA 2>/dev/null || true
  cleanup
  trap - EXIT
else
  echo "skipping the netns goodput runs (need root, ip and nft)" >&2
fi

# The KV cache (rdmx-kv): unmodified redis-benchmark against the rdmx RESP
# gateway over two nodes (tcp:// and rdma://) in three rounds, each interleaved
# with a round against redis-server (one when quick), and the
# same shape against memcached (examples/memcached_load.rs: its text protocol,
# 50 connections, -P pipelining, uniform keys); then the native client
# (`rdmx kv bench`, Zipf 0.99 over 1 M keys) with one-sided and RPC GETs.
if need redis-server && need redis-benchmark && need memcached; then
  echo "KV cache: the gateway, redis-server and memcached; rdmx kv bench" >&2
  cargo build --release -q -p rdmx-kv --example memcached_load
  freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
  if [ -n "${QUICK:-}" ]; then KVN=20000; KVKEYS=50000; KVDUR=500; KVWARM=100; else KVN=200000; KVKEYS=1000000; KVDUR=3000; KVWARM=1000; fi
  waitport() { for _ in $(seq 100); do (echo > /dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.1; done; return 1; }
  # Nodes, gateway and the native client (`kv bench`) run one worker thread
  # each (--threads 1), as redis-server runs one: three or four processes
  # share this VM's two cores, and one thread keeps every wake-up on it (a
  # two-thread client spends a fifth of its CPU parking and waking threads).
  : > "$OUT/kv_servers.cmds"
  # redis-server, the baseline, runs throughout: its rounds interleave with
  # the gateway's (this VM's noise moves single runs by a third).
  RP=$(freeport)
  redis-server --port $RP --bind 127.0.0.1 --save "" --appendonly no > "$OUT/kv_redis.log" 2>&1 &
  R=$!
  waitport $RP
  if [ -n "${QUICK:-}" ]; then KVROUNDS=1; else KVROUNDS="1 2 3"; fi
  # redis_load NAME PORT P: redis-benchmark's SET then GET, P pipelined, the
  # same load against the gateway and against redis-server.
  redis_load() {
    run "$1" redis-benchmark -h 127.0.0.1 -p "$2" -c 50 -d 100 -r 100000 -t set,get -n $((KVN * $3 / 2 + KVN / 2)) -P "$3" --csv
  }
  for scheme in tcp rdma; do
    P1=$(freeport); P2=$(freeport); GW=$(freeport)
    n1cmd="$RDMX --threads 1 kv server --listen $scheme://127.0.0.1:$P1 --memory 256m"
    n2cmd="$RDMX --threads 1 kv server --listen $scheme://127.0.0.1:$P2 --memory 256m"
    $n1cmd > "$OUT/kv_node1_$scheme.log" 2>&1 &
    N1=$!
    $n2cmd > "$OUT/kv_node2_$scheme.log" 2>&1 &
    N2=$!
    waitport $P1 && waitport $P2
    NODES=$scheme://127.0.0.1:$P1,$scheme://127.0.0.1:$P2
    gcmd="$RDMX --threads 1 kv resp --listen 127.0.0.1:$GW --nodes $NODES"
    printf '%s\n%s\n%s\n' "$n1cmd" "$n2cmd" "$gcmd" >> "$OUT/kv_servers.cmds"
    $gcmd > "$OUT/kv_gw_$scheme.log" 2>&1 &
    G=$!
    waitport $GW
    for round in $KVROUNDS; do
      for P in 1 16; do
        redis_load kv_gw_${scheme}_P${P}_r$round $GW $P
        redis_load kv_redis_${scheme}_P${P}_r$round $RP $P
      done
    done
    kill $G 2>/dev/null || true
    for value in 100 4096 65536; do
      # Load the hottest keys that fit about 60% of the two nodes' memory.
      LOAD=$(python3 -c "print(min($KVKEYS, int(0.6 * 512 * 2**20 / ($value + 80))))")
      run kv_load_${scheme}_$value $RDMX --threads 1 kv bench --nodes $NODES --keys $KVKEYS --value $value --load $LOAD \
        --duration-ms 1 --json
      for mix in 95 100; do
        for path in one-sided rpc; do
          run kv_bench_${scheme}_${value}_${mix}_$path $RDMX --threads 1 kv bench --nodes $NODES --keys $KVKEYS --value $value \
            --get-percent $mix --path $path --duration-ms $KVDUR --warmup-ms $KVWARM --no-load --json
        done
      done
      if [ "$value" = 100 ]; then
        # The target row (100 B, 100% GET): three more rounds, the two paths
        # interleaved, for a median and its spread.
        for round in 1 2 3; do
          for path in one-sided rpc; do
            run kv_bench_${scheme}_100_100_${path}_r$round $RDMX --threads 1 kv bench --nodes $NODES --keys $KVKEYS --value 100 \
              --get-percent 100 --path $path --duration-ms $KVDUR --warmup-ms $KVWARM --no-load --json
          done
        done
      fi
    done
    kill $N1 $N2 2>/dev/null || true
    wait $N1 $N2 $G 2>/dev/null || true
  done
  kill $R 2>/dev/null || true
  MP=$(freeport)
  memcached -p $MP -l 127.0.0.1 -m 512 -U 0 -t 2 -u root > "$OUT/kv_memcached.log" 2>&1 &
  M=$!
  waitport $MP
  for P in 1 16; do
    run kv_memcached_P$P target/release/examples/memcached_load 127.0.0.1:$MP -c 50 -d 100 -r 100000 -n $((KVN * P / 2 + KVN / 2)) -P $P
  done
  kill $M 2>/dev/null || true
  wait $R $M 2>/dev/null || true
else
  echo "skipping the KV rows (need redis-server, redis-benchmark, memcached)" >&2
fi

# Block storage (rdmx-block): fio's nbd engine against the rdmx NBD export
# (its namespace reached by NVMe over rdmx on tcp:// and on rdma://, soft
# RoCE), qemu-nbd on a tmpfs file and nbdkit's memory plugin, each serving
# 1 GiB of RAM, interleaved in rounds (medians and spread over the rounds);
# then the native Initiator (`rdmx block bench`) at qd1 and qd32.
if need fio && need qemu-nbd && need nbdkit; then
  echo "block: fio nbd against rdmx, qemu-nbd and nbdkit; rdmx block bench" >&2
  bwait() { for _ in $(seq 100); do (echo > /dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.1; done; return 1; }
  if [ -n "${QUICK:-}" ]; then BRT=1; REPS=1; else BRT=5; REPS=3; fi
  BPIDS=()
  declare -A BURI BFAB
  # The rdmx processes run one worker thread each (--threads 1): they share
  # this VM's two cores with fio and each other, and one thread keeps every
  # wake-up on it (qemu-nbd's main loop is single-threaded too). A third
  # pair busy-polls its rdmx connections for 100 µs before sleeping.
  : > "$OUT/block_servers.cmds"
  for cfg in tcp:tcp: rdma:rdma: tcp_poll:tcp:--busy-poll-us=100; do
    IFS=: read -r name scheme poll <<< "$cfg"
    poll=${poll/=/ }
    P0=$(free_port); P1=$(free_port); P2=$(free_port)
    scmd="$RDMX --threads 1 block serve --ram 1g --nvme-tcp 127.0.0.1:$P0 --rdmx $scheme://127.0.0.1:$P1 $poll"
    ncmd="$RDMX --threads 1 block nbd --listen 127.0.0.1:$P2 --target $scheme://127.0.0.1:$P1 $poll"
    echo "$name|$scmd|$ncmd" >> "$OUT/block_servers.cmds"
    $scmd > "$OUT/block_target_$name.log" 2>&1 &
    BPIDS+=($!)
    bwait $P0
    sleep 0.3
    $ncmd > "$OUT/block_nbd_$name.log" 2>&1 &
    BPIDS+=($!)
    bwait $P2
    BURI[rdmx_$name]=nbd://127.0.0.1:$P2/rdmx
    BFAB[$name]=$scheme://127.0.0.1:$P1
  done
  QIMG=/dev/shm/rdmx-bench-qemu-nbd.img
  rm -f $QIMG && truncate -s 1G $QIMG
  PQ=$(free_port)
  qemu-nbd -f raw -x rdmx -b 127.0.0.1 -p $PQ -t $QIMG > "$OUT/block_qemu_nbd.log" 2>&1 &
  BPIDS+=($!)
  bwait $PQ
  BURI[qemu_nbd]=nbd://127.0.0.1:$PQ/rdmx
  PK=$(free_port)
  nbdkit -f -i 127.0.0.1 -p $PK memory 1G > "$OUT/block_nbdkit.log" 2>&1 &
  BPIDS+=($!)
  bwait $PK
  BURI[nbdkit]=nbd://127.0.0.1:$PK/rdmx
  for rep in $(seq $REPS); do
    for job in rr4k_qd1:randread:4k:1 rr4k_qd32:randread:4k:32 rw4k_qd1:randwrite:4k:1 rw4k_qd32:randwrite:4k:32 seq128k_qd32:read:128k:32; do
      IFS=: read -r jname jrw jbs jqd <<< "$job"
      for server in rdmx_tcp rdmx_rdma rdmx_tcp_poll qemu_nbd nbdkit; do
        run block_fio_${server}_${jname}_r$rep fio --name=$jname --ioengine=nbd --uri=${BURI[$server]} \
          --rw=$jrw --bs=$jbs --iodepth=$jqd --runtime=$BRT --time_based --output-format=json
      done
    done
    for scheme in tcp rdma; do
      for job in rr4k_qd1:randread:4k:1 rr4k_qd32:randread:4k:32 rw4k_qd32:randwrite:4k:32 seq128k_qd32:read:128k:32; do
        IFS=: read -r jname jrw jbs jqd <<< "$job"
        run block_native_${scheme}_${jname}_r$rep $RDMX --threads 1 block bench --target ${BFAB[$scheme]} --rw $jrw \
          --bs $jbs --qd $jqd --duration-ms $((BRT * 1000)) --json
      done
    done
  done
  kill "${BPIDS[@]}" 2>/dev/null || true
  wait "${BPIDS[@]}" 2>/dev/null || true
  rm -f $QIMG
else
  echo "skipping the block rows (need fio, qemu-nbd, nbdkit)" >&2
fi

REPORT=${BENCH_MD:-BENCHMARKS.md}
python3 bench/report.py "$OUT" > "$REPORT"
echo "wrote $REPORT" >&2
