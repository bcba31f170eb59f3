#!/bin/bash
# testbed/nvme-kill-guest.sh ADDR PORT NQN FLAGDIR — runs in a guest (tests.sh
# nvme-tcp): the host side of "target killed mid-I/O". Connect with a short
# reconnect delay, write 32 MiB and flush it (fsync on the device sends
# Flush), tell the host (FLAGDIR/flushed), keep writing elsewhere while the
# host kills and restarts the target (FLAGDIR/restarted), wait until the
# controller is live again, then read the flushed data back and compare.
set -uo pipefail
addr=$1 port=$2 nqn=$3 flags=$4
fail() { echo "### FAIL: $*"; dmesg | grep -i nvme | tail -20; exit 1; }
nvme connect -t tcp -a "$addr" -s "$port" -n "$nqn" --reconnect-delay=1 --ctrl-loss-tmo=120 ||
  fail "nvme connect"
ctrl=""
for i in $(seq 100); do
  for c in /sys/class/nvme/nvme*; do
    [[ $(cat "$c/subsysnqn" 2>/dev/null) == "$nqn" ]] && ctrl=$(basename "$c")
  done
  [[ -n $ctrl && -b /dev/${ctrl}n1 ]] && break
  sleep 0.1
done
dev=/dev/${ctrl}n1
[[ -b $dev ]] || fail "no device"
head -c 32M /dev/urandom > /run/a.bin
want=$(sha256sum < /run/a.bin)
dd if=/run/a.bin of="$dev" bs=1M oflag=direct conv=fsync status=none || fail "write and flush"
echo "### written and flushed: ok"
touch "$flags/flushed"
# Writes in flight when the target dies (their result does not matter).
( while :; do dd if=/dev/urandom of="$dev" bs=1M seek=64 count=16 oflag=direct status=none 2>/dev/null; done ) &
writer=$!
for i in $(seq 1200); do [[ -e $flags/restarted ]] && break; sleep 0.1; done
[[ -e $flags/restarted ]] || fail "the host never restarted the target"
# The host reconnects by itself (reconnect delay 1 s).
for i in $(seq 600); do
  [[ $(cat "/sys/class/nvme/$ctrl/state") == live ]] && break
  sleep 0.1
done
state=$(cat "/sys/class/nvme/$ctrl/state")
kill "$writer" 2>/dev/null; wait "$writer" 2>/dev/null
[[ $state == live ]] || fail "controller state $state after the restart"
dmesg | grep -iE "nvme.*(reconnect|error|failed)" | tail -5
dmesg | grep -qiE "nvme.*reconnect" || fail "the host saw no reconnect"
echo "### the host saw the target go and reconnected: ok"
got=$(dd if="$dev" bs=1M count=32 iflag=direct status=none | sha256sum)
[[ $got == "$want" ]] || fail "flushed data changed: $got != $want"
echo "### flushed data intact after kill -9 and restart: ok"
nvme disconnect -n "$nqn" >/dev/null
echo "### all checks passed"
