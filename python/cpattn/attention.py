"""flash_attn_varlen_func: FlashAttention 2's varlen call on CPU tensors (docs/python.md).

The tensors' memory is read and written in place: q, k, v (THD, unit head_dim stride) go to
the kernels as they are, and out, softmax_lse and the gradients are allocated here and filled
by the kernels. The forward saves what the backward needs (q, k, v, out, lse, as FlashAttention
does, and the boundaries and slopes the backward reads again).
"""

import operator

import torch

from . import _cpattn

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def check_tensor(name, t):
    """TypeError/ValueError naming `name` unless `t` is a CPU tensor cpattn can store."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor (cpattn runs on the CPU), got device {t.device}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_thd(name, t, what="tokens"):
    """ValueError naming `name` unless `t` is [tokens, heads >= 1, head_dim >= 1]."""
    if t.dim() != 3:
        raise ValueError(f"{name} must be [{what}, heads, head_dim] (3 dimensions), got {t.dim()}")
    if t.shape[1] < 1 or t.shape[2] < 1:
        raise ValueError(f"{name} must have at least one head and head_dim >= 1, got shape {list(t.shape)}")


def check_same_dtype(**tensors):
    (first, t0), *rest = tensors.items()
    for name, t in rest:
        if t.dtype != t0.dtype:
            raise TypeError(f"{name} must have {first}'s dtype {t0.dtype}, got {t.dtype}")


def dtype_name(dtype):
    return _DTYPES[dtype]


def boundaries(name, cu):
    """cu_seqlens as the binding takes them: a CPU int32/int64 tensor, 1-D contiguous."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 or int64, got {type(cu).__name__}")
    if cu.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {cu.device}")
    return cu.detach()


def integer(name, x):
    """x as an int (a Python or NumPy int, or a one-element integer tensor; not a float or a
    bool), within int64 (ValueError past it): TypeError naming `name` otherwise."""
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        x = operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(x).__name__}") from None
    if not -2**63 <= x < 2**63:
        raise ValueError(f"{name} must fit in int64, got {x}")
    return x


def number(name, x):
    """x as a float (an int or float, a NumPy scalar or one-element tensor; not a bool or a
    str): TypeError naming `name` otherwise."""
    if isinstance(x, (bool, str, bytes)) or x is None:
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}") from None


def unit_head_dim(t):
    """t itself when the kernels read it in place (unit head_dim stride, and heads and tokens
    apart as the kernels' views need: head stride >= head_dim, token stride >= the last head's
    end), else a contiguous copy: an incoming gradient may be neither (the gradient of a sum
    over the tokens is expanded over them, stride 0; a head-major tensor's transpose has its
    tokens inside its heads)."""
    if t.dim() != 3:
        return t
    tokens, heads, dim = t.shape
    head_step = t.stride(1) if heads > 1 else dim
    in_place = ((t.stride(2) == 1 or dim == 1) and (heads <= 1 or t.stride(1) >= dim)
                and (tokens <= 1 or t.stride(0) >= head_step * (heads - 1) + dim))
    return t if in_place else t.contiguous()


def in_place_or_copy(t):
    """An input q, k or v as the kernels take it: t itself (unit head_dim stride, heads and
    tokens apart), else a contiguous copy that autograd sees (a head-major tensor's transpose,
    a broadcast, a head_dim of another stride: FlashAttention's Python function copies such
    a tensor too; its last-dimension rule is its C++ entry point's)."""
    return unit_head_dim(t)


