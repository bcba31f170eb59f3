#!/bin/bash
# testbed/nvme-checks.sh ADDR PORT DISC_PORT NQN BYTES — runs in a guest (tests.sh
# nvme-tcp): the Linux kernel's NVMe/TCP host against a target at ADDR.
# Discover, connect, check the size, run fio with crc32c verification, make
# an ext4 filesystem, write a tree of
# files with known checksums, fsck it clean, verify every checksum, then
# disconnect, reconnect and verify again.
# NVME_CONNECT_OPTS adds connect options (digests: -g -G; queues: -i N).
# Prints "### <step>: ok" per step; exits non-zero at the first failure.
set -uo pipefail
addr=$1 port=$2 dport=$3 nqn=$4 bytes=$5
mnt=/mnt/nvme-checks
man=/run/nvme-checks.sha256
step() { echo "### $1: ok"; }
fail() { echo "### FAIL: $*"; dmesg | grep -i nvme | tail -20; exit 1; }

dev() {
  local c
  for c in /sys/class/nvme/nvme*; do
    [[ $(cat "$c/subsysnqn" 2>/dev/null) == "$nqn" ]] || continue
    for n in "$c"/nvme*n1 /sys/block/"$(basename "$c")"n1; do
      [[ -e $n ]] && { echo "/dev/$(basename "$c")n1"; return 0; }
    done
  done
  return 1
}
connect() {
  # shellcheck disable=SC2086 # NVME_CONNECT_OPTS: more options (-g -G -i 2)
  nvme connect -t tcp -a "$addr" -s "$port" -n "$nqn" ${NVME_CONNECT_OPTS:-} "$@" || fail "nvme connect"
  local i d
  for i in $(seq 100); do
    d=$(dev) && [[ -b $d ]] && { DEV=$d; return 0; }
    sleep 0.1
  done
  fail "no block device for $nqn"
}

nvme discover -t tcp -a "$addr" -s "$dport" > /run/discover.txt || fail "nvme discover"
cat /run/discover.txt
grep -q "subnqn: *$nqn" /run/discover.txt || fail "discovery log has no $nqn"
grep -q "trsvcid: *$port" /run/discover.txt || fail "discovery log has no port $port"
step discover

connect
nvme list
dmesg | grep -E 'nvme nvme[0-9]+: (mapped|creating)' | tail -2
size=$(blockdev --getsize64 "$DEV")
[[ $size == "$bytes" ]] || fail "size $size, expected $bytes"
step "connect ($DEV, $size bytes)"

# fio: random 4 KiB writes (in-capsule) and 128 KiB writes (R2T), each
# verified with crc32c (before the filesystem, which then overwrites them).
fio --name=rand4k --filename="$DEV" --direct=1 --ioengine=libaio --rw=randwrite --bs=4k \
    --iodepth=16 --size=16M --offset=64M --verify=crc32c --do_verify=1 --verify_fatal=1 \
    --output-format=terse > /run/fio1.txt || { cat /run/fio1.txt; fail "fio 4k randwrite verify"; }
fio --name=seq128k --filename="$DEV" --direct=1 --ioengine=libaio --rw=write --bs=128k \
    --iodepth=8 --size=32M --offset=96M --verify=crc32c --do_verify=1 --verify_fatal=1 \
    --output-format=terse > /run/fio2.txt || { cat /run/fio2.txt; fail "fio 128k write verify"; }
step "fio crc32c verify (4k random, 128k sequential)"

mkfs.ext4 -q -F "$DEV" || fail mkfs
mkdir -p "$mnt"
mount "$DEV" "$mnt" || fail mount
for d in a b c/d; do mkdir -p "$mnt/$d"; done
i=0
for d in . a b c/d; do
  for s in 0 1 511 4096 4097 65536 200000 1048576 3000000; do
    head -c "$s" /dev/urandom > "$mnt/$d/f$i.$s"; i=$((i + 1))
  done
done
(cd "$mnt" && find . -type f -print0 | sort -z | xargs -0 sha256sum) > "$man"
sync
umount "$mnt" || fail umount
step "mkfs, $i files written"
fsck.ext4 -fn "$DEV" || fail "fsck.ext4 -fn"
step "fsck clean"
mount "$DEV" "$mnt" || fail "mount again"
(cd "$mnt" && sha256sum --quiet -c "$man") || fail "checksums after remount"
umount "$mnt"
step "every checksum verified"


nvme disconnect -n "$nqn" || fail disconnect
sleep 0.5
dev >/dev/null && fail "still connected after disconnect"
connect
mount "$DEV" "$mnt" || fail "mount after reconnect"
(cd "$mnt" && sha256sum --quiet -c "$man") || fail "checksums after reconnect"
umount "$mnt"
nvme disconnect -n "$nqn" || fail "final disconnect"
step "disconnect, reconnect, checksums intact"
echo "### all checks passed"
