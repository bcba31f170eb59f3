#!/usr/bin/env bash
# testbed/prepare.sh [DIR] — everything a throw-away rxe guest needs, in DIR
# (default: $RDMX_TESTBED_DIR, else /var/tmp/rdmx-testbed). Idempotent: a
# prepared DIR is reused. Prints the DIR on stdout.
#
# Debian's packaged kernel (which has rdma_rxe, nvme-tcp, nvmet...) and, when
# the host has no qemu-system-x86_64, Debian's qemu are *downloaded and
# unpacked* into DIR, never installed: installing bookworm's qemu would remove
# the host's newer qemu-utils, and a kernel package runs boot hooks.
#
# DIR/ after a run:
#   root/                unpacked packages (kernel + its module tree, qemu)
#   vmlinux              the kernel as an ELF (qemu boots it through PVH,
#                        skipping the guest-side XZ decompression: about
#                        2.5 s less per boot under TCG)
#   initrd.gz            busybox, the modules that reach the host's / over
#                        virtio-9p, and testbed/init.sh as /init
#   qemu                 a wrapper running the host's or the unpacked qemu
#   kver                 the kernel version
# Needs: apt-get, dpkg-deb, python3, busybox (busybox-static), gzip, cpio-less:
# the initramfs is written by busybox cpio.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${1:-${RDMX_TESTBED_DIR:-/var/tmp/rdmx-testbed}}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
say() { echo "testbed/prepare: $*" >&2; }

command -v busybox >/dev/null || { say "needs busybox (apt-get install busybox-static)"; exit 1; }

# The kernel linux-image-amd64 points at today (its first versioned Depends).
KPKG=$(apt-cache depends linux-image-amd64 2>/dev/null |
       sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -1)
[[ -n $KPKG ]] || { say "apt does not know linux-image-amd64 (run apt-get update)"; exit 1; }
KVER=${KPKG#linux-image-}

if [[ ! -s $DIR/root/boot/vmlinuz-$KVER ]]; then
  pkgs=("$KPKG")
  if ! command -v qemu-system-x86_64 >/dev/null; then
    # What apt would install with qemu (its resolver picks the alternatives),
    # found by a simulation that changes nothing.
    mapfile -t q < <(apt-get install -s --no-install-recommends qemu-system-x86 seabios 2>/dev/null |
                     awk '$1 == "Inst" {print $2}')
    pkgs+=("${q[@]}")
  fi
  say "downloading ${#pkgs[@]} packages: ${pkgs[*]}"
  dl=$(mktemp -d "$DIR/dl.XXXXXX")
  chmod 755 "$dl"   # apt's _apt user downloads into it
  (cd "$dl" && apt-get download -q "${pkgs[@]}" >/dev/null 2>&1) ||
    (cd "$dl" && apt-get download "${pkgs[@]}")   # again, to show the error
  for d in "$dl"/*.deb; do dpkg-deb -x "$d" "$DIR/root"; done
  rm -rf "$dl"
fi

# A cache prepared for an earlier kernel (a Debian point release since)
# keeps that kernel's files beside this one's, and its extracted vmlinux
# would boot with this kernel's modules in the initramfs ("invalid module
# format"): the older kernels' files go, and vmlinux says which it is.
for old in "$DIR"/root/lib/modules/*; do
  [[ -d $old && ${old##*/} != "$KVER" ]] || continue
  say "dropping kernel ${old##*/} (now $KVER)"
  rm -rf "$old" "$DIR"/root/boot/*-"${old##*/}"
done

MODS=$DIR/root/lib/modules/$KVER
# The package ships no modules.dep (depmod runs at install): make one.
[[ -s $MODS/modules.dep ]] || busybox depmod -b "$DIR/root" "$KVER"

if [[ ! -s $DIR/vmlinux || $(cat "$DIR/vmlinux.kver" 2>/dev/null) != "$KVER" ]]; then
  python3 - "$DIR/root/boot/vmlinuz-$KVER" "$DIR/vmlinux.tmp" <<'PY'
import lzma, sys
img = open(sys.argv[1], "rb").read()
start = img.find(b"\xfd7zXZ\x00")          # Debian's bzImage carries an XZ payload
if start < 0:
    sys.exit("no XZ payload in " + sys.argv[1])
elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(img[start:])
if elf[:4] != b"\x7fELF":
    sys.exit("the XZ payload is not an ELF kernel")
open(sys.argv[2], "wb").write(elf)
PY
  mv "$DIR/vmlinux.tmp" "$DIR/vmlinux"
  echo "$KVER" > "$DIR/vmlinux.kver"
fi

if command -v qemu-system-x86_64 >/dev/null; then
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v qemu-system-x86_64)" > "$DIR/qemu"
else
  cat > "$DIR/qemu" <<'WRAP'
#!/bin/sh
# qemu unpacked from Debian's packages (not installed)
R=$(dirname "$0")/root
LD_LIBRARY_PATH=$R/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
  exec "$R/usr/bin/qemu-system-x86_64" -L "$R/usr/share/qemu" -L "$R/usr/share/seabios" "$@"
WRAP
fi
chmod +x "$DIR/qemu"
"$DIR/qemu" --version >/dev/null || { say "qemu does not run"; exit 1; }

# initramfs: busybox, the boot modules with their dependencies, /init.
IR=$(mktemp -d)
trap 'rm -rf "$IR"' EXIT
mkdir -p "$IR"/{bin,dev,proc,sys,host,root,mods,run,upper}
cp "$(command -v busybox)" "$IR/bin/busybox"
for a in $(busybox --list); do [[ $a == busybox ]] || ln -s busybox "$IR/bin/$a"; done
order=()
declare -A have=()
need() {   # need MODULE: its dependencies first, then itself
  local line rel dep
  line=$(grep -m1 -E "/${1//[-_]/[-_]}\.ko(\.xz)?:" "$MODS/modules.dep") || { say "no module $1"; exit 1; }
  rel=${line%%:*}
  [[ -z ${have[$rel]:-} ]] || return 0
  have[$rel]=1
  for dep in ${line#*:}; do dep=${dep##*/}; dep=${dep%.xz}; need "${dep%.ko}"; done
  mkdir -p "$IR/lib/modules/$(dirname "$rel")"
  cp "$MODS/$rel" "$IR/lib/modules/$rel"
  order+=("$rel")
}
for m in virtio_pci virtio_net 9pnet_virtio 9p overlay; do need "$m"; done
printf '%s\n' "${order[@]}" > "$IR/lib/modules/order"
install -m 755 "$HERE/init.sh" "$IR/init"
(cd "$IR" && find . | sort | busybox cpio -o -H newc 2>/dev/null) | gzip -1 > "$DIR/initrd.gz"
echo "$KVER" > "$DIR/kver"
say "ready: kernel $KVER in $DIR ($(du -sh "$DIR" | cut -f1))"
echo "$DIR"
