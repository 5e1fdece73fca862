"""Run under mpiexec by test_cp.py: ContextParallelAttention at CP = world size against the
single-process flash_attn_varlen_func on the same global batch, forward and backward.

Usage: mpiexec -n N python cp_script.py CONFIGS LENGTHS HEADS [--torch-group GROUP_CONFIGS [RANKS]]
  CONFIGS  comma-separated scheme configurations, each a scheme name followed by
           ContextParallelAttention arguments as :name=value (an int where it parses as one,
           a bool for on/off),
           e.g. allgather,hybrid:cp_inner=2:hybrid_outer=ring,allgather:split=padding-free
  LENGTHS  the documents' lengths, e.g. 1,7,16
  HEADS    Hq,Hkv, e.g. 4,2
  --torch-group GROUP_CONFIGS [RANKS]  then the bad torch.distributed groups, and
           GROUP_CONFIGS over a gloo group (env:// from mpirun's ranks) in place of
           MPI.COMM_WORLD: the default group, or new_group(RANKS) (e.g. 0,2; the other
           processes sit the cases out).
Every configuration runs in fp32 and bf16, causal and not, in one launch (starting torch is
most of its cost). Prints "PASS <cases>" on rank 0, or raises.
"""

import gc
import os
import socket
import sys

import torch
from mpi4py import MPI

import cpattn

WORLD = MPI.COMM_WORLD


def parse_config(text):
    scheme, *args = text.split(":")
    kwargs = {}
    for arg in args:
        name, value = arg.split("=")
        flags = {"on": True, "off": False}
        kwargs[name] = int(value) if value.lstrip("-").isdigit() else flags.get(value, value)
    return scheme, kwargs


def check(group, scheme, kwargs, dtype, causal, lengths, heads):
    split = kwargs.get("split", "padded")
    what = f"{scheme} {kwargs} {dtype} causal={causal}"
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    (hq, hkv), dqk, dv, total = heads, 23, 13, int(cu[-1])  # GQA/MQA and MLA's odd head dims
    g = torch.Generator().manual_seed(7)  # the same global batch on every rank
    q, k, v, dout = (torch.randn(total, h, d, generator=g).to(dtype) for h, d in
                     ((hq, dqk), (hkv, dqk), (hkv, dv), (hq, dv)))

    # The single-process reference: the whole batch on each rank.
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = cpattn.flash_attn_varlen_func(*ref, cu, cu, max(lengths), max(lengths), causal=causal)
    out_ref.backward(dout)

    attn = cpattn.ContextParallelAttention(group, scheme=scheme, causal=causal, **kwargs)
    comm = attn.comm  # group's processes under MPI (a torch group's: derived by the module)
    plan = cpattn.get_thd_load_balanced_cp_metadata(cu, comm.size, comm.rank, split)
    local = [cpattn.take_local_rows(t, plan).requires_grad_() for t in (q, k, v)]
    out = attn(*local, cu)
    out.backward(cpattn.take_local_rows(dout, plan))

    def gathered(t):  # every rank's real rows, in global order
        full = torch.zeros((plan.global_tokens,) + tuple(t.shape[1:]), dtype=torch.float32)
        for r, part in enumerate(comm.allgather(t.detach().float())):
            cpattn.put_local_rows(part, cpattn.get_thd_load_balanced_cp_metadata(cu, comm.size, r, split), full)
        return full

    pad = torch.from_numpy(plan.real_token_index < 0)
    assert torch.all(out[pad] == 0), f"{what}: padding rows of out must be 0"
    for name, got, want in (("out", out, out_ref), ("dq", local[0].grad, ref[0].grad),
                            ("dk", local[1].grad, ref[1].grad), ("dv", local[2].grad, ref[2].grad)):
        got, want = gathered(got), want.detach().float()
        if dtype == torch.float32:  # tolerance.hpp: fp32 relative L2 error <= 1e-5
            err = float((got - want).norm() / want.norm())
            assert err <= 1e-5, f"{what} {name}: relative L2 error {err} > 1e-5"
        else:  # a CP run against one process: the storage dtype's elementwise rule
            tol = 5e-3 if dtype == torch.float16 else 2.5e-2
            assert torch.all((got - want).abs() <= tol + tol * want.abs()), f"{what} {name}: outside {tol} + {tol}|ref|"


def expect_same_error(make, *words, kind=ValueError):
    """make() raises `kind` on every rank, with the same message, naming `words`."""
    try:
        make()
        message = "no error"
    except (TypeError, ValueError) as e:
        message = f"{type(e).__name__}: {e}"
    messages = WORLD.allgather(message)
    assert len(set(messages)) == 1, f"ranks disagree: {messages}"
    assert message.startswith(kind.__name__ + ": "), f"expected a {kind.__name__}: {message}"
    assert all(w in message for w in words), f"expected {words} in: {message}"


def init_gloo(rank):
    """torch.distributed's default group over gloo from env://, on a port rank 0 found free."""
    import torch.distributed as dist
    port = None
    if WORLD.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(WORLD.bcast(port, root=0)))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=WORLD.size)