def option_values(causal, softmax_scale, dropout_p, window_size, softcap):
    """The attention options as plain values (bool, float or None, float, int, int, float),
    each checked for its type naming its argument (the ranges are the kernels' rules)."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = (integer(f"window_size[{i}]", w) for i, w in enumerate(window_size))
    return (bool(causal), None if softmax_scale is None else number("softmax_scale", softmax_scale),
            number("dropout_p", dropout_p), left, right, number("softcap", softcap))


def make_options(causal, softmax_scale, dropout_p, seed, window_size, softcap):
    return options_of(option_values(causal, softmax_scale, dropout_p, window_size, softcap), seed)


def options_of(values, seed):
    """The kernels' options from option_values' checked tuple and a dropout seed."""
    causal, scale, dropout_p, left, right, softcap = values
    return _cpattn.make_options(causal=causal, softmax_scale=scale, dropout_p=dropout_p, seed=int(seed),
                                window_left=left, window_right=right, softcap=softcap,
                                num_threads=torch.get_num_threads())


def alibi(alibi_slopes):
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a CPU torch.Tensor of float32 [num_heads_q], got "
                        f"{type(alibi_slopes).__name__}")
    if alibi_slopes.device.type != "cpu":
        raise ValueError(f"alibi_slopes must be a CPU tensor, got device {alibi_slopes.device}")
    if alibi_slopes.dim() != 1:
        raise ValueError("alibi_slopes must be [num_heads_q] (one slope per query head, the same for every "
                         f"document), got shape {list(alibi_slopes.shape)}")
    return alibi_slopes.detach()


def dropout_seed(dropout_p):
    """A seed from torch's generator, so that torch.manual_seed makes dropout reproducible."""
    if dropout_p == 0.0:
        return 0
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, slopes):
        q_, k_, v_ = q.detach(), k.detach(), v.detach()
        out = q_.new_empty((q.shape[0], q.shape[1], v.shape[2]))
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32)
        _cpattn.forward(q_, k_, v_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, slopes, out, lse)
        # The boundaries and slopes too, so that changing them in place before the backward is
        # torch's error, not gradients of other documents.
        ctx.save_for_backward(q_, k_, v_, out, lse, cu_seqlens_q, cu_seqlens_k,
                              *([] if slopes is None else [slopes]))
        ctx.call = (max_seqlen_q, max_seqlen_k, options)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k, *slopes = ctx.saved_tensors
        slopes = slopes[0] if slopes else None
        max_q, max_k, options = ctx.call
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _cpattn.backward(q, k, v, cu_q, cu_k, max_q, max_k, options, slopes, out, lse,
                         unit_head_dim(dout).detach(), dq, dk, dv)
        return dq, dk, dv, None, None, None, None, None, None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """FlashAttention 2's flash_attn_varlen_func on CPU tensors.

    q: [total_q, num_heads_q, head_dim_qk], k: [total_k, num_heads_k, head_dim_qk],
    v: [total_k, num_heads_k, head_dim_v], one dtype (float32, float16 or bfloat16), unit
    head_dim stride; cu_seqlens_q/k: int32 or int64 [batch + 1]. Returns out
    [total_q, num_heads_q, head_dim_v]; with return_attn_probs, (out, softmax_lse, None):
    softmax_lse is FlashAttention's [num_heads_q, total_q] float32 (a transposed view), and the
    attention probabilities are not materialized (None). deterministic is accepted and has no
    effect: the kernels are always deterministic. Dropout draws its seed from torch's
    generator (torch.manual_seed reproduces it). block_table (FlashAttention's paged KV cache)
    must be None: a ValueError otherwise.
    """
    if block_table is not None:
        raise ValueError("block_table (a paged KV cache) is not supported: pass k and v as [total_k, num_heads_k, "
                         "head_dim] tensors and block_table=None")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        check_thd(name, t)
    check_same_dtype(q=q, k=k, v=v)
    q, k, v = (in_place_or_copy(t) for t in (q, k, v))
    dropout_p = number("dropout_p", dropout_p)  # (before the seed is drawn from torch's generator)
    options = make_options(causal, softmax_scale, dropout_p, dropout_seed(dropout_p), window_size, softcap)
    out, lse = _VarlenAttention.apply(q, k, v, boundaries("cu_seqlens_q", cu_seqlens_q),
                                      boundaries("cu_seqlens_k", cu_seqlens_k), integer("max_seqlen_q", max_seqlen_q),
                                      integer("max_seqlen_k", max_seqlen_k), options, alibi(alibi_slopes))
    return (out, lse.t(), None) if return_attn_probs else out
