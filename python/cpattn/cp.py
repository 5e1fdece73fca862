"""ContextParallelAttention: cpattn's CP layer (docs/cp.md) as a torch module over MPI.

Every rank passes its local rows of q, k, v (the planner's split, take_local_rows) and the
batch's global real boundaries; the module runs the C++ CpAttention of the chosen scheme
forward and backward. One C++ layer per (heads, head dims, dtype) is made on first use and
kept: its plan cache then serves every layer of a model that shares the module. The group is an
mpi4py communicator, or a torch.distributed process group made under mpirun, for which the
module derives the MPI communicator of the same processes (docs/python.md).
"""

import re
import weakref
from collections import OrderedDict

import numpy as np
import torch

from . import _cpattn
from .attention import (alibi, boundaries, check_same_dtype, check_tensor, check_thd, dtype_name,
                        in_place_or_copy, number, option_values, options_of, unit_head_dim)

# A failing rank's entry in the message of the ranks' meeting, and the kind of its error.
_FAILED_KIND = re.compile(r"\[ranks? [0-9,-]+\] (\w+): ")
_LAYERS_KEPT = 8  # layers (shapes x option combinations) a module keeps, the most recently used


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is the cp extra's dependency
        raise TypeError("comm must be an mpi4py communicator or a torch.distributed process group, and mpi4py "
                        "is not installed") from e
    return MPI


def _is_process_group(comm):
    """A torch.distributed group, or new_group's value on a process outside the group."""
    import torch.distributed as dist
    return dist.is_available() and (isinstance(comm, dist.ProcessGroup) or comm is dist.GroupMember.NON_GROUP_MEMBER)


# torch.distributed backends with collectives on CPU tensors: the group's ranks are checked with
# one all_gather over it (the attention itself runs over MPI).
_CPU_BACKENDS = ("gloo", "mpi")