def torch_group(ranks):
    """The bad groups (each a ValueError on every rank alike), then the group to run: the default
    group of mpirun's ranks, or new_group(ranks) (None on the processes outside it)."""
    import torch.distributed as dist
    # Ranks that are not MPI's: rank r of torch is MPI rank size - 1 - r.
    init_gloo(WORLD.size - 1 - WORLD.rank)
    expect_same_error(lambda: cpattn.ContextParallelAttention(dist.group.WORLD), "comm", "MPI.COMM_WORLD",
                      "same ranks")
    dist.destroy_process_group()
    init_gloo(WORLD.rank)
    # A backend without collectives on CPU tensors (one registered for CUDA devices only).
    dist.Backend.register_backend("cudaonly", lambda store, rank, size, timeout:
                                  dist.ProcessGroupGloo(store, rank, size, timeout), devices=["cuda"])
    expect_same_error(lambda: cpattn.ContextParallelAttention(dist.new_group(backend="cudaonly")), "comm's backend",
                      "CPU")
    # A process outside the group: rank 0's group of one is fine there, a ValueError elsewhere.
    alone = dist.new_group(ranks=[0])
    if WORLD.rank != 0:
        try:
            cpattn.ContextParallelAttention(alone)
            raise AssertionError("a group without this process must be a ValueError")
        except ValueError as e:
            assert "comm must be a process group this process is a member of" in str(e), e
    # The MPI communicator a group's module makes is freed with the module.
    attn = cpattn.ContextParallelAttention(dist.group.WORLD)
    made = attn.comm
    del attn
    gc.collect()
    from mpi4py import MPI
    assert made == MPI.COMM_NULL, "the module's communicator outlived it"
    if ranks is None:
        return dist.group.WORLD
    group = dist.new_group(ranks=ranks)
    return group if WORLD.rank in ranks else None


def bad_arguments(group):
    """Each a ValueError naming the argument, the same on every rank, before anything is sent."""
    size = WORLD.size
    expect_same_error(lambda: cpattn.ContextParallelAttention(group, scheme="ring-all"), "scheme must be one of",
                      "'ring-all'")
    expect_same_error(lambda: cpattn.ContextParallelAttention(group, scheme="hybrid"), "cp_inner is required")
    expect_same_error(lambda: cpattn.ContextParallelAttention(group, scheme="hybrid", cp_inner=size + 1),
                      f"cp_inner = {size + 1} must divide cp = {size}")
    expect_same_error(lambda: cpattn.ContextParallelAttention(group, scheme="ring", split="padding-free"),
                      "scheme ring takes only the padded split")
    # a2a's head rule needs the heads: at the first call, still before the first collective.
    cu = torch.tensor([0, 4 * size], dtype=torch.int32)
    q = torch.zeros(cu[-1] // size, 2 * size + 1, 8)
    expect_same_error(lambda: cpattn.ContextParallelAttention(group, scheme="a2a")(q, q, q, cu),
                      f"num_heads_q = {2 * size + 1} must be divisible by the all-to-all group size {size}")
    # One rank's tensors fail a check, the module's own (a 2-D q) or the C++ layer's (heads
    # that do not group): the ranks meet first, and every rank raises that rank's message; then
    # the same module runs a good call.
    attn = cpattn.ContextParallelAttention(group)
    last = WORLD.rank == size - 1
    q = torch.zeros(4, 2, 8)
    expect_same_error(lambda: attn(q.reshape(4, 16) if last else q, q, q, cu), f"[rank {size - 1}]",
                      "q must be [local_tokens, heads, head_dim] (3 dimensions)")
    expect_same_error(lambda: attn(torch.zeros(4, 3, 8) if last else q, q, q, cu), f"[rank {size - 1}]",
                      "num_heads_q must be a multiple of num_heads_k, got 3 and 2")
    # The kind as alone (test_errors.py): a wrong dtype on one rank is a TypeError on every rank;
    # with another rank's ValueError beside it, a ValueError naming both.
    expect_same_error(lambda: attn(q.double() if last else q, q, q, cu), f"[rank {size - 1}] TypeError: q must be "
                      "float32, float16 or bfloat16", kind=TypeError)
    first = WORLD.rank == 0
    expect_same_error(lambda: attn(q.double() if last else q.reshape(4, 16) if first else q, q, q, cu),
                      f"[rank {size - 1}] TypeError: q must be float32", "[rank 0] ValueError: q must be [local_tokens",
                      kind=ValueError)
    assert attn(q, q, q, cu).shape == (4, 2, 8)


def run_cases(group, configs, lengths, heads, every_process=True):
    if group is None:  # a process outside the torch group under test
        return 0
    if every_process:  # the bad arguments' messages are compared over WORLD
        bad_arguments(group)
    cases = [(s, kw, d, c) for s, kw in configs for d in (torch.float32, torch.bfloat16) for c in (True, False)]
    for scheme, kwargs, dtype, causal in cases:
        check(group, scheme, kwargs, dtype, causal, lengths, heads)
    return len(cases)


def main():
    configs = [parse_config(c) for c in sys.argv[1].split(",")]
    lengths = [int(x) for x in sys.argv[2].split(",")]
    heads = tuple(int(x) for x in sys.argv[3].split(","))
    passed = run_cases(WORLD, configs, lengths, heads)
    if sys.argv[4:5] == ["--torch-group"]:
        ranks = [int(r) for r in sys.argv[6].split(",")] if len(sys.argv) > 6 else None
        passed += run_cases(torch_group(ranks), [parse_config(c) for c in sys.argv[5].split(",")], lengths, heads,
                            every_process=ranks is None)
        # Gloo's worker threads must stop before the interpreter does: one left running may
        # drop its last tensor reference during finalization, and that aborts the process
        # ("terminate called without an active exception" from ProcessGroupGloo::runLoop).
        import torch.distributed as dist
        dist.destroy_process_group()
    if WORLD.rank == 0:
        print("PASS", passed, flush=True)


if __name__ == "__main__":
    main()
