#!/usr/bin/env bash
# testbed/net.sh up NS TAP...   a private network namespace NS with a bridge
#                               (198.18.0.1/24, the host's side) and taps for
#                               guests (guest.sh --netns NS --nic TAP=198.18.0.N/24)
# testbed/net.sh down NS        delete it (the bridge and taps go with it)
# Run host programs on the bridge with: ip netns exec NS PROGRAM...
set -euo pipefail
case ${1:-} in
  up)
    ns=$2; shift 2
    ip netns add "$ns"
    x() { ip netns exec "$ns" "$@"; }
    x sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
    # rdmx's soft engine asks for 16 MiB socket buffers (per namespace).
    x sysctl -qw net.core.rmem_max=16777216 net.core.wmem_max=16777216 2>/dev/null || true
    x ip link set lo up
    x ip link add br0 type bridge forward_delay 0 stp_state 0
    x ip addr add 198.18.0.1/24 dev br0
    for tap in "$@"; do
      x ip tuntap add "$tap" mode tap
      x ip link set "$tap" master br0 up
    done
    x ip link set br0 up
    ;;
  down) ip netns del "$2" 2>/dev/null || true ;;
  *) sed -n '2,7p' "$0" >&2; exit 2 ;;
esac