def _process_group_size(group):
    """The size of a torch.distributed group this process is a member of (local checks only)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        raise ValueError("comm is a torch.distributed process group, but torch.distributed is not initialised "
                         "(init_process_group)")
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(f"comm must be a process group this process is a member of: torch.distributed rank "
                         f"{dist.get_rank()} is not in its ranks")
    config = dist.get_backend_config(group)  # e.g. "gloo", "cpu:gloo,cuda:nccl"
    devices = dict(part.split(":", 1) if ":" in part else ("cpu", part) for part in config.split(","))
    if devices.get("cpu") not in _CPU_BACKENDS:
        raise ValueError(f"comm's backend must run collectives on CPU tensors ({' or '.join(_CPU_BACKENDS)}), got "
                         f"'{config}': cpattn checks the group's ranks with an all_gather on the CPU")
    return dist.get_world_size(group)


def _mpi_comm_of_group(group):
    """The mpi4py communicator of a torch.distributed group's processes, in the group's rank order.

    For groups made under mpirun (init_process_group from OMPI_COMM_WORLD_RANK / SIZE): global
    torch rank r must be MPI.COMM_WORLD rank r. The members agree on that with one all_gather
    over the group, so that a mismatch fails every member with the same message; then
    COMM_WORLD.Create_group on the group's global ranks (collective over the members only).
    """
    import torch.distributed as dist
    MPI = _mpi()
    world = MPI.COMM_WORLD
    mine = torch.tensor([dist.get_rank(), world.rank, world.size, dist.get_world_size()], dtype=torch.int64)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    bad = [t.tolist() for t in table if t[0] != t[1] or t[2] != t[3]]
    if bad:
        torch_rank, mpi_rank, mpi_size, torch_size = bad[0]
        raise ValueError(f"comm must be a process group whose processes are MPI.COMM_WORLD's under the same ranks "
                         f"(init_process_group with rank = OMPI_COMM_WORLD_RANK, world_size = "
                         f"OMPI_COMM_WORLD_SIZE): torch.distributed rank {torch_rank} of {torch_size} is MPI rank "
                         f"{mpi_rank} of {mpi_size}")
    members = world.Get_group().Incl(dist.get_process_group_ranks(group))
    try:
        return world.Create_group(members)
    finally:
        members.Free()


def _free_comm(comm):
    MPI = _mpi()
    if not MPI.Is_finalized() and comm != MPI.COMM_NULL:
        comm.Free()


def _mpi_comm(comm):
    """comm, checked to be a usable mpi4py communicator (local checks only)."""
    MPI = _mpi()
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py MPI.Comm or a torch.distributed ProcessGroup, got "
                        f"{type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm must be a valid communicator, got MPI.COMM_NULL")
    return comm


class _CpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, layer, seed):
        q_, k_, v_ = in_place_or_copy(q.detach()), k.detach().contiguous(), v.detach().contiguous()
        out = q_.new_empty((q.shape[0], q.shape[1], v.shape[2]))
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32)
        ctx.cp = layer.forward(cu_seqlens, q_, k_, v_, out, lse, seed)
        ctx.layer = layer
        ctx.save_for_backward(q_, out)
        ctx.kv_shapes = (k.shape, v.shape)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        if ctx.cp is None:  # the C++ context hands its saved state to the first backward
            raise RuntimeError("ContextParallelAttention: a second backward through the same forward "
                               "(retain_graph=True) is not supported; run the forward again")
        q, out = ctx.saved_tensors
        k_shape, v_shape = ctx.kv_shapes
        dq = torch.empty_like(q)
        dk, dv = q.new_empty(k_shape), q.new_empty(v_shape)
        cp, ctx.cp = ctx.cp, None
        ctx.layer.backward(cp, q, out, unit_head_dim(dout).detach(), dq, dk, dv)
        return dq, dk, dv, None, None, None


class ContextParallelAttention(torch.nn.Module):
    """Exact context-parallel attention over an mpi4py communicator or a torch.distributed group.

    forward(q, k, v, cu_seqlens): q [local_tokens, Hq, Dqk], k [local_tokens, Hkv, Dqk], v
    [local_tokens, Hkv, Dv] are this rank's rows in the planner's order
    (get_thd_load_balanced_cp_metadata(cu_seqlens, cp, rank, split), take_local_rows);
    cu_seqlens [documents + 1] int32/int64 are the batch's global real boundaries, the same on
    every rank. Returns out [local_tokens, Hq, Dv] (padding rows 0), differentiable. Making the
    module is collective (it duplicates the communicator): every rank makes it.

    comm: an mpi4py communicator, or a torch.distributed ProcessGroup made under mpirun whose
    ranks are MPI.COMM_WORLD's (the module then runs over the matching MPI communicator;
    docs/python.md). The scheme arguments are CpAttnConfig's (docs/cp.md), under its names:
    scheme (any name the C++ layer knows: "allgather", "ring", "pass-q", "a2a", "hybrid"),
    cp_inner (hybrid only, required there: the all-to-all group size, dividing the group's
    size), hybrid_outer ("allgather" or "ring"), split ("padded" or "padding-free", the
    planner's; the padding-free split needs scheme allgather), kv_mode ("runs" or "index"),
    overlap (the all-gather's overlap by KV-head groups, and at its two ends by groups of
    documents, default True: bitwise the results of False; docs/cp.md "Overlap"),
    shared_memory (the all-gather's K/V and dK/dV through shared-memory buffers when every
    rank runs on one host, default True: bitwise the
    results of False; docs/cp.md "Shared memory"), deterministic, check_finite,
    plan_cache_capacity. They are checked here, on every rank
    alike, before anything is sent. Dropout applies in training mode only, with a seed drawn
    from rank 0's torch generator. check_finite=True makes a NaN or inf in q, k, v or the
    incoming gradient a ValueError on every rank naming the tensor and its first bad element
    (global token, head, dim) instead of a silent NaN (it costs a pass over the tensors).
    timeout (seconds, > 0) is the deadline of each collective; None: the CPATTN_COMM_TIMEOUT_S
    variable, else 300 s (docs/comm.md). A collective past it aborts the MPI job with a line
    naming the operation and the rank.
    """

    def __init__(self, comm, *, scheme="allgather", cp_inner=None, hybrid_outer="allgather", split="padded",
                 kv_mode="runs", causal=True, softmax_scale=None, dropout_p=0.0, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, deterministic=True, check_finite=False, plan_cache_capacity=8,
                 timeout=None, overlap=True, shared_memory=True):
        super().__init__()
        group = comm if _is_process_group(comm) else None
        size = _process_group_size(group) if group is not None else _mpi_comm(comm).Get_size()
        for name, value in (("scheme", scheme), ("hybrid_outer", hybrid_outer), ("split", split),
                            ("kv_mode", kv_mode)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        for name, value, optional in (("cp_inner", cp_inner, True), ("plan_cache_capacity", plan_cache_capacity, False)):
            if (value is not None or not optional) and (not isinstance(value, (int, np.integer))
                                                        or isinstance(value, bool)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if scheme == "hybrid" and cp_inner is None:
            raise ValueError(f"cp_inner is required for scheme 'hybrid': the ranks of one all-to-all group, a "
                             f"divisor of the group's size {size}")
        if not 1 <= plan_cache_capacity <= _cpattn.MAX_PLAN_CACHE_CAPACITY:
            raise ValueError(f"plan_cache_capacity must be in 1..{_cpattn.MAX_PLAN_CACHE_CAPACITY}, got "
                             f"{plan_cache_capacity}")
        if timeout is not None:  # its range is the Communicator's rule, checked before its duplicate
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
            timeout = float(timeout)
        cp_inner = None if cp_inner is None else int(cp_inner)
        plan_cache_capacity = int(plan_cache_capacity)
        self._scheme = _cpattn.SchemeArgs(scheme=scheme, cp_inner=0 if cp_inner is None else cp_inner,
                                          hybrid_outer=hybrid_outer, split=split, kv_mode=kv_mode,
                                          overlap=bool(overlap), deterministic=bool(deterministic),
                                          check_finite=bool(check_finite),
                                          plan_cache_capacity=plan_cache_capacity,
                                          shared_memory=bool(shared_memory))
        _cpattn.check_scheme(size, self._scheme)  # ValueError with the C++ layer's message
        # The attention options' types now (their ranges are the kernels' rules, checked with the
        # tensors at the first call, on every rank alike).
        option_values(causal, softmax_scale, dropout_p, window_size, softcap)
        slopes = alibi(alibi_slopes)
        # Every argument is checked: only now does anything move (a process group's rank check).
        self.group = group
        self.comm = _mpi_comm_of_group(group) if group is not None else comm
        if group is not None:  # ours: freed with the module (CpComm holds its own duplicate)
            weakref.finalize(self, _free_comm, self.comm)
        # The C++ layers' communicator, one duplicate for all of them (a collective, every rank
        # alike): making a layer then sends nothing, and every call meets on it first.
        self._cp_comm = _cpattn.CpComm(_mpi()._addressof(self.comm), timeout)
        # (fixed from here: the layers are built with them, so __setattr__ refuses a new value)
        self.scheme, self.cp_inner, self.hybrid_outer, self.split = scheme, cp_inner, hybrid_outer, split
        self.kv_mode, self.check_finite, self.plan_cache_capacity = kv_mode, check_finite, plan_cache_capacity
        self.overlap, self.shared_memory = bool(overlap), bool(shared_memory)
        self.causal, self.softmax_scale, self.dropout_p = causal, softmax_scale, dropout_p
        self.window_size, self.softcap, self.deterministic = window_size, softcap, deterministic
        self.alibi_slopes = slopes
        self.timeout = timeout
        self._layers = OrderedDict()  # (Hq, Hkv, Dqk, Dv, dtype, attention options) -> _cpattn.CpLayer

    # The arguments a module is built with: assigning one afterwards raised nothing and changed
    # nothing (the layers keep their construction's). The attention options (causal,
    # softmax_scale, dropout_p, window_size, softcap, alibi_slopes) are read at each call.
    _FIXED = frozenset({"scheme", "cp_inner", "hybrid_outer", "split", "kv_mode", "overlap", "shared_memory",
                        "deterministic", "check_finite", "plan_cache_capacity", "timeout"})

    def __setattr__(self, name, value):
        if name in self._FIXED and name in self.__dict__:
            raise AttributeError(f"{name} is fixed when a ContextParallelAttention is made (its layers are built "
                                 f"with it): make another module with {name}={value!r}")
        super().__setattr__(name, value)

    def _layer(self, q, k, v, dropout):
        # The attention options are read at each call (attributes set after construction count),
        # checked and normalised, and are part of the key: a layer is made for each combination
        # met, the _LAYERS_KEPT most recently used kept (options that change every step, a
        # dropout schedule say, would otherwise keep a layer, its plan cache and buffers, per step).
        slopes = alibi(self.alibi_slopes)
        values = option_values(self.causal, self.softmax_scale, self.dropout_p if dropout else 0.0, self.window_size,
                               self.softcap)
        key = (q.shape[1], k.shape[1], q.shape[2], v.shape[2], q.dtype, values,
               None if slopes is None else tuple(slopes.tolist()))
        if key in self._layers:
            self._layers.move_to_end(key)
        else:
            opts = options_of(values, 0)
            self._layers[key] = _cpattn.make_cp_layer(
                self._cp_comm, q.shape[1], k.shape[1], q.shape[2], v.shape[2], dtype_name(q.dtype),
                self._scheme, opts, slopes)
            while len(self._layers) > _LAYERS_KEPT:
                self._layers.popitem(last=False)
        return self._layers[key]

    def forward(self, q, k, v, cu_seqlens):
        # The checks here may fail on one rank alone (its tensors): the ranks then meet (one
        # agreement under the deadline, which also carries rank 0's dropout seed) before anything
        # else is sent, and every rank raises the failing ranks' messages, each after its kind:
        # a TypeError when every failing rank's was one (as the same call raises alone), else a
        # ValueError. Alone, the error is raised as it is.
        dropout = False
        try:
            dropout = self.training and number("dropout_p", self.dropout_p) > 0.0
            for name, t in (("q", q), ("k", k), ("v", v)):
                check_tensor(name, t)
                check_thd(name, t, "local_tokens")
            check_same_dtype(q=q, k=k, v=v)
            cu = boundaries("cu_seqlens", cu_seqlens)
            layer = self._layer(q, k, v, dropout)
            error = ""
        except (TypeError, ValueError) as e:
            if self._cp_comm.size == 1:
                raise
            error = f"{type(e).__name__}: {e}"
        try:
            seed = self._cp_comm.meet(error, int(torch.randint(0, 2**63 - 1, ())) if dropout else None)
        except ValueError as e:
            # "... rejected its arguments: [rank 1] TypeError: ... [ranks 2-3] ValueError: ...":
            # the same text, so the same kind, on every rank.
            kinds = _FAILED_KIND.findall(str(e))  # (a ValueError subclass's name counts as not TypeError)
            if kinds and all(kind == "TypeError" for kind in kinds):
                raise TypeError(str(e)) from None
            raise
        return _CpFunction.apply(q, k, v, cu, layer, seed)
