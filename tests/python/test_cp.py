"""ContextParallelAttention at 2 and 3 ranks under mpiexec, every scheme of the C++ layer and
both splits, over MPI and a torch.distributed gloo group, against the single-process call
(cp_script.py holds the check and the bad-argument cases, which must fail every rank alike)."""

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("cp_script.py")
# Every scheme; the hybrid at every cp_inner dividing the ranks (1: the outer scheme alone,
# cp: a2a) with both outer schemes, the padding-free split (the all-gather scheme's) and the
# index key mode, and the all-gather's shared memory off (the default allgather runs over it,
# these ranks sharing a host), then the overlap off too (shared_memory=off runs the overlap:
# two KV-head groups at 2 ranks; MQA at 3 has one group). Heads: GQA with split KV heads at 2 ranks, MQA (replicated KV heads
# under a2a) at 3. A torch.distributed gloo group: the default one at 2 ranks, new_group([0, 2])
# at 3 (rank 0, which prints the count, is in it). A hybrid with both cp_inner and cp_outer
# above 1 (2 x 2) is the C++ cp_a2a_test.np4's: the binding passes the same fields at any size.
RUNS = {
    "2 ranks + torch.distributed": (2, "allgather,ring,pass-q,a2a,hybrid:cp_inner=1,hybrid:cp_inner=2:hybrid_outer=ring,"
                                       "allgather:split=padding-free,allgather:kv_mode=index,allgather:shared_memory=off:overlap=off,"
                                       "allgather:shared_memory=off", "1,7,16", "4,2",
                                    ["--torch-group", "ring,hybrid:cp_inner=2,allgather:split=padding-free"]),
    "3 ranks + torch.distributed group of ranks 0, 2": (3, "allgather,ring,pass-q,a2a,hybrid:cp_inner=3,hybrid:cp_inner=1:hybrid_outer=ring,"
                   "allgather:split=padding-free", "5,1,12,2", "6,1", ["--torch-group", "ring", "0,2"]),
    # One 1-token document, padding-free: the ranks but one hold no token (tensors of 0 rows).
    "3 ranks, one token": (3, "allgather:split=padding-free,allgather:split=padding-free:shared_memory=off", "1",
                           "4,2", []),
}


@pytest.mark.parametrize("run", RUNS.keys())
def test_cp_matches_one_process(run):
    ranks, configs, lengths, heads, extra = RUNS[run]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", CPATTN_COMM_TIMEOUT_S="60",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, str(SCRIPT), configs, lengths, heads, *extra],
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cases = 4 * (len(configs.split(",")) + (len(extra[1].split(",")) if extra else 0))  # 4 per configuration
    assert f"PASS {cases}" in result.stdout
