#!/bin/bash
# testbed/nbd-checks.sh ADDR PORT EXPORT BYTES — runs in a guest (tests.sh nbd):
# the kernel's NBD client (nbd-client 3.24, netlink) against an NBD server.
# Connect, check the size, write 16 MiB with O_DIRECT and fsync and read it
# back, make an ext4 filesystem with a tree of checksummed files, fsck it
# clean, remount and verify, disconnect.
set -uo pipefail
addr=$1 port=$2 export=$3 bytes=$4
dev=/dev/nbd0 mnt=/mnt/nbd-checks man=/run/nbd-checks.sha256
step() { echo "### $1: ok"; }
fail() { echo "### FAIL: $*"; dmesg | grep -i nbd | tail -20; exit 1; }

nbd-client "$addr" "$port" "$dev" -N "$export" || fail "nbd-client"
for i in $(seq 50); do [[ $(blockdev --getsize64 "$dev" 2>/dev/null) == "$bytes" ]] && break; sleep 0.1; done
size=$(blockdev --getsize64 "$dev")
[[ $size == "$bytes" ]] || fail "size $size, expected $bytes"
step "connect ($size bytes)"

head -c 16M /dev/urandom > /run/r.bin
dd if=/run/r.bin of="$dev" bs=1M seek=8 oflag=direct conv=fsync status=none || fail "dd write"
got=$(dd if="$dev" bs=1M skip=8 count=16 iflag=direct status=none | sha256sum)
[[ $got == "$(sha256sum < /run/r.bin)" ]] || fail "16 MiB read back differ"
step "16 MiB written (O_DIRECT, fsync) and read back"

mkfs.ext4 -q -F "$dev" || fail mkfs
mkdir -p "$mnt"
mount "$dev" "$mnt" || fail mount
i=0
for d in . a b/c; do
  mkdir -p "$mnt/$d"
  for s in 0 1 4097 65536 1048576 3000000; do
    head -c "$s" /dev/urandom > "$mnt/$d/f$i.$s"; i=$((i + 1))
  done
done
(cd "$mnt" && find . -type f -print0 | sort -z | xargs -0 sha256sum) > "$man"
sync
umount "$mnt" || fail umount
fsck.ext4 -fn "$dev" || fail "fsck.ext4 -fn"
mount "$dev" "$mnt" || fail "mount again"
(cd "$mnt" && sha256sum --quiet -c "$man") || fail "checksums"
umount "$mnt"
step "ext4: $i files, fsck clean, every checksum verified"
nbd-client -d "$dev" || fail "disconnect"
step disconnect
echo "### all checks passed"
