"""ContextParallelAttention: cpattn's CP layer (docs/cp.md) as a torch module over mpi4py.

Every rank passes its local rows of q, k, v (the planner's split, take_local_rows) and the
batch's global real boundaries; the module runs the C++ CpAttention of the chosen scheme
forward and backward. One C++ layer per (heads, head dims, dtype) is made on first use and
kept: its plan cache then serves every layer of a model that shares the module.
"""

import torch

from . import _cpattn
from .attention import (alibi, boundaries, check_same_dtype, check_tensor, dtype_name, make_options,
                        unit_head_dim)


def comm_handle_address(comm):
    """The address of the MPI_Comm handle inside an mpi4py communicator."""
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is the cp extra's dependency
        raise TypeError("comm must be an mpi4py communicator, and mpi4py is not installed") from e
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py MPI.Comm, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm must be a valid communicator, got MPI.COMM_NULL")
    return MPI._addressof(comm)


class _CpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, layer, seed):
        q_, k_, v_ = q.detach(), k.detach().contiguous(), v.detach().contiguous()
        out = q_.new_empty((q.shape[0], q.shape[1], v.shape[2]))
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32)
        ctx.cp = layer.forward(cu_seqlens, q_, k_, v_, out, lse, seed)
        ctx.layer = layer
        ctx.save_for_backward(q_, out)
        ctx.kv_shapes = (k.shape, v.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out = ctx.saved_tensors
        k_shape, v_shape = ctx.kv_shapes
        dq = torch.empty_like(q)
        dk, dv = q.new_empty(k_shape), q.new_empty(v_shape)
        ctx.layer.backward(ctx.cp, q, out, unit_head_dim(dout).detach(), dq, dk, dv)
        return dq, dk, dv, None, None, None


class ContextParallelAttention(torch.nn.Module):
    """Exact context-parallel attention over an mpi4py communicator (every rank calls it).

    forward(q, k, v, cu_seqlens): q [local_tokens, Hq, Dqk], k [local_tokens, Hkv, Dqk], v
    [local_tokens, Hkv, Dv] are this rank's rows in the planner's order
    (get_thd_load_balanced_cp_metadata(cu_seqlens, comm.size, comm.rank), take_local_rows);
    cu_seqlens [documents + 1] int32/int64 are the batch's global real boundaries, the same on
    every rank. Returns out [local_tokens, Hq, Dv] (padding rows 0), differentiable.

    scheme is any name the C++ layer knows ("allgather", "ring", ...), passed through as it is.
    Dropout applies in training mode only, with a seed drawn from rank 0's torch generator.
    check_finite=True makes a NaN or inf in q, k, v or the incoming gradient a ValueError on
    every rank naming the tensor and its first bad element (global token, head, dim) instead
    of a silent NaN (it costs a pass over the tensors). timeout (seconds, > 0) is the deadline
    of each collective; None: the CPATTN_COMM_TIMEOUT_S variable, else 300 s (docs/comm.md). A
    collective past it aborts the MPI job with a line naming the operation and the rank.
    """

    def __init__(self, comm, *, scheme="allgather", causal=True, softmax_scale=None, dropout_p=0.0,
                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=True, check_finite=False,
                 timeout=None):
        super().__init__()
        self.comm = comm
        self._comm_address = comm_handle_address(comm)
        if not isinstance(scheme, str):
            raise TypeError(f"scheme must be a str, got {type(scheme).__name__}")
        self.scheme = scheme
        self.causal, self.softmax_scale, self.dropout_p = causal, softmax_scale, dropout_p
        self.window_size, self.softcap, self.deterministic = window_size, softcap, deterministic
        self.alibi_slopes = alibi(alibi_slopes)
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {type(check_finite).__name__}")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
            timeout = float(timeout)
        self.check_finite, self.timeout = check_finite, timeout
        self._layers = {}   # (Hq, Hkv, Dqk, Dv, dtype, dropout on) -> _cpattn.CpLayer

    def _layer(self, q, k, v, dropout):
        key = (q.shape[1], k.shape[1], q.shape[2], v.shape[2], q.dtype, dropout)
        if key not in self._layers:
            options = make_options(self.causal, self.softmax_scale, self.dropout_p if dropout else 0.0, 0,
                                   self.window_size, self.softcap)
            self._layers[key] = _cpattn.make_cp_layer(
                self._comm_address, q.shape[1], k.shape[1], q.shape[2], v.shape[2], dtype_name(q.dtype),
                self.scheme, options, self.alibi_slopes, bool(self.deterministic), self.check_finite, self.timeout)
        return self._layers[key]

    def forward(self, q, k, v, cu_seqlens):
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t)
            if t.dim() != 3:
                raise ValueError(f"{name} must be [local_tokens, heads, head_dim] (3 dimensions), got {t.dim()}")
        check_same_dtype(q=q, k=k, v=v)
        dropout = self.training and self.dropout_p > 0.0
        seed = self.comm.bcast(int(torch.randint(0, 2**63 - 1, ())), root=0) if dropout else None
        return _CpFunction.apply(q, k, v, boundaries("cu_seqlens", cu_seqlens), self._layer(q, k, v, dropout),
                                 seed)
