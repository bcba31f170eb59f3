#!/bin/bash
# testbed/nvmet-ref.sh BYTES — runs in a guest (tests.sh nvme-tcp): the kernel's
# own NVMe/TCP target (nvmet-tcp, configfs) on a RAM disk of BYTES, then
# nvme-checks.sh against it over loopback. It shows the checks themselves are
# right: a target nobody here wrote passes them too.
set -euo pipefail
bytes=$1
here=$(cd "$(dirname "$0")" && pwd)
nqn=nqn.2026-11.io.rdmx:nvmet-ref
modprobe brd rd_nr=1 rd_size=$((bytes / 1024))
mount -t configfs none /sys/kernel/config 2>/dev/null || true
S=/sys/kernel/config/nvmet/subsystems/$nqn
mkdir "$S"
echo 1 > "$S/attr_allow_any_host"
mkdir "$S/namespaces/1"
echo /dev/ram0 > "$S/namespaces/1/device_path"
echo 1 > "$S/namespaces/1/enable"
P=/sys/kernel/config/nvmet/ports/1
mkdir "$P"
echo tcp > "$P/addr_trtype"
echo ipv4 > "$P/addr_adrfam"
echo 127.0.0.1 > "$P/addr_traddr"
echo 4421 > "$P/addr_trsvcid"
ln -s "$S" "$P/subsystems/"
# every nvmet port also serves the discovery controller
"$here/nvme-checks.sh" 127.0.0.1 4421 4421 "$nqn" "$bytes"
