#!/bin/busybox sh
# /init of the testbed guest (PID 1), put into the initramfs by prepare.sh.
# It reaches the host's / over virtio-9p (read-only, under a tmpfs overlay so
# the guest may write), runs the command that guest.sh left in the run
# directory, stores its exit status there and powers off.
# 9p shares (set up by guest.sh): run (rw: guest.env, cmd, rc), hostroot (ro),
# modules (ro: the unpacked module tree), rw0.. (rw: --rw directories).
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
fail() { echo "testbed init: $*" >&2; echo 125 > /run/rc; sync; poweroff -f; }
while read -r m; do insmod "/lib/modules/$m" || fail "insmod $m"; done < /lib/modules/order

P9="trans=virtio,version=9p2000.L,msize=512000"
mount -t 9p -o "$P9,cache=none" run /run || { echo "testbed init: no run share" >&2; poweroff -f; }
. /run/guest.env
mount -t 9p -o "$P9,ro,cache=loose" hostroot /host || fail "mount hostroot"
mount -t tmpfs -o size=75% tmpfs /upper
mkdir -p /upper/data /upper/work
R=/root
mount -t overlay -o lowerdir=/host,upperdir=/upper/data,workdir=/upper/work overlay $R ||
  fail "overlay over the host root"
mount -t proc proc $R/proc
mount -t sysfs sys $R/sys
mount -t devtmpfs dev $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
mount -t tmpfs tmpfs $R/run          # not the host's /run
mount -t 9p -o "$P9,ro,cache=loose" modules /mods || fail "mount modules"
mkdir -p $R/lib/modules && mount --bind /mods $R/lib/modules
mkdir -p "$R$TESTBED_RUN" && mount --bind /run "$R$TESTBED_RUN"
i=0
for d in $TESTBED_RW; do
  mkdir -p "$R$d" && mount -t 9p -o "$P9,cache=none" "rw$i" "$R$d" || fail "mount $d"
  i=$((i + 1))
done
# Modules load on demand (rxe asks the crypto API for crc32): the kernel runs
# this helper in this initramfs, so the module tree goes here too.
mount --bind /mods /lib/modules
echo /bin/modprobe > /proc/sys/kernel/modprobe
# The host may have no kmod: busybox's module tools on the guest's PATH.
mkdir -p $R/usr/local/sbin
cp /bin/busybox $R/usr/local/sbin/busybox
for t in modprobe insmod lsmod rmmod; do
  [ -e $R/sbin/$t ] || [ -e $R/usr/sbin/$t ] || ln -s busybox $R/usr/local/sbin/$t
done

ip link set lo up
for nic in $TESTBED_NICS; do                  # eth0=198.18.0.2/24 ...
  dev=${nic%%=*}
  ip link set "$dev" up || fail "no $dev"
  [ "$nic" = "$dev" ] || ip addr add "${nic#*=}" dev "$dev" || fail "address on $dev"
done
if [ -n "$TESTBED_RXE" ]; then
  modprobe rdma_rxe || fail "modprobe rdma_rxe"
  modprobe rdma_ucm || fail "modprobe rdma_ucm"   # rdma_cm from user space (perftest -R)
  for nic in $TESTBED_NICS; do
    dev=${nic%%=*}
    chroot $R rdma link add "rxe${dev#eth}" type rxe netdev "$dev" || fail "rdma link add on $dev"
  done
fi
for m in $TESTBED_MODULES; do modprobe "$m" || fail "modprobe $m"; done
grep -qw configfs /proc/filesystems && mount -t configfs configfs $R/sys/kernel/config

export HOME=/root TERM=dumb TESTBED_GUEST=1
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# guest.sh writes the command in bash's quoting; the host's bash runs it.
chroot $R /bin/sh -c 'cd "$TESTBED_CWD" 2>/dev/null || cd /
  if [ -x /bin/bash ]; then exec /bin/bash "$TESTBED_RUN/cmd"; fi
  exec /bin/sh "$TESTBED_RUN/cmd"' < /dev/null
echo $? > /run/rc
sync
poweroff -f
