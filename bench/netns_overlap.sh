#!/usr/bin/env bash
# A CP scheme's message path (--scheme, the all-gather by default) across two hosts made as
# network namespaces on this machine (tests/multihost/hosts.sh; root), over TCP, one rank per
# host: `cpattn run` at CP = 2 (the all-gather with --shared-memory off --overlap on) (T = 8192, Hkv 4 or --kv-heads, D 128), two
# builds alternated run for run, and per run
# each rank's step, compute and exposed communication (CpStats::comm_s) with its parts, in ms
# (medians over --repeats 5 steps, as `cpattn run --json` reports them).
#
#   bench/netns_overlap.sh NEW_CPATTN [OLD_CPATTN] [--rate 4gbit] [--runs 2] [--dtype fp32]
#                          [--heads 16] [--kv-heads 4] [--scheme allgather|ring|pass-q]
#
# --rate puts a token bucket of that rate on both hosts' links (tc tbf). The namespaces share
# this machine's cores: TCP's copies run on the cores the ranks compute on, which a real
# network's hosts would not. The hosts are removed at the end.
set -euo pipefail
new=$1; shift
old=""
if [[ $# -gt 0 && $1 != --* ]]; then old=$1; shift; fi
rate="" runs=2 dtype=fp32 heads=16 kv_heads=4 scheme=allgather
while [[ $# -gt 0 ]]; do
  case $1 in
    --rate) rate=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --dtype) dtype=$2; shift 2 ;;
    --heads) heads=$2; shift 2 ;;
    --kv-heads) kv_heads=$2; shift 2 ;;
    --scheme) scheme=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
here=$(cd "$(dirname "$0")/.." && pwd)/tests/multihost
export CPATTN_NETNS_SUBNET=${CPATTN_NETNS_SUBNET:-93} OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
prefix=nob
out=$(mktemp -d)
trap 'bash "$here/hosts.sh" down $prefix 2; rm -rf "$out"' EXIT
bash "$here/hosts.sh" up $prefix 2
if [[ -n $rate ]]; then
  for h in ${prefix}ha ${prefix}hb; do ip netns exec $h tc qdisc add dev eth0 root tbf rate "$rate" burst 1mb latency 50ms; done
fi
only_allgather=()  # (the other schemes refuse these flags: they have neither)
[[ $scheme == allgather ]] && only_allgather=(--shared-memory off --overlap on)
one() {  # BINARY LABEL
  ip netns exec ${prefix}ha mpirun --host ${prefix}ha,${prefix}hb -np 2 --bind-to none \
    --mca plm_rsh_agent "$here/rsh_agent.sh" --mca routed direct --mca btl tcp,self \
    --mca btl_tcp_if_include "10.$CPATTN_NETNS_SUBNET.0.0/24" --mca oob_tcp_if_include "10.$CPATTN_NETNS_SUBNET.0.0/24" \
    -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM \
    "$1" run --seq-len 8192 --heads "$heads" --kv-heads "$kv_heads" --head-dim 128 --dtype "$dtype" --repeats 5 \
    --scheme "$scheme" ${only_allgather[@]+"${only_allgather[@]}"} --json > "$out/r.json"
  python3 - "$2" "$out/r.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[2]))
assert d["passed"], "the run's check against one process failed"
f = lambda k: "/".join(f"{1e3 * x:.1f}" for x in d[k])
share = "/".join(f"{100 * c / s:.1f}%" for c, s in zip(d["comm_s"], d["step_s"]))
print(f"| {sys.argv[1]} | {f('step_s')} | {f('compute_s')} | {f('comm_s')} | {share} | {f('agree_s')} | "
      f"{f('first_kv_s')} | {f('later_kv_s')} | {f('dkv_s')} |")
PY
}
echo "| build | step | compute | exposed | exposed share | agreement | first K/V | later K/V | dK/dV |"
echo "|---|---|---|---|---|---|---|---|---|"
for ((r = 0; r < runs; ++r)); do
  [[ -n $old ]] && one "$old" old
  one "$new" new
done
