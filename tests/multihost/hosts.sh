#!/usr/bin/env bash
# Test hosts as network namespaces on one machine (docs/reliability.md, "Across hosts").
#   hosts.sh up PREFIX N     N hosts PREFIXha, PREFIXhb, ... (letters: Open MPI compresses digits in
#                            node names into ranges and can misroute such names), each with
#                            eth0 = 10.S.0.(i+1)/24 on one bridge (in namespace PREFIXsw), and
#                            /etc/netns/PREFIXhX/hosts naming all of them (ip netns exec mounts
#                            it over /etc/hosts); N <= 8
#   hosts.sh down PREFIX N   kills what runs in them and removes them (idempotent)
# S, the subnet's third byte, is taken from CPATTN_NETNS_SUBNET (default 77). Needs root.
set -euo pipefail
cmd=$1 prefix=$2 n=$3
subnet=${CPATTN_NETNS_SUBNET:-77}
sw=${prefix}sw
letters=(a b c d e f g h)
host() { echo "${prefix}h${letters[$1]}"; }
down() {
  for ((i = 0; i < n; ++i)); do
    h=$(host "$i")
    if ip netns list | grep -qw "$h"; then
      ip netns pids "$h" | xargs -r kill -9 2>/dev/null || true
      ip netns del "$h"
    fi
    rm -rf "/etc/netns/$h"
  done
  if ip netns list | grep -qw "$sw"; then ip netns del "$sw"; fi
}
case $cmd in
  up)
    down
    ip netns add "$sw"
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    for ((i = 0; i < n; ++i)); do
      h=$(host "$i")
      ip netns add "$h"
      ip link add "${prefix}e$i" type veth peer name "${prefix}p$i"
      ip link set "${prefix}e$i" netns "$h"
      ip link set "${prefix}p$i" netns "$sw"
      ip -n "$sw" link set "${prefix}p$i" master br0 up
      ip -n "$h" link set lo up
      ip -n "$h" link set "${prefix}e$i" name eth0
      ip -n "$h" addr add "10.$subnet.0.$((i + 1))/24" dev eth0
      ip -n "$h" link set eth0 up
    done
    for ((i = 0; i < n; ++i)); do
      mkdir -p "/etc/netns/$(host "$i")"
      { echo "127.0.0.1 localhost"
        for ((j = 0; j < n; ++j)); do echo "10.$subnet.0.$((j + 1)) $(host "$j")"; done
      } > "/etc/netns/$(host "$i")/hosts"
    done
    ;;
  down) down ;;
  *) echo "usage: hosts.sh up|down PREFIX N" >&2; exit 2 ;;
esac
