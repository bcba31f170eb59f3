#!/bin/bash
# testbed/nbd-initiator-guest.sh RDMX TARGET_URL BYTES — runs in a guest with
# rxe0 (tests.sh nbd): `rdmx block nbd` here, whose Initiator reaches the
# target through the NIC provider on rxe (the real libibverbs and the
# kernel's RoCEv2), then the kernel's NBD client against it on loopback
# (nbd-checks.sh: O_DIRECT data, ext4 with checksummed files, fsck clean).
set -uo pipefail
rdmx=$1 target=$2 bytes=$3
here=$(cd "$(dirname "$0")" && pwd)
"$rdmx" block nbd --listen 127.0.0.1:10809 --target "$target" > /run/nbd-export.log 2>&1 &
export_pid=$!
for _ in $(seq 300); do
  grep -q "^rdmx block nbd: export" /run/nbd-export.log && break
  kill -0 "$export_pid" 2>/dev/null || break
  sleep 0.2
done
"$here/nbd-checks.sh" 127.0.0.1 10809 rdmx "$bytes"
rc=$?
kill "$export_pid" 2>/dev/null
sed 's/^/export: /' /run/nbd-export.log
exit $rc
