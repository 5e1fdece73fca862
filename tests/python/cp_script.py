"""Run under mpiexec by test_cp.py: ContextParallelAttention at CP = world size against the
single-process flash_attn_varlen_func on the same global batch, forward and backward.

Usage: mpiexec -n N python cp_script.py SCHEMES LENGTHS (e.g. allgather,ring 1,7,16): every
scheme in fp32 and bf16, causal and not, in one launch (starting torch is most of its cost).
Prints "PASS <cases>" on rank 0, or raises.
"""

import sys

import torch
from mpi4py import MPI

import cpattn

def check(comm, scheme, dtype, causal, lengths):
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total, hq, hkv, dqk, dv = int(cu[-1]), 4, 2, 24, 16  # GQA and MLA head dims at once
    g = torch.Generator().manual_seed(7)  # the same global batch on every rank
    q, k, v, dout = (torch.randn(total, h, d, generator=g).to(dtype) for h, d in
                     ((hq, dqk), (hkv, dqk), (hkv, dv), (hq, dv)))

    # The single-process reference: the whole batch on each rank.
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = cpattn.flash_attn_varlen_func(*ref, cu, cu, max(lengths), max(lengths), causal=causal)
    out_ref.backward(dout)

    plan = cpattn.get_thd_load_balanced_cp_metadata(cu, comm.size, comm.rank)
    local = [cpattn.take_local_rows(t, plan).requires_grad_() for t in (q, k, v)]
    attn = cpattn.ContextParallelAttention(comm, scheme=scheme, causal=causal)
    out = attn(*local, cu)
    out.backward(cpattn.take_local_rows(dout, plan))

    def gathered(t):  # every rank's real rows, in global order
        full = torch.zeros((plan.global_tokens,) + tuple(t.shape[1:]), dtype=torch.float32)
        for r, part in enumerate(comm.allgather(t.detach().float())):
            cpattn.put_local_rows(part, cpattn.get_thd_load_balanced_cp_metadata(cu, comm.size, r), full)
        return full

    pad = torch.from_numpy(plan.real_token_index < 0)
    assert torch.all(out[pad] == 0), f"{scheme}: padding rows of out must be 0"
    for name, got, want in (("out", out, out_ref), ("dq", local[0].grad, ref[0].grad),
                            ("dk", local[1].grad, ref[1].grad), ("dv", local[2].grad, ref[2].grad)):
        got, want = gathered(got), want.detach().float()
        if dtype == torch.float32:  # tolerance.hpp: fp32 relative L2 error <= 1e-5
            err = float((got - want).norm() / want.norm())
            assert err <= 1e-5, f"{scheme} {dtype} causal={causal} {name}: relative L2 error {err} > 1e-5"
        else:  # a CP run against one process: the storage dtype's elementwise rule
            tol = 5e-3 if dtype == torch.float16 else 2.5e-2
            assert torch.all((got - want).abs() <= tol + tol * want.abs()), f"{scheme} {dtype} causal={causal} {name}: outside {tol} + {tol}|ref|"


def main():
    schemes, lengths = sys.argv[1].split(","), [int(x) for x in sys.argv[2].split(",")]
    cases = [(s, d, c) for s in schemes for d in (torch.float32, torch.bfloat16) for c in (True, False)]
    for scheme, dtype, causal in cases:
        check(MPI.COMM_WORLD, scheme, dtype, causal, lengths)
    if MPI.COMM_WORLD.rank == 0:
        print("PASS", len(cases), flush=True)


if __name__ == "__main__":
    main()
