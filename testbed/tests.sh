#!/usr/bin/env bash
# testbed/tests.sh [TEST...]   rdmx against the Linux kernel's own RoCEv2
# stack (rdma_rxe through the real libibverbs) in throw-away guests.
# Needs root, a built workspace (see below) and a prepared testbed
# (testbed/prepare.sh; done on first use). Tests (default: all):
#
#   conformance-hw   the conformance suite through the NIC provider on rxe
#                    (client and server in one process, over the rxe device)
#   doctor           `rdmx doctor` in a guest reports rxe0, its RoCEv2 GID and port
#   nic-example      transport-rdma's `nic` example (the NIC provider's user
#                    guide in code) runs on rxe: every operation it checks passes
#   soft-hw          host soft engine <-> guest NIC provider on rxe: `rdmx soak`
#                    (every operation, data checked) and `rdmx perf` (every op,
#                    0 B..16 MiB), each side as client and as server
#   soft-hw-loss     the same soak with 1% and 5% loss (netem in the guest):
#                    go-back-N against rxe, still exact
#   pingpong         rdma-core's ibv_rc_pingpong in a guest (on rxe) against
#                    `rdmx pingpong` (soft engine) on the host, both roles,
#                    several sizes; every echoed message checked
#   perftest         unmodified perftest (ib_write_bw, ib_read_bw, ib_send_bw,
#                    ib_atomic_bw with FETCH_AND_ADD and CMP_AND_SWAP,
#                    ib_write_lat) in a guest on rxe against `rdmx perf
#                    --perftest` (soft engine) on the host, both roles; both
#                    ends must complete and report, rdmx checks what it can
#   nvme-tcp         the Linux kernel's NVMe/TCP host in a guest against `rdmx
#                    block serve` on the host: discover, connect, size, fio
#                    with crc32c verify, mkfs.ext4, a tree of files with known
#                    checksums, fsck clean, remount, disconnect and reconnect;
#                    RAM, then a file opened O_DIRECT with header and data
#                    digests and two I/O queues; the target killed (-9)
#                    mid-I/O and restarted: the host reconnects and flushed
#                    data is intact; and the same checks against the kernel's
#                    own nvmet-tcp target, to show the checks are right
#   nbd              the kernel's NBD client (nbd-client) in a guest against
#                    `rdmx block nbd` on the host, whose namespace is reached
#                    by NVMe over rdmx on soft RoCE: O_DIRECT data, ext4 with
#                    checksummed files, fsck clean; then the same with the
#                    export in the guest, its Initiator on rxe (NIC provider)
#                    and the target on the host; and with the target on rxe in
#                    the guest (nbdcopy and fio's verify through the export)
#   captures         captures of rxe<->rxe (perftest, ibverbs-utils and rdmx on
#                    both ends, a lossy run) and soft<->rxe (rdmx soaks, a lossy
#                    one; perftest with RNR NAKs; rc_pingpong and sends with
#                    immediate): `rdmx pcap check` verifies every packet, and
#                    every opcode must be there
#
# Builds it uses (CI makes them; so can you):
#   cargo build --release -p rdmx-cli --features hw
#   cargo test -p rdmx-transport-rdma --features hw --test conformance_hw --no-run
#   cargo build --release -p rdmx-transport-rdma --features hw --example nic
# Environment: RDMX_TESTBED_DIR (prepared files), RDMX_TESTBED_OUT (logs; a
# temp dir by default), RDMX_TESTBED_SCALE (bytes of the 16 MiB soaks, 64m).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
cd "$ROOT"
OUT=${RDMX_TESTBED_OUT:-$(mktemp -d /tmp/rdmx-testbed-out.XXXXXX)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SCALE=${RDMX_TESTBED_SCALE:-64m}
RDMX=$ROOT/target/release/rdmx
export RDMX_TESTBED_DIR=${RDMX_TESTBED_DIR:-/var/tmp/rdmx-testbed}
"$HERE/prepare.sh" "$RDMX_TESTBED_DIR" >/dev/null || exit 1
[[ -x $RDMX ]] || { echo "tests.sh: build $RDMX first (cargo build --release -p rdmx-cli --features hw)" >&2; exit 1; }

NS=""
BG=()   # host programs started in the background (servers, captures)
cleanup() {
  ((${#BG[@]} == 0)) || kill "${BG[@]}" 2>/dev/null
  BG=()
  [[ -z $NS ]] || "$HERE/net.sh" down "$NS"
  NS=""
}
trap cleanup EXIT
# A run killed outright (SIGKILL skips the EXIT trap) leaves its namespace
# behind, taps and bridge included: remove those whose run is gone.
for old in $(ip netns list 2>/dev/null | awk '$1 ~ /^rdmxtb[0-9]+$/ {print $1}'); do
  kill -0 "${old#rdmxtb}" 2>/dev/null || "$HERE/net.sh" down "$old"
done
net_up() { NS=rdmxtb$$; "$HERE/net.sh" up "$NS" "${@:-tap0}"; }
ns() { ip netns exec "$NS" "$@"; }
# bg CMD...: run CMD in the namespace in the background (its pid in BG;
# `ip netns exec` execs, so the pid is CMD's own)
bg() { ip netns exec "$NS" "$@" & BG+=($!); }
guest() { "$HERE/guest.sh" "$@"; }
# WHY: what failed and how, one line each, printed again after the summary
# (CI shows only the end of the output)
WHY=()
# failed MSG: note that MSG went wrong in the test being run; returns 1
failed_because() { WHY+=("$CURRENT: $*"); return 1; }
# fail_step MSG: failed_because MSG, counted in the calling check's `fails`
fail_step() { failed_because "$@"; fails=$((fails + 1)); }
# tail_of FILE...: the last lines of each FILE, on one line
tail_of() { local f; for f; do printf '[%s] %s ' "${f##*/}" "$(tail -n 3 "$f" 2>/dev/null | tr '\n' ';')"; done; }

# wait_tcp ADDR PORT SECONDS: until something listens there (from the netns)
wait_tcp() {
  local end=$((SECONDS + $3))
  until ns bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; do
    ((SECONDS < end)) || return 1
    sleep 0.5
  done
}

# reachable ADDR PORT: a TCP connect there succeeds within 3 tries of 3 s;
# wait_tcp's twin for inside a guest (pass it as "$(declare -f reachable)").
# After a failed run it tells a stopped network from a failure of the code
# under test.
reachable() {
  local k
  for k in 1 2 3; do
    timeout 3 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}

# never_connected FILE: the attempt logged in FILE failed at its first
# connect and did nothing else (every line of it says so), so running it
# again repeats nothing the guest's program has seen
never_connected() {
  [[ -s $1 ]] && ! grep -qv "connect failed" "$1"
}

# ---------------------------------------------------------------------------
t_conformance-hw() {
  local bin
  bin=$(cargo test -q -p rdmx-transport-rdma --features hw --test conformance_hw --no-run \
          --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("executable") and m.get("target", {}).get("name") == "conformance_hw":
        print(m["executable"])')
  [[ -x $bin ]] || { echo "no conformance_hw test binary"; return 1; }
  # Every case (the 17 conformance cases with one lane and with four, the
  # four-lane check of the lanes, and the path MTU: 36 tests),
  # with the path MTU checked: rxe on a 1500-byte Ethernet has 1024.
  guest --mem 3072 --nic -=198.18.0.2/24 --rxe --timeout 900 -c \
    "RDMX_TEST_RDMA_ADDR=198.18.0.2 RDMX_RDMA_DEVICE=rxe0 RDMX_TEST_EXPECT_MTU=1024 \
     $bin --ignored --test-threads=1" > "$OUT/conformance-hw.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/conformance-hw.log"
  ((rc == 0)) && grep -q "test result: ok. 36 passed" "$OUT/conformance-hw.log"
}

t_doctor() {
  guest --nic -=198.18.0.2/24 --rxe -- "$RDMX" doctor > "$OUT/doctor.log" 2>&1 || { cat "$OUT/doctor.log"; return 1; }
  cat "$OUT/doctor.log"
  grep -q '^provider a connection would use: hw (rxe0' "$OUT/doctor.log" &&
    grep -q '^rxe0 port 1: 4: ACTIVE, Ethernet, active MTU 1024' "$OUT/doctor.log" &&
    grep -q 'GID\[1\] 198.18.0.2 RoceV2 on eth0' "$OUT/doctor.log"
}

t_nic-example() {
  local bin=$ROOT/target/release/examples/nic
  cargo build -q --release -p rdmx-transport-rdma --features hw --example nic || return 1
  guest --nic -=198.18.0.2/24 --rxe -c "RDMX_RDMA_DEVICE=rxe0 $bin 198.18.0.2" > "$OUT/nic-example.log" 2>&1
  local rc=$?
  cat "$OUT/nic-example.log"
  # the NIC provider on rxe0 (not the soft engine), and every check passed
  ((rc == 0)) && grep -q '^provider: rxe0 (QPN' "$OUT/nic-example.log" &&
    grep -q '^100 messages of 1..100 bytes echoed intact' "$OUT/nic-example.log"
}

# GUEST_NIC_REPORT: shell for inside a guest after a failed run: its NIC's
# counters, its transmit queue's backlog, the virtio interrupts taken and the
# kernel's last words, so an emulated NIC that stopped shows how it stopped
# (a backlog that never drains, interrupts that no longer come, rxe's
# "Failed sending ACK"), or that the guest's kernel warned: a whole warning
# with its stack fits in the last 80 lines once rxe's "speed is unknown"
# lines (one per connection) are left out.
GUEST_NIC_REPORT='ip -s link show eth0; tc -s qdisc show dev eth0; grep -i virtio /proc/interrupts; dmesg | grep -v "speed is unknown" | tail -n 80'

# again_if_net_stopped NAME WHAT CMD...: run CMD (a run between the host and
# a guest, logging to $OUT/NAME.client and .server). If it returns 2 (it
# failed, and the two ends could then not reach each other at all), keep
# those logs as *.net-stopped and run CMD once more, in a fresh guest,
# saying so. A failure with the network up (1) is never run again. Returns
# CMD's last status.
again_if_net_stopped() {
  local name=$1 what=$2 how f
  shift 2
  "$@"
  how=$?
  ((how == 2)) || return "$how"
  echo "$what: the guest's network stopped (see $OUT/$name.*.net-stopped); once more in a fresh guest"
  for f in "$OUT/$name".{client,server}; do
    [[ -e $f ]] && mv "$f" "$f.net-stopped"
  done
  "$@"
}

# soak_run WHO-SERVES LOSS CHUNK BYTES TAG: a soak between the host's soft
# engine and the guest's NIC provider (the guest serves when WHO-SERVES is
# "guest"), logged to $OUT/TAG.client and .server. Returns 0 when the client
# verified every byte over go-back-N between the expected providers; 2 when
# it failed and the two ends could then not reach each other (a TCP connect
# to the soak server's port from the client's side: `reachable` in the
# guest, wait_tcp on the host); 1 otherwise.
# Why 2: in one CI run (stop 52) two soaks failed with the host's soft
# client out of retries while the guest's kernel logged rxe's "Failed
# sending ACK" every 70 ms to the end, as in the perf runs (perf_pair) that
# left a guest unreachable. Session 54 caught it with QEMU's monitor
# (guest.sh --monitor): the guest idle in its halt loop, its RX virtqueue
# holding ~240 posted buffers, QEMU still moving ARP requests into it, and
# the guest's NET_RX softirq count frozen: its receive interrupts no longer
# arrived. guest.sh now turns the NIC's event-index notification off; this
# rerun stays for whatever is left.
soak_run() {
  local serves=$1 loss=$2 chunk=$3 bytes=$4 tag=$5 rc netem=""
  [[ $loss == 0 ]] || netem="tc qdisc add dev eth0 root netem loss $loss% &&"
  net_up
  if [[ $serves == host ]]; then
    bg "$RDMX" soak server --listen 198.18.0.1:7500 --transport rdma > "$OUT/$tag.server" 2>&1
    wait_tcp 198.18.0.1 7500 10 || { echo "host soak server did not start" >> "$OUT/$tag.server"; cleanup; return 1; }
    guest --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --modprobe sch_netem --timeout 600 -c \
      "$netem $RDMX soak client rdma://198.18.0.1:7500 --bytes $bytes --chunk $chunk --json; rc=\$?;
       if [ \$rc != 0 ]; then
         $(declare -f reachable)
         $GUEST_NIC_REPORT
         if reachable 198.18.0.1 7500; then echo 'network: up'; else echo 'network: stopped'; fi
       fi; exit \$rc" > "$OUT/$tag.client" 2>&1
  else
    local flag=$OUT/flag.$tag
    mkdir -p "$flag"
    rm -f "$flag/done" "$flag/failed"
    guest --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --modprobe sch_netem --timeout 600 \
      --rw "$flag" -c \
      "$netem ($RDMX soak server --listen 198.18.0.2:7500 --transport rdma &) ;
       while [ ! -e $flag/done ]; do sleep 0.2; done
       if [ -e $flag/failed ]; then $GUEST_NIC_REPORT; fi" > "$OUT/$tag.server" 2>&1 &
    local g=$!
    if wait_tcp 198.18.0.2 7500 60; then
      ns env RDMX_RDMA_PROVIDER=soft "$RDMX" soak client rdma://198.18.0.2:7500 \
        --bytes "$bytes" --chunk "$chunk" --json > "$OUT/$tag.client" 2>&1
      rc=$?
      if ((rc != 0)); then
        touch "$flag/failed"
        if wait_tcp 198.18.0.2 7500 9; then echo "network: up"; else echo "network: stopped"; fi >> "$OUT/$tag.client"
      fi
    else
      echo "guest soak server did not start" > "$OUT/$tag.client"
    fi
    touch "$flag/done"
    wait "$g"
  fi
  cleanup
  # The JSON says it all: verified, the provider, the bytes.
  python3 - "$(grep '^{' "$OUT/$tag.client" | tail -1)" "$serves" "$bytes" <<'PY' && return 0
import json, sys
r = json.loads(sys.argv[1] or "{}")
want_client = "rxe0" if sys.argv[2] == "host" else "soft-roce"
scale = sys.argv[3].lower()
n = int(scale[:-1]) << {"k": 10, "m": 20, "g": 30}[scale[-1]] if scale[-1] in "kmg" else int(scale)
ok = r.get("verified") is True and r.get("bytes") == n and want_client in r.get("provider", "") \
     and "go-back-N" in r.get("provider", "")
sys.exit(0 if ok else 1)
PY
  grep -q '^network: stopped' "$OUT/$tag.client" && return 2
  return 1
}

# soak_pair WHO-SERVES LOSS CHUNK BYTES: soak_run, once more in a fresh
# guest if the guest's network stopped; prints the client's report.
soak_pair() {
  local tag="soak-$1-serves-$2-$3" line how
  again_if_net_stopped "$tag" "soak, $1 serves, $2% loss, $3-byte chunks" soak_run "$@" "$tag"
  how=$?
  line=$(grep '^{' "$OUT/$tag.client" | tail -1)
  printf '%-38s %s\n' "$tag" "${line:-$(tail -3 "$OUT/$tag.client")}"
  ((how == 0)) || failed_because "$tag: $(tail_of "$OUT/$tag.client" "$OUT/$tag.server")"
}

# perf_pair WHO-SERVES: `rdmx perf` between the host's soft engine and the
# guest's NIC provider on rxe, every op and size (the guest serves when
# WHO-SERVES is "guest"). Returns 0 when it ran and printed its 19 rows
# (write and read at 6 sizes, send at 5: perf's echo protocol has no 0-byte
# send, the conformance suite on rxe sends 0-byte messages; cas and faa at
# 8 bytes); 2 when it failed and the two ends could not then reach each
# other at all (`reachable`); 1 otherwise.
# Why 2: under TCG the host answers a 16 MiB READ (and echoes a 16 MiB send)
# far faster than the guest takes it in, and the tap drops most of it. In
# 44 rounds of a loop of the host-serves run (send, write and read at 1 and
# 16 MiB), one failed and left the guest unreachable for good (its next
# connects got "No route to host" for the rest of that boot). The guest-
# serves run fails so far more often (CI at 310af36: twice in a row, the
# guest still receiving and sending, rxe still retrying, TCP unanswered):
# the guest's receive interrupts stopped (see soak_run).
perf_pair() {
  local serves=$1 tag="perf-$1-serves" rc
  local args=(--op send,write,read,cas,faa --sizes 0,8,4k,64k,1m,16m --iters 20
              --duration-ms 200 --window 2 --policy require)
  net_up
  if [[ $serves == host ]]; then
    bg "$RDMX" perf server --listen 198.18.0.1:7471 --transport rdma > "$OUT/$tag.server" 2>&1
    wait_tcp 198.18.0.1 7471 10 || { echo "host perf server did not start" >> "$OUT/$tag.server"; cleanup; return 1; }
    # the guest probes the host with `reachable` (wait_tcp runs on the host)
    guest --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --timeout 600 -c \
      "$RDMX perf client rdma://198.18.0.1:7471 ${args[*]}; rc=\$?;
       if [ \$rc != 0 ]; then
         $(declare -f reachable)
         $GUEST_NIC_REPORT
         if reachable 198.18.0.1 7471; then echo 'network: up'; else echo 'network: stopped'; fi
       fi; exit \$rc" > "$OUT/$tag.client" 2>&1
    rc=$?
  else
    local flag=$OUT/flag.perf
    mkdir -p "$flag"
    rm -f "$flag/done" "$flag/failed"
    guest --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --timeout 600 --rw "$flag" -c \
      "($RDMX perf server --listen 198.18.0.2:7471 --transport rdma &) ;
       while [ ! -e $flag/done ]; do sleep 0.2; done
       if [ -e $flag/failed ]; then $GUEST_NIC_REPORT; fi" \
      > "$OUT/$tag.server" 2>&1 &
    local g=$!
    if wait_tcp 198.18.0.2 7471 60; then
      ns env RDMX_RDMA_PROVIDER=soft "$RDMX" perf client rdma://198.18.0.2:7471 "${args[@]}" \
        > "$OUT/$tag.client" 2>&1
      rc=$?
      if ((rc != 0)); then
        touch "$flag/failed"
        if wait_tcp 198.18.0.2 7471 9; then echo "network: up"; else echo "network: stopped"; fi >> "$OUT/$tag.client"
      fi
    else
      echo "guest perf server did not start" >> "$OUT/$tag.client"
      rc=1
    fi
    touch "$flag/done"
    wait "$g"
  fi
  cleanup
  ((rc == 0)) || { grep -q '^network: stopped' "$OUT/$tag.client" && return 2; return 1; }
  [[ $(grep -c '^rdma ' "$OUT/$tag.client") == 19 ]] || { echo "not 19 rows" >> "$OUT/$tag.client"; return 1; }
}

t_soft-hw() {
  local fails=0 serves
  for serves in host guest; do
    # 1-byte operations, odd multi-packet ones, and 16 MiB ones
    soak_pair "$serves" 0 1 2000 || fails=$((fails + 1))
    soak_pair "$serves" 0 4097 4m || fails=$((fails + 1))
    soak_pair "$serves" 0 16m "$SCALE" || fails=$((fails + 1))
  done
  # perf, every operation and size, both ways round (completion, not data:
  # the soaks above check data). Two in flight: 16 × 16 MiB at the 20 MB/s a
  # TCG guest moves would outlast perf's 10 s operation timeout.
  # A run whose guest's emulated NIC went deaf or mute (perf_pair) says
  # nothing about rdmx: it runs once more in a fresh guest, and says so.
  for serves in host guest; do
    again_if_net_stopped "perf-$serves-serves" "perf, $serves serves" perf_pair "$serves" || fail_step "perf, $serves serves: $(tail_of "$OUT/perf-$serves-serves".{client,server})"
    cat "$OUT/perf-$serves-serves.client"
  done
  ((fails == 0))
}

t_soft-hw-loss() {
  local fails=0 serves loss
  for loss in 1 5; do
    for serves in host guest; do
      soak_pair "$serves" "$loss" 1m 16m || fails=$((fails + 1))
    done
  done
  ((fails == 0))
}

# capture NAME CMD...: run CMD while the bridge is captured to $OUT/NAME.pcapng
capture() {
  local name=$1; shift
  ip netns exec "$NS" dumpcap -q -i br0 -f "udp port 4791" -w "$OUT/$name.pcapng" 2>/dev/null &
  local cap=$!
  sleep 1
  "$@"
  local rc=$?
  sleep 0.5
  kill -INT "$cap"; wait "$cap" 2>/dev/null
  return $rc
}

# check_capture FILE OPCODE...: `rdmx pcap check` passes, and each opcode
# (as the summary names it; "NAK" for a sequence NAK, "RNR" for an RNR NAK)
# is in it
check_capture() {
  local f=$1; shift
  CHECK_WHY="pcap check failed"
  "$RDMX" pcap check -v "$f" > "$f.check" 2>&1 || { grep -v 'icrc ok$' "$f.check" | tail; return 1; }
  grep -v 'icrc ok$' "$f.check"
  local missing=""
  for op in "$@"; do
    case $op in
      NAK) grep -q 'aeth=Nak(PsnSequenceError)' "$f.check" || missing+=" $op" ;;
      RNR) grep -q 'aeth=RnrNak' "$f.check" || missing+=" $op" ;;
      *) grep -qE "^  $op( |$)" "$f.check" || missing+=" $op" ;;
    esac
  done
  CHECK_WHY="missing:$missing"
  [[ -z $missing ]] || { echo "missing from $f:$missing"; return 1; }
}

t_captures() {
  # why: what failed, printed last (CI shows the end of the output)
  local why=()
  # rxe <-> rxe: two guests
  net_up tap0 tap1
  mkdir -p "$OUT/pair"
  rm -f "$OUT"/pair/*-at-* "$OUT"/pair/client-done-*
  pair() {
    guest --name a --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --modprobe sch_netem --timeout 900 \
      --rw "$OUT/pair" -- "$HERE/rxe-pair.sh" server 198.18.0.3 "$OUT/pair" > "$OUT/pair-server.log" 2>&1 &
    local a=$!
    guest --name b --netns "$NS" --nic tap1=198.18.0.3/24 --rxe --modprobe sch_netem --timeout 900 \
      --rw "$OUT/pair" -- "$HERE/rxe-pair.sh" client 198.18.0.2 "$OUT/pair" > "$OUT/pair-client.log" 2>&1
    local rb=$?
    wait "$a"
    local ra=$?
    grep -h '^### .*rc=' "$OUT/pair-server.log" "$OUT/pair-client.log"
    ((ra == 0 && rb == 0))
  }
  capture rxe-rxe pair || why+=("rxe-rxe run: $(grep -h '^### .*rc=[^0]' "$OUT/pair-server.log" "$OUT/pair-client.log" | tr '\n' ';')")
  cleanup
  check_capture "$OUT/rxe-rxe.pcapng" SEND_FIRST SEND_MIDDLE SEND_LAST SEND_ONLY \
    RDMA_WRITE_FIRST RDMA_WRITE_MIDDLE RDMA_WRITE_LAST RDMA_WRITE_ONLY \
    RDMA_WRITE_LAST_WITH_IMMEDIATE RDMA_READ_REQUEST RDMA_READ_RESPONSE_FIRST \
    RDMA_READ_RESPONSE_MIDDLE RDMA_READ_RESPONSE_LAST RDMA_READ_RESPONSE_ONLY \
    ACKNOWLEDGE ATOMIC_ACKNOWLEDGE COMPARE_SWAP FETCH_ADD \
    UC_SEND_FIRST UC_SEND_LAST UC_RDMA_WRITE_FIRST UC_RDMA_WRITE_LAST \
    UD_SEND_ONLY "UD_SEND_ONLY \(CM ConnectRequest\)" "UD_SEND_ONLY \(CM ConnectReply\)" \
    "UD_SEND_ONLY \(CM ReadyToUse\)" NAK || why+=("rxe-rxe capture: $CHECK_WHY")
  # soft (host) <-> rxe (guest): a soak each way round, the second lossy
  net_up
  soft_rxe() {
    bg "$RDMX" soak server --listen 198.18.0.1:7500 --transport rdma > "$OUT/soft-rxe.server" 2>&1
    wait_tcp 198.18.0.1 7500 10 || return 1
    guest --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --modprobe sch_netem --timeout 600 -c \
      "$RDMX soak client rdma://198.18.0.1:7500 --bytes 12k --chunk 1000 &&
       $RDMX soak client rdma://198.18.0.1:7500 --bytes 40k --chunk 4097 &&
       tc qdisc add dev eth0 root netem loss 10% &&
       $RDMX soak client rdma://198.18.0.1:7500 --bytes 128k --chunk 32k" > "$OUT/soft-rxe.client" 2>&1
  }
  capture soft-rxe soft_rxe || why+=("soft-rxe run: $(tail -n 3 "$OUT/soft-rxe.client" | tr '\n' ';')")
  cleanup
  check_capture "$OUT/soft-rxe.pcapng" SEND_ONLY RDMA_WRITE_FIRST RDMA_WRITE_MIDDLE \
    RDMA_WRITE_LAST RDMA_WRITE_ONLY RDMA_WRITE_LAST_WITH_IMMEDIATE RDMA_READ_REQUEST \
    RDMA_READ_RESPONSE_FIRST RDMA_READ_RESPONSE_MIDDLE RDMA_READ_RESPONSE_LAST \
    RDMA_READ_RESPONSE_ONLY ACKNOWLEDGE ATOMIC_ACKNOWLEDGE COMPARE_SWAP FETCH_ADD \
    NAK || why+=("soft-rxe capture: $CHECK_WHY")
  # soft (host) <-> rxe (guest) under unmodified verbs programs: ib_send_bw
  # with two receives posted against rdmx's window of 64 sends (RNR NAKs),
  # then ibv_rc_pingpong against `rdmx pingpong --imm` (sends with immediate)
  net_up
  soft_rxe_verbs() {
    guest --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --timeout 300 -c \
      "ib_send_bw -d rxe0 -x 1 -r 2 -s 64 -n 150 && ibv_rc_pingpong -d rxe0 -g 1 -s 64 -n 10 &&
       ibv_rc_pingpong -d rxe0 -g 1 -s 3000 -n 10" > "$OUT/soft-rxe-verbs.guest" 2>&1 &
    local g=$! c i rc=0
    for c in "perf --perftest 198.18.0.2 --op send --mode bw --sizes 64 --iters 150 --window 64" \
             "pingpong 198.18.0.2 --imm --size 64 --iters 10" \
             "pingpong 198.18.0.2 --imm --size 3000 --iters 10"; do
      # retry only while the guest's program is not listening yet; any other
      # failure ends the run (and its message stays last in the log)
      for i in $(seq 120); do
        ns "$RDMX" $c > "$OUT/soft-rxe-verbs.attempt" 2>&1 && { cat "$OUT/soft-rxe-verbs.attempt" >> "$OUT/soft-rxe-verbs.host"; break; }
        cat "$OUT/soft-rxe-verbs.attempt" >> "$OUT/soft-rxe-verbs.host"
        never_connected "$OUT/soft-rxe-verbs.attempt" && ((i < 120)) || { rc=1; break; }
        sleep 0.5
      done
      ((rc == 0)) || break
    done
    wait "$g" && ((rc == 0))
  }
  : > "$OUT/soft-rxe-verbs.host"
  capture soft-rxe-verbs soft_rxe_verbs ||
    why+=("soft-rxe-verbs run: host: $(tail -n 3 "$OUT/soft-rxe-verbs.host" | tr '\n' ';') guest: $(tail -n 3 "$OUT/soft-rxe-verbs.guest" | tr '\n' ';')")
  cleanup
  check_capture "$OUT/soft-rxe-verbs.pcapng" SEND_ONLY SEND_FIRST SEND_MIDDLE SEND_LAST \
    SEND_ONLY_WITH_IMMEDIATE SEND_LAST_WITH_IMMEDIATE ACKNOWLEDGE RNR NAK || why+=("soft-rxe-verbs capture: $CHECK_WHY")
  ((${#why[@]} == 0)) && return 0
  local w
  for w in "${why[@]}"; do failed_because "$w"; done
  printf 'captures failed: %s\n' "${why[@]}"
  return 1
}

t_pingpong() {
  local fails=0 size n=100
  for size in 64 4096 10000; do
    net_up
    # rc_pingpong serves in the guest; rdmx connects from the host
    guest --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --timeout 300 -- \
      ibv_rc_pingpong -d rxe0 -g 1 -s "$size" -n "$n" > "$OUT/pingpong-$size.guest-server" 2>&1 &
    local g=$!
    local i=0
    until ns "$RDMX" pingpong 198.18.0.2 --size "$size" --iters "$n" \
            > "$OUT/pingpong-$size.host-client" 2>&1; do
      # the guest may still be booting
      i=$((i + 1)); ((i < 60)) || break; sleep 0.5
    done
    wait "$g" || fail_step "rc_pingpong server, $size B: exit $? $(tail_of "$OUT/pingpong-$size.guest-server")"
    grep -q "every echo checked: $n messages" "$OUT/pingpong-$size.host-client" ||
      fail_step "rdmx client, $size B: $(tail_of "$OUT/pingpong-$size.host-client")"
    printf 'rc_pingpong server, rdmx client, %5s B: %s | %s\n' "$size" \
      "$(grep -m1 'usec/iter' "$OUT/pingpong-$size.guest-server")" \
      "$(tail -1 "$OUT/pingpong-$size.host-client")"
    cleanup
    # rdmx serves on the host; rc_pingpong connects from the guest
    net_up
    bg "$RDMX" pingpong --listen 198.18.0.1 --size "$size" --iters "$n" > "$OUT/pingpong-$size.host-server" 2>&1
    local srv=${BG[-1]}
    sleep 0.5   # (a probe connection would be taken for the client)
    guest --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --timeout 300 -- \
      ibv_rc_pingpong -d rxe0 -g 1 -s "$size" -n "$n" 198.18.0.1 > "$OUT/pingpong-$size.guest-client" 2>&1 ||
      fail_step "rc_pingpong client, $size B: exit $? $(tail_of "$OUT/pingpong-$size.guest-client")"
    wait "$srv" || fail_step "rdmx server, $size B: exit $?"
    grep -q "every echo checked: $n messages" "$OUT/pingpong-$size.host-server" ||
      fail_step "rdmx server, $size B: $(tail_of "$OUT/pingpong-$size.host-server")"
    printf 'rdmx server, rc_pingpong client, %5s B: %s | %s\n' "$size" \
      "$(grep -m1 'usec/iter' "$OUT/pingpong-$size.guest-client")" \
      "$(tail -1 "$OUT/pingpong-$size.host-server")"
    cleanup
  done
  ((fails == 0))
}

# perftest_case TAG "PERFTEST ARGS" "RDMX PERF ARGS" SIZE ITERS: perftest
# serves in a guest and `rdmx perf --perftest` connects from the host, then
# rdmx serves (--perftest-server) and perftest connects from the guest. Both
# ends must exit 0 and print the run's result line (SIZE and ITERS); rdmx's
# data check must pass (it prints "checked:" where it has one).
perftest_case() {
  local tag=$1 pt=$2 args=$3 size=$4 iters=$5 fails=0 i
  local row="^ *$size +$iters +"
  net_up
  guest --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --timeout 300 -c \
    "$pt -d rxe0 -x 1; echo perftest exit \$?" > "$OUT/perftest-$tag.guest-server" 2>&1 &
  local g=$!
  for i in $(seq 120); do
    ns "$RDMX" perf --perftest 198.18.0.2 $args > "$OUT/perftest-$tag.host-client" 2>&1 && break
    # the guest may still be booting: retry only what never connected
    never_connected "$OUT/perftest-$tag.host-client" || { fails=1; break; }
    sleep 0.5
  done
  wait "$g"
  grep -q "perftest exit 0" "$OUT/perftest-$tag.guest-server" || fails=1
  grep -Eq "$row" "$OUT/perftest-$tag.guest-server" || fails=1
  grep -Eq "$row" "$OUT/perftest-$tag.host-client" || fails=1
  grep -q "checked:" "$OUT/perftest-$tag.host-client" || fails=1
  printf '%-22s perftest serves:  %s | rdmx: %s\n' "$tag" \
    "$(grep -E "$row" "$OUT/perftest-$tag.guest-server" | tail -1 | tr -s ' \t' ' ')" \
    "$(grep "checked:" "$OUT/perftest-$tag.host-client")"
  cleanup
  net_up
  bg "$RDMX" perf --perftest-server $args > "$OUT/perftest-$tag.host-server" 2>&1
  local srv=${BG[-1]}
  guest --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --timeout 300 -c \
    "$pt -d rxe0 -x 1 198.18.0.1; echo perftest exit \$?" > "$OUT/perftest-$tag.guest-client" 2>&1
  wait "$srv" || fails=1
  grep -q "perftest exit 0" "$OUT/perftest-$tag.guest-client" || fails=1
  grep -Eq "$row" "$OUT/perftest-$tag.guest-client" || fails=1
  grep -Eq "$row" "$OUT/perftest-$tag.host-server" || fails=1
  printf '%-22s rdmx serves:      %s | rdmx: %s\n' "$tag" \
    "$(grep -E "$row" "$OUT/perftest-$tag.guest-client" | tail -1 | tr -s ' \t' ' ')" \
    "$(grep "checked:" "$OUT/perftest-$tag.host-server" || echo "completed")"
  cleanup
  return $fails
}

# perftest_try TAG ...: perftest_case, run once more when perftest could
# not time itself (its clock calibration needs r^2 >= 0.9, which a TCG guest
# on a busy host misses now and then: "Can't produce a report")
perftest_try() {
  perftest_case "$@" && return 0
  grep -qs "Can't produce a report" "$OUT/perftest-$1".guest-* || return 1
  echo "$1: perftest could not calibrate its clock in the guest; once more"
  perftest_case "$@"
}

t_perftest() {
  local fails=0
  perftest_try write_bw-64k "ib_write_bw -s 65536 -n 200" "--op write --mode bw --sizes 64k --iters 200" 65536 200 || fails=$((fails + 1))
  perftest_try write_bw-1m "ib_write_bw -s 1048576 -n 20" "--op write --mode bw --sizes 1m --iters 20" 1048576 20 || fails=$((fails + 1))
  perftest_try read_bw-64k "ib_read_bw -s 65536 -n 200" "--op read --mode bw --sizes 64k --iters 200" 65536 200 || fails=$((fails + 1))
  perftest_try read_bw-1m "ib_read_bw -s 1048576 -n 20" "--op read --mode bw --sizes 1m --iters 20" 1048576 20 || fails=$((fails + 1))
  perftest_try send_bw-64k "ib_send_bw -s 65536 -n 200" "--op send --mode bw --sizes 64k --iters 200" 65536 200 || fails=$((fails + 1))
  perftest_try send_bw-2 "ib_send_bw -s 2 -n 1000" "--op send --mode bw --sizes 2 --iters 1000" 2 1000 || fails=$((fails + 1))
  perftest_try atomic_bw-faa "ib_atomic_bw -n 500" "--op faa --mode bw --sizes 8 --iters 500" 8 500 || fails=$((fails + 1))
  perftest_try atomic_bw-cas "ib_atomic_bw -A CMP_AND_SWAP -n 500" "--op cas --mode bw --sizes 8 --iters 500" 8 500 || fails=$((fails + 1))
  perftest_try write_lat-2 "ib_write_lat -s 2 -n 300" "--op write --mode lat --sizes 2 --iters 300" 2 300 || fails=$((fails + 1))
  perftest_try write_lat-4k "ib_write_lat -s 4096 -n 300" "--op write --mode lat --sizes 4k --iters 300" 4096 300 || fails=$((fails + 1))
  ((fails == 0))
}

# nvme_case TAG "SERVE ARGS" BYTES "CONNECT OPTS" GUEST-OPTS...: `rdmx block
# serve` on the host, testbed/nvme-checks.sh in a guest against it.
nvme_case() {
  local tag=$1 serve=$2 bytes=$3 opts=$4 nqn=nqn.2026-11.io.rdmx:testbed; shift 4
  net_up
  # shellcheck disable=SC2086
  bg "$RDMX" block serve $serve --nqn "$nqn" --nvme-tcp 198.18.0.1:4420 \
    --discovery 198.18.0.1:8009 --metrics 198.18.0.1:9500 > "$OUT/nvme-$tag.target" 2>&1
  wait_tcp 198.18.0.1 4420 10 || { echo "target did not start"; cat "$OUT/nvme-$tag.target"; cleanup; return 1; }
  guest --netns "$NS" --nic tap0=198.18.0.2/24 --modprobe nvme-tcp --timeout 600 "$@" -c \
    "NVME_CONNECT_OPTS='$opts' $HERE/nvme-checks.sh 198.18.0.1 4420 8009 $nqn $bytes" \
    > "$OUT/nvme-$tag.guest" 2>&1
  local rc=$?
  # The target counted the work: reads and writes on namespace 1.
  ns python3 -c 'import urllib.request,sys; sys.stdout.write(urllib.request.urlopen("http://198.18.0.1:9500/metrics").read().decode())' \
    > "$OUT/nvme-$tag.metrics"
  cleanup
  grep '^###' "$OUT/nvme-$tag.guest" | sed "s/^/$tag: /"
  grep -E 'rdmx_block_bytes_total\{nsid="1",op="(read|write)"\}' "$OUT/nvme-$tag.metrics" | sed "s/^/$tag: /"
  ((rc == 0)) && grep -q '^### all checks passed' "$OUT/nvme-$tag.guest" &&
    grep -Eq 'rdmx_block_bytes_total\{nsid="1",op="write"\} [1-9]' "$OUT/nvme-$tag.metrics"
}

# The target killed (-9) mid-I/O and restarted on the same file: the host
# sees it go, reconnects, and the data it flushed before is intact.
nvme_kill_case() {
  local nqn=nqn.2026-11.io.rdmx:testbed img=$OUT/nvme-kill.img flags=$OUT/flag.nvme-kill
  local serve=(block serve --file "$img" --size 256m --nqn "$nqn" --nvme-tcp 198.18.0.1:4420)
  rm -rf "$img" "$flags"; mkdir -p "$flags"
  net_up
  bg "$RDMX" "${serve[@]}" > "$OUT/nvme-kill.target" 2>&1
  local first=${BG[-1]}
  wait_tcp 198.18.0.1 4420 10 || { cleanup; return 1; }
  guest --netns "$NS" --nic tap0=198.18.0.2/24 --modprobe nvme-tcp --timeout 600 --rw "$flags" -- \
    "$HERE/nvme-kill-guest.sh" 198.18.0.1 4420 "$nqn" "$flags" > "$OUT/nvme-kill.guest" 2>&1 &
  local g=$! i
  for i in $(seq 1200); do [[ -e $flags/flushed ]] && break; sleep 0.1; done
  sleep 2                      # writes in flight now
  kill -9 "$first"; wait "$first" 2>/dev/null
  sleep 3                      # the host notices
  bg "$RDMX" "${serve[@]}" >> "$OUT/nvme-kill.target" 2>&1
  wait_tcp 198.18.0.1 4420 10
  touch "$flags/restarted"
  wait "$g"
  local rc=$?
  cleanup
  rm -f "$img"
  grep '^###' "$OUT/nvme-kill.guest" | sed "s/^/kill-9: /"
  ((rc == 0)) && grep -q '^### all checks passed' "$OUT/nvme-kill.guest"
}

t_nvme-tcp() {
  local fails=0 bytes=$((256 << 20))
  nvme_case ram "--ram 256m" "$bytes" "" || fails=$((fails + 1))
  rm -f "$OUT/nvme-ns.img"
  # The file namespace bypasses the page cache (O_DIRECT), which the
  # target's log names.
  if nvme_case file-digests-2q "--file $OUT/nvme-ns.img --size 256m --direct" "$bytes" "-g -G -i 2" \
    --smp 2; then
    # both digests were negotiated, the host made two I/O queues, and the
    # file was opened for direct I/O
    grep -q 'mapped 2/0/0' "$OUT/nvme-file-digests-2q.guest" &&
      grep -q ', O_DIRECT (' "$OUT/nvme-file-digests-2q.target" &&
      grep -Eq 'rdmx_block_digest_connections_total\{kind="header"\} [1-9]' "$OUT/nvme-file-digests-2q.metrics" &&
      grep -Eq 'rdmx_block_digest_connections_total\{kind="data"\} [1-9]' "$OUT/nvme-file-digests-2q.metrics" ||
      { echo "file-digests-2q: no digests, not two queues or not O_DIRECT"; fails=$((fails + 1)); }
  else
    fails=$((fails + 1))
  fi
  rm -f "$OUT/nvme-ns.img"
  nvme_kill_case || fails=$((fails + 1))
  # the kernel's own target, same checks (loopback inside one guest)
  guest --modprobe nvme-tcp --modprobe nvmet-tcp --timeout 600 -- \
    "$HERE/nvmet-ref.sh" "$bytes" > "$OUT/nvme-nvmet-ref.guest" 2>&1
  local rc=$?
  grep '^###' "$OUT/nvme-nvmet-ref.guest" | sed "s/^/nvmet-ref: /"
  { ((rc == 0)) && grep -q '^### all checks passed' "$OUT/nvme-nvmet-ref.guest"; } || fails=$((fails + 1))
  ((fails == 0))
}

t_nbd() {
  local bytes=$((256 << 20))
  net_up
  bg "$RDMX" block serve --ram 256m --nvme-tcp 198.18.0.1:4420 --rdmx rdma://198.18.0.1:4430 \
    > "$OUT/nbd.target" 2>&1
  wait_tcp 198.18.0.1 4420 10 || { cleanup; return 1; }
  bg "$RDMX" block nbd --listen 198.18.0.1:10809 --target rdma://198.18.0.1:4430 > "$OUT/nbd.export" 2>&1
  wait_tcp 198.18.0.1 10809 20 || { cat "$OUT/nbd.export"; cleanup; return 1; }
  guest --netns "$NS" --nic tap0=198.18.0.2/24 --modprobe nbd --timeout 600 -- \
    "$HERE/nbd-checks.sh" 198.18.0.1 10809 rdmx "$bytes" > "$OUT/nbd.guest" 2>&1
  local rc=$?
  cleanup
  grep "^rdmx block nbd" "$OUT/nbd.export"
  grep '^###' "$OUT/nbd.guest"
  # the export reached its namespace over soft RoCE, not a fallback
  ((rc == 0)) && grep -q '^### all checks passed' "$OUT/nbd.guest" && grep -q '(rdma, ' "$OUT/nbd.export" ||
    return 1
  # The Initiator on rxe: the export runs in the guest, its NVMe over rdmx
  # connection goes through the NIC provider (rxe0, real libibverbs) to the
  # target's soft engine on the host, which pulls write data with READs and
  # pushes read data with WRITEs into the guest's registered buffers.
  bytes=$((64 << 20))
  net_up
  bg "$RDMX" block serve --ram 64m --rdmx rdma://198.18.0.1:4430 > "$OUT/nbd-rxe.target" 2>&1
  wait_tcp 198.18.0.1 4430 10 || { cleanup; return 1; }
  guest --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --modprobe nbd --timeout 900 -- \
    "$HERE/nbd-initiator-guest.sh" "$RDMX" rdma://198.18.0.1:4430 "$bytes" > "$OUT/nbd-rxe.guest" 2>&1
  rc=$?
  cleanup
  grep -E '^###|^export: rdmx block nbd: [0-9]' "$OUT/nbd-rxe.guest"
  ((rc == 0)) && grep -q '^### all checks passed' "$OUT/nbd-rxe.guest" &&
    grep -q '^export: rdmx block nbd: .*(rdma, rxe0' "$OUT/nbd-rxe.guest" || return 1
  # The target on rxe: it serves in the guest through the NIC provider, so
  # its READs and WRITEs into the Initiator's buffers are rxe's; the export
  # and userspace NBD clients (nbdcopy, fio's nbd engine) run on the host.
  net_up
  mkdir -p "$OUT/flag.nbd-target"
  rm -f "$OUT/flag.nbd-target/done"
  guest --netns "$NS" --nic tap0=198.18.0.2/24 --rxe --timeout 900 --rw "$OUT/flag.nbd-target" -c \
    "($RDMX block serve --ram 64m --rdmx rdma://198.18.0.2:4430 &) ;
     while [ ! -e $OUT/flag.nbd-target/done ]; do sleep 0.2; done" > "$OUT/nbd-target-rxe.guest" 2>&1 &
  local g=$! fails=0
  if wait_tcp 198.18.0.2 4430 120; then
    bg env RDMX_RDMA_PROVIDER=soft "$RDMX" block nbd --listen 198.18.0.1:10810 \
      --target rdma://198.18.0.2:4430 > "$OUT/nbd-target-rxe.export" 2>&1
    wait_tcp 198.18.0.1 10810 60 || fails=1
    head -c 16M /dev/urandom > "$OUT/nbd-target-rxe.bin"
    local uri=nbd://198.18.0.1:10810/rdmx
    ns nbdcopy "$OUT/nbd-target-rxe.bin" "$uri" || fails=1
    [[ $(ns nbdcopy "$uri" - | head -c 16M | sha256sum) == "$(sha256sum < "$OUT/nbd-target-rxe.bin")" ]] ||
      { echo "nbdcopy: 16 MiB read back differ"; fails=1; }
    ns fio --name=verify --ioengine=nbd --uri="$uri" --rw=randwrite --bs=4k --size=8m --offset=32m --verify_state_save=0 \
      --iodepth=16 --verify=crc32c --verify_fatal=1 --output-format=terse > "$OUT/nbd-target-rxe.fio" 2>&1 ||
      { tail -5 "$OUT/nbd-target-rxe.fio"; fails=1; }
    # terse field 6: KiB read, by the verify pass
    [[ $(grep -v '^fio:' "$OUT/nbd-target-rxe.fio" | cut -d';' -f6) == 8192 ]] ||
      { echo "fio read back $(grep -v '^fio:' "$OUT/nbd-target-rxe.fio" | cut -d';' -f6) KiB, not 8192"; fails=1; }
    echo "target on rxe: nbdcopy 16 MiB written and read back, fio randwrite 8 MiB verified (crc32c): $( ((fails == 0)) && echo ok || echo FAILED)"
  else
    fails=1
  fi
  touch "$OUT/flag.nbd-target/done"
  wait "$g"
  cleanup
  grep "^rdmx block nbd: [0-9]" "$OUT/nbd-target-rxe.export"
  # go-back-N: the peer is the NIC provider (a soft engine would have agreed
  # to selective repeat)
  ((fails == 0)) && grep -q '(rdma, soft-roce.*go-back-N' "$OUT/nbd-target-rxe.export"
}

ALL="conformance-hw doctor nic-example soft-hw soft-hw-loss pingpong perftest nvme-tcp nbd captures"
TESTS=${*:-$ALL}
failed=()
for t in $TESTS; do
  declare -F "t_$t" >/dev/null || { echo "tests.sh: no test $t (have: $ALL)" >&2; exit 2; }
  echo "=== $t"
  CURRENT=$t
  start=$SECONDS
  if "t_$t"; then r=PASS; else r=FAIL; failed+=("$t"); fi
  echo "=== $t: $r ($((SECONDS - start)) s)"
done
echo "logs: $OUT"
if ((${#failed[@]})); then
  ((${#WHY[@]} == 0)) || printf 'why: %s\n' "${WHY[@]}"
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all passed: $TESTS"
