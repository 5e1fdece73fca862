"""ContextParallelAttention at 2 and 3 ranks under mpiexec, every scheme of the C++ layer,
against the single-process call (cp_script.py holds the check)."""

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("cp_script.py")
SCHEMES = "allgather,ring,pass-q"  # the schemes without head-count rules (a2a, hybrid: C++ tests)


@pytest.mark.parametrize("ranks, lengths", [(2, "1,7,16"), (3, "5,1,12,2")])
def test_cp_matches_one_process(ranks, lengths):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", CPATTN_COMM_TIMEOUT_S="60",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, str(SCRIPT), SCHEMES, lengths],
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"PASS {4 * len(SCHEMES.split(','))}" in result.stdout  # 4 cases per scheme
