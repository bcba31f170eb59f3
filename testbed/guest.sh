#!/usr/bin/env bash
# testbed/guest.sh [options] -- COMMAND [ARG...]     (or: -c 'shell string')
# Boot a throw-away QEMU guest on Debian's kernel whose root is this host's /
# (read-only over virtio-9p, writes go to a tmpfs overlay), run COMMAND in the
# caller's directory, print its output, exit with its status (124: timeout,
# 125: the guest failed before or around the command). Needs root.
#
#   --nic TAP=ADDR   a virtio NIC on host tap TAP (it must exist; see --netns),
#                    ethN in the guest gets ADDR (198.18.x.y/24). TAP "-": a
#                    NIC on no network. Repeatable (eth0, eth1, ...).
#   --netns NS       run qemu in network namespace NS (where the taps are)
#   --rxe            load rdma_rxe and add rxeN on every ethN
#   --modprobe MOD   load MOD before the command (repeatable)
#   --rw DIR         DIR is shared read-write, at the same path
#   --mem MB (2048)  --smp N (1)  --timeout SECONDS (600)  --name NAME
#   --monitor SOCK   QEMU's human monitor on unix socket SOCK, to look at a
#                    guest that stopped answering (`info registers`, or
#                    `sendkey alt-sysrq-l` for the kernel's backtrace)
#   --dir DIR        the prepared directory (default $RDMX_TESTBED_DIR,
#                    else /var/tmp/rdmx-testbed; prepared if it is not)
# Under TCG (no usable KVM, e.g. a PVM host) a boot takes about 3 s.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${RDMX_TESTBED_DIR:-/var/tmp/rdmx-testbed}
NICS=() NETNS="" RXE="" MODULES="" RW=() MEM=2048 SMP=1 TIMEOUT=600 NAME=guest CMD=() MONITOR=()
while (($#)); do
  case $1 in
    --nic) NICS+=("$2"); shift 2 ;;
    --netns) NETNS=$2; shift 2 ;;
    --rxe) RXE=1; shift ;;
    --modprobe) MODULES+=" $2"; shift 2 ;;
    --rw) RW+=("$(cd "$2" && pwd)"); shift 2 ;;
    --mem) MEM=$2; shift 2 ;;
    --smp) SMP=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --name) NAME=$2; shift 2 ;;
    --monitor) MONITOR=(-monitor "unix:$2,server=on,wait=off"); shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    -c) CMD=(/bin/sh -c "$2"); shift 2; break ;;
    --) shift; CMD=("$@"); break ;;
    -h | --help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "guest.sh: unknown option $1 (put -- before the command)" >&2; exit 2 ;;
  esac
done
((${#CMD[@]})) || { echo "guest.sh: no command" >&2; exit 2; }
# (Re)prepare when never done, or when init.sh changed since the initramfs was made.
[[ -s $DIR/kver && $DIR/initrd.gz -nt $HERE/init.sh ]] || "$HERE/prepare.sh" "$DIR" >/dev/null

if [[ -w /dev/kvm && ! -d /sys/module/kvm_pvm ]]; then
  ACCEL=(-accel kvm -cpu host)
else
  # PVM's /dev/kvm only runs PVM guest kernels; Debian's is not one.
  ACCEL=(-accel tcg,thread=multi -cpu max)
fi

RUN=$(mktemp -d "/tmp/rdmx-guest-$NAME.XXXXXX")
trap 'rm -rf "$RUN"' EXIT
{ printf 'exec'; printf ' %q' "${CMD[@]}"; echo; } > "$RUN/cmd"
net=() nics="" i=0
for spec in ${NICS[@]+"${NICS[@]}"}; do
  tap=${spec%%=*} addr=${spec#*=}
  [[ $addr != "$spec" ]] || addr=""
  # a stable, locally administered MAC per address
  mac=$(printf '%s' "${addr:-$RUN}/$i" | md5sum | sed 's/^\(..\)\(..\)\(..\)\(..\).*/52:54:\1:\2:\3:\4/')
  if [[ $tap == - ]]; then
    net+=(-netdev "hubport,id=n$i,hubid=$i")
  else
    net+=(-netdev "tap,id=n$i,ifname=$tap,script=no,downscript=no")
  fi
  # event_idx=off: with event-index notification, this QEMU (7.2) under TCG
  # sometimes stops raising the guest's receive interrupts for good (caught
  # with --monitor: guest idle, buffers posted, NET_RX frozen)
  net+=(-device "virtio-net-pci,netdev=n$i,mac=$mac,romfile=,event_idx=off")
  nics+=" eth$i${addr:+=$addr}"
  i=$((i + 1))
done
shares=() i=0
for d in ${RW[@]+"${RW[@]}"}; do
  shares+=(-virtfs "local,path=$d,mount_tag=rw$i,security_model=none,multidevs=remap")
  i=$((i + 1))
done
cat > "$RUN/guest.env" <<ENV
TESTBED_RUN=$(printf %q "$RUN")
TESTBED_CWD=$(printf %q "$PWD")
TESTBED_NICS=$(printf %q "${nics# }")
TESTBED_RXE=$RXE
TESTBED_MODULES=$(printf %q "${MODULES# }")
TESTBED_RW=$(printf %q "${RW[*]+${RW[*]}}")
export TESTBED_RUN TESTBED_CWD
ENV

qemu=("$DIR/qemu" "${ACCEL[@]}" -m "$MEM" -smp "$SMP" -machine pc -nodefaults
  -no-user-config -no-reboot -display none
  -kernel "$DIR/vmlinux" -initrd "$DIR/initrd.gz"
  -append "console=ttyS0 quiet panic=-1 rdinit=/init i8042.noaux sysrq_always_enabled"
  -serial stdio
  -virtfs "local,path=$RUN,mount_tag=run,security_model=none"
  -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
  -virtfs "local,path=$DIR/root/lib/modules,mount_tag=modules,security_model=none,readonly=on"
  ${shares[@]+"${shares[@]}"} ${net[@]+"${net[@]}"} ${MONITOR[@]+"${MONITOR[@]}"})
[[ -z $NETNS ]] || qemu=(ip netns exec "$NETNS" "${qemu[@]}")
set +e
# The console carries the command's output; drop the kernel's power-off line.
timeout -k 5 "$TIMEOUT" "${qemu[@]}" < /dev/null 2> "$RUN/qemu.err" |
  tr -d '\r' | grep --line-buffered -v 'reboot: Power down'
q=${PIPESTATUS[0]}
set -e
if [[ -s $RUN/rc ]]; then
  exit "$(cat "$RUN/rc")"
elif [[ $q == 124 ]]; then
  echo "guest.sh: $NAME timed out after ${TIMEOUT}s" >&2; exit 124
fi
echo "guest.sh: $NAME ended without a status (qemu exit $q)" >&2
cat "$RUN/qemu.err" >&2
exit 125
