"""Every bad argument: a ValueError or TypeError naming the argument and the rule, never a crash."""

import re

import numpy as np
import pytest
import torch

import cpattn

CU = torch.tensor([0, 3, 8], dtype=torch.int32)


def qkv(dtype=torch.float32, t=8, hq=4, hkv=2, d=8):
    return torch.randn(t, hq, d).to(dtype), torch.randn(t, hkv, d).to(dtype), torch.randn(t, hkv, d).to(dtype)


def call(q=None, k=None, v=None, cu_q=CU, cu_k=CU, max_q=5, max_k=5, **kw):
    dq, dk, dv = qkv()
    return cpattn.flash_attn_varlen_func(dq if q is None else q, dk if k is None else k, dv if v is None else v,
                                         cu_q, cu_k, max_q, max_k, **kw)


q, k, v = qkv()
CASES = [  # (arguments, exception, words the message must hold)
    (dict(q=q.to(torch.int32)), TypeError, ["q", "float32, float16 or bfloat16"]),
    (dict(q=q.double()), TypeError, ["q", "float32, float16 or bfloat16"]),
    (dict(k=k.half()), TypeError, ["k", "dtype"]),
    (dict(q=q.numpy()), TypeError, ["q", "torch.Tensor"]),
    (dict(v=torch.empty(8, 2, 8, device="meta")), ValueError, ["v", "CPU"]),
    (dict(q=q.reshape(8, 32)), ValueError, ["q", "3 dimensions"]),
    (dict(v=torch.randn(8, 16)), ValueError, ["v", "3 dimensions"]),
    (dict(max_q=None), TypeError, ["max_seqlen_q", "int"]),
    (dict(max_k=5.0), TypeError, ["max_seqlen_k", "int"]),
    (dict(k=torch.randn(8, 2, 16)), ValueError, ["k", "dim"]),
    (dict(k=torch.randn(7, 2, 8), v=torch.randn(7, 2, 8)), ValueError, ["cu_seqlens_k[-1]", "k.shape[0]"]),
    (dict(q=torch.randn(8, 3, 8)), ValueError, ["num_heads"]),
    (dict(v=torch.randn(8, 3, 8)), ValueError, ["v", "heads"]),
    (dict(cu_q=torch.tensor([0, 3, 9], dtype=torch.int32)), ValueError, ["cu_seqlens_q[-1]", "q.shape[0]"]),
    # a document empty in one list only (empty in both is taken, as FlashAttention takes it)
    (dict(cu_q=torch.tensor([0, 3, 3, 8]), cu_k=torch.tensor([0, 2, 3, 8])), ValueError,
     ["document 1 has q_len 0 and kv_len 1", "empty on both sides or on neither"]),
    (dict(cu_q=torch.tensor([0, 8], dtype=torch.int32), max_q=8), ValueError, ["cu_seqlens_q has 2 entries"]),
    (dict(cu_q=torch.tensor([1, 3, 8], dtype=torch.int32)), ValueError, ["cu_seqlens_q", "0"]),
    (dict(cu_q=CU.float()), TypeError, ["cu_seqlens_q", "int32 or int64"]),
    (dict(cu_k=[0, 3, 8]), TypeError, ["cu_seqlens_k", "torch.Tensor"]),
    (dict(cu_q=CU.reshape(1, 3)), ValueError, ["cu_seqlens_q", "1-D"]),
    (dict(max_q=4), ValueError, ["max_seqlen_q", "longest document"]),
    (dict(max_k=2), ValueError, ["max_seqlen_k", "longest document"]),
    (dict(dropout_p=1.0), ValueError, ["dropout"]),
    (dict(window_size=(-2, 0)), ValueError, ["window"]),
    (dict(window_size=3), ValueError, ["window_size", "pair"]),
    (dict(softcap=-1.0), ValueError, ["softcap"]),
    (dict(softmax_scale=float("nan")), ValueError, ["softmax_scale"]),
    (dict(alibi_slopes=torch.ones(2, 4)), ValueError, ["alibi_slopes", "num_heads_q"]),
    (dict(alibi_slopes=torch.ones(3)), ValueError, ["alibi_slopes", "[4]"]),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, ["alibi_slopes", "float32"]),
    (dict(alibi_slopes=torch.ones(4, device="meta")), ValueError, ["alibi_slopes", "CPU"]),
    (dict(softmax_scale="x"), TypeError, ["softmax_scale", "number", "str"]),
    (dict(softcap=None), TypeError, ["softcap", "number"]),
    (dict(dropout_p=None), TypeError, ["dropout_p", "number"]),
    (dict(window_size=("a", 1)), TypeError, ["window_size[0]", "int"]),
    (dict(window_size=(2.7, 0)), TypeError, ["window_size[0]", "int", "float"]),  # (was: truncated to 2)
    (dict(window_size=(0, True)), TypeError, ["window_size[1]", "bool"]),
    (dict(window_size=(2**70, 0)), ValueError, ["window_size[0]", "int64"]),
    (dict(max_q=2**70), ValueError, ["max_seqlen_q", "int64"]),
    (dict(q=torch.randn(8, 0, 8)), ValueError, ["q", "at least one head"]),
    (dict(k=torch.randn(8, 2, 0), q=torch.randn(8, 4, 0), v=torch.randn(8, 2, 8)), ValueError, ["q", "head_dim >= 1"]),
    (dict(q=torch.randn(8, 4, 8).to_sparse()), TypeError, ["q", "dense"]),
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), ValueError, ["block_table", "not supported"]),
]


@pytest.mark.parametrize("kwargs, error, words", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_argument(kwargs, error, words):
    with pytest.raises(error) as info:
        call(**kwargs)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


def test_bad_planner_arguments():
    with pytest.raises(ValueError, match="rank must be in"):
        cpattn.get_thd_load_balanced_cp_metadata([0, 4], 2, 2)
    with pytest.raises(TypeError, match="cp_size must be an int"):
        cpattn.get_thd_load_balanced_cp_metadata([0, 4], 2.0, 0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        cpattn.get_thd_load_balanced_cp_metadata([0, 4, 2], 2, 0)
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        cpattn.get_thd_load_balanced_cp_metadata([0.0, 4.5], 2, 0)
    with pytest.raises(ValueError, match="batch must have the key 'loss_mask'"):
        cpattn.get_batch_on_this_cp_rank({"tokens": [1], "labels": [1], "position_ids": [0]}, [0, 1], 1, 0)
    with pytest.raises(ValueError, match="global_tokens"):
        cpattn.take_local_rows(torch.zeros(5), cpattn.get_thd_load_balanced_cp_metadata([0, 4], 1, 0))
    plan = cpattn.get_thd_load_balanced_cp_metadata([0, 4], 1, 0)
    for call, error, words in (
            (lambda: cpattn.get_thd_load_balanced_cp_metadata([0, 4], 0, 0), ValueError, "cp_size must be in 1..65536, got 0"),
            (lambda: cpattn.get_thd_load_balanced_cp_metadata([0, 4], -1, 0), ValueError, "cp_size must be in 1..65536"),
            # (past int: nanobind's "incompatible function arguments", naming no argument)
            (lambda: cpattn.get_thd_load_balanced_cp_metadata([0, 4], 2**40, 0), ValueError,
             "cp_size must be in 1..65536, got 1099511627776"),
            (lambda: cpattn.get_thd_load_balanced_cp_metadata(np.array([0, 2**63], dtype=np.uint64), 1, 0),
             ValueError, "cu_seqlens must fit in int64"),
            (lambda: cpattn.take_local_rows(np.zeros(4), plan), TypeError, "x must be a torch.Tensor"),
            (lambda: cpattn.take_local_rows(torch.tensor(1.0), plan), ValueError, "0-d"),
            (lambda: cpattn.put_local_rows(torch.zeros(4), plan, out=torch.zeros(3)), ValueError,
             "out.shape[0] must equal the plan's global_tokens = 4, got 3"),
            (lambda: cpattn.get_batch_on_this_cp_rank({"tokens": [1.5, 2.0], "labels": [1, 2], "position_ids": [0, 1],
                                                       "loss_mask": [1.0, 1.0]}, [0, 2], 1, 0),
             TypeError, "batch['tokens'] must hold integers"),
            # pad_token_id 1.7 was truncated to 1 and "7" read as 7; uint64 tokens past int64 wrapped
            (lambda: cpattn.get_batch_on_this_cp_rank({"tokens": [1, 2], "labels": [1, 2], "position_ids": [0, 1],
                                                       "loss_mask": [1.0, 1.0]}, [0, 2], 1, 0, pad_token_id=1.7),
             TypeError, "pad_token_id must be an int, got float"),
            (lambda: cpattn.get_batch_on_this_cp_rank({"tokens": [1, 2], "labels": [1, 2], "position_ids": [0, 1],
                                                       "loss_mask": [1.0, 1.0]}, [0, 2], 1, 0, pad_token_id="7"),
             TypeError, "pad_token_id must be an int, got str"),
            (lambda: cpattn.get_batch_on_this_cp_rank({"tokens": np.array([1, 2**63], dtype=np.uint64), "labels": [1, 2],
                                                       "position_ids": [0, 1], "loss_mask": [1.0, 1.0]}, [0, 2], 1, 0),
             ValueError, "batch['tokens'] must fit in int64, got 9223372036854775808")):
        with pytest.raises(error, match=re.escape(words)):
            call()


def test_bad_cp_arguments():
    from mpi4py import MPI
    with pytest.raises(TypeError, match="comm must be an mpi4py MPI.Comm"):
        cpattn.ContextParallelAttention(object())
    # The scheme's arguments fail at construction, before any communication (cp = 1 here; the
    # same on every rank at 2 and 3 ranks: cp_script.py).
    for kwargs, error, words in (
            (dict(scheme="no-such-scheme"), ValueError, "scheme must be one of allgather, ring, pass-q, a2a, hybrid"),
            (dict(scheme=3), TypeError, "scheme must be a str"),
            (dict(scheme="hybrid"), ValueError, "cp_inner is required for scheme 'hybrid'"),
            (dict(scheme="hybrid", cp_inner=2), ValueError, "cp_inner = 2 must divide cp = 1"),
            (dict(scheme="hybrid", cp_inner=1.0), TypeError, "cp_inner must be an int"),
            (dict(scheme="ring", cp_inner=1), ValueError, "cp_inner is the hybrid scheme's"),
            (dict(scheme="hybrid", cp_inner=1, hybrid_outer="pass-q"), ValueError, "hybrid_outer must be allgather or ring"),
            (dict(scheme="hybrid", cp_inner=1, hybrid_outer="x"), ValueError, "hybrid_outer must be one of"),
            (dict(split="padding_free", scheme="pass-q"), ValueError, "scheme pass-q takes only the padded split"),
            (dict(split="none"), ValueError, "split must be one of padded, padding-free"),
            (dict(kv_mode="copy"), ValueError, "kv_mode must be one of runs, index"),
            (dict(scheme="ring", kv_mode="index"), ValueError, "kv_mode index is the all-gather scheme's"),
            (dict(plan_cache_capacity=-1), ValueError, "plan_cache_capacity must be in 1..4096, got -1"),
            # (0 passed the constructor and failed every forward under the C++ name)
            (dict(plan_cache_capacity=0), ValueError, "plan_cache_capacity must be in 1..4096, got 0"),
            (dict(plan_cache_capacity=None), TypeError, "plan_cache_capacity must be an int, got NoneType"),
            (dict(scheme="hybrid", cp_inner=np.int64(2)), ValueError, "cp_inner = 2 must divide cp = 1"),
            (dict(window_size=(1.5, 0)), TypeError, "window_size[0] must be an int"),
            (dict(softcap="x"), TypeError, "softcap must be a number")):
        with pytest.raises(error, match=re.escape(words)):
            cpattn.ContextParallelAttention(MPI.COMM_WORLD, **kwargs)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        cpattn.ContextParallelAttention(torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1))
    attn = cpattn.ContextParallelAttention(MPI.COMM_WORLD)
    with pytest.raises(ValueError, match="q must be \\[local_tokens"):
        attn(torch.zeros(8, 32), *qkv()[1:], CU)
    with pytest.raises(ValueError, match="q must be \\[local_tokens = 8"):  # the plan holds 8 tokens
        attn(*qkv(t=7), CU)


def test_cp_check_finite_and_timeout():
    from mpi4py import MPI
    q, k, v = qkv()
    q[6, 1, 5] = float("nan")  # global token 6 (document 1), head 1, dim 5
    # Off (the default): the NaN passes through as the kernels make of it.
    cpattn.ContextParallelAttention(MPI.COMM_WORLD)(q, k, v, CU)
    attn = cpattn.ContextParallelAttention(MPI.COMM_WORLD, check_finite=True, timeout=30)
    with pytest.raises(ValueError, match="q holds nan at token 6, head 1, dim 5"):
        attn(q, k, v, CU)
    q[6, 1, 5] = 0.0
    out = attn(q.requires_grad_(), k, v, CU)  # finite: runs, and its backward checks the gradient
    dout = torch.zeros_like(out)
    dout[2, 3, 0] = float("inf")
    with pytest.raises(ValueError, match="dout holds inf at token 2, head 3, dim 0"):
        out.backward(dout)
    with pytest.raises(TypeError, match="timeout must be a number of seconds or None"):
        cpattn.ContextParallelAttention(MPI.COMM_WORLD, timeout="5")
    with pytest.raises(ValueError, match="timeout must be in \\(0, 1e\\+07\\] seconds, got -1"):
        cpattn.ContextParallelAttention(MPI.COMM_WORLD, timeout=-1)(*qkv(), CU)


def test_cp_module_construction_arguments_are_fixed():
    """scheme, split, check_finite and the other construction arguments: assigning one later
    raises, naming it (it was silently kept: check_finite = True let a NaN through)."""
    from mpi4py import MPI
    attn = cpattn.ContextParallelAttention(MPI.COMM_WORLD)
    for name, value in (("check_finite", True), ("scheme", "ring"), ("split", "padding-free"),
                        ("plan_cache_capacity", 2), ("deterministic", False), ("overlap", False)):
        with pytest.raises(AttributeError, match=f"{name} is fixed when a ContextParallelAttention is made"):
            setattr(attn, name, value)
    attn.causal = False  # the attention options stay settable
    assert attn.causal is False and attn.scheme == "allgather"


def test_cp_module_options_follow_its_attributes_and_a_second_backward_raises():
    """Options set on the module after its first call take effect (they were cached with the
    first call's layer); a second backward through one forward is a clear RuntimeError."""
    from mpi4py import MPI
    q, k, v = (t.requires_grad_() for t in qkv())
    attn = cpattn.ContextParallelAttention(MPI.COMM_WORLD)
    causal = attn(q, k, v, CU)
    attn.causal, attn.window_size = False, (1, 1)
    windowed = attn(q, k, v, CU)
    want = cpattn.flash_attn_varlen_func(q, k, v, CU, CU, 5, 5, causal=False, window_size=(1, 1))
    assert (windowed - want).abs().max() <= 1e-5 * want.abs().max()
    assert (windowed - causal).abs().max() > 1e-2
    for cap in range(1, 12):  # options changing every call: the module keeps 8 layers, not 11
        attn.softcap = float(cap)
        attn(q, k, v, CU)
    assert len(attn._layers) == 8
    attn.softmax_scale = [1.0]
    with pytest.raises(TypeError, match="softmax_scale must be a number"):
        attn(q, k, v, CU)
    attn.softmax_scale, attn.softcap = None, 0.0
    out = attn(q, k, v, CU)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the same forward"):
        out.sum().backward()
