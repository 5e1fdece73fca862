"""flash_attn_varlen_func against PyTorch's attention per document, finite differences, the
C++ kernels' own output (bitwise), and zero-copy."""

import numpy as np
import pytest
import subprocess
import torch

import cpattn
from conftest import assert_close, cu_from_lengths, sdpa_reference

LENGTHS = [1, 7, 16, 33]  # a 1-token document and odd sizes
HEADS = {  # (Hq, Hkv, Dqk, Dv)
    "mha": (4, 4, 16, 16),
    "gqa": (6, 2, 24, 24),
    "mla": (4, 2, 40, 24),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def batch(lengths, hq, hkv, dqk, dv, dtype, seed=0, lengths_k=None):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths), sum(lengths_k or lengths)
    return [torch.randn(t, h, d, generator=g).to(dtype).requires_grad_()
            for t, h, d in ((tq, hq, dqk), (tk, hkv, dqk), (tk, hkv, dv))]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_forward_backward_against_sdpa(dtype, heads, causal):
    q, k, v = batch(LENGTHS, *HEADS[heads], dtype)
    cu = cu_from_lengths(LENGTHS)
    out = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), causal=causal)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = sdpa_reference(*ref_in, cu, cu, causal)
    rdq, rdk, rdv = torch.autograd.grad(ref, ref_in, dout.double())
    assert out.dtype == dtype and dq.dtype == dtype
    for name, got, want in (("out", out, ref), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert_close(name, got, want, dtype)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cross_attention_bottom_right(causal):
    """q_len != k_len per document: the causal mask is bottom-right aligned, as in FlashAttention."""
    lq, lk = [1, 5, 3], [4, 5, 9]
    q, k, v = batch(lq, 2, 1, 8, 8, torch.float32, lengths_k=lk)
    cu_q, cu_k = cu_from_lengths(lq), cu_from_lengths(lk, torch.int64)
    out = cpattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 9, causal=causal, softmax_scale=0.3)
    assert_close("out", out, sdpa_reference(q, k, v, cu_q, cu_k, causal, scale=0.3), torch.float32)


def test_causal_more_queries_than_keys_and_empty_documents():
    """FlashAttention 2.1+'s rules, which cpattn refused before: causal with more queries than
    keys is bottom-right aligned, so the first q_len - k_len queries see no key (out 0, dq 0), and
    a document empty in both lists (a padded batch's) is taken; against PyTorch's attention."""
    lq, lk = [7, 0, 3], [4, 0, 3]
    q, k, v = batch(lq, 2, 1, 8, 8, torch.float32, lengths_k=lk)
    cu_q, cu_k = cu_from_lengths(lq), cu_from_lengths(lk, torch.int64)
    out = cpattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 4, causal=True)
    want = torch.nan_to_num(sdpa_reference(q, k, v, cu_q, cu_k, True), nan=0.0)  # (rows of no key)
    assert torch.all(out[:3] == 0)
    assert_close("out", out, want, torch.float32)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.all(dq[:3] == 0)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.nan_to_num(sdpa_reference(*ref_in, cu_q, cu_k, True), nan=0.0)
    rdq, rdk, rdv = torch.autograd.grad(ref.sum(), ref_in)
    for name, got, w in (("dq", dq, torch.nan_to_num(rdq)), ("dk", dk, torch.nan_to_num(rdk)),
                         ("dv", dv, torch.nan_to_num(rdv))):
        assert_close(name, got, w, torch.float32)


def test_finite_differences_fp32():
    """The kernels have no float64, so gradcheck's float64 rule cannot apply: central
    differences in fp32 instead. For L = <out, w> and a random direction d of each input,
    (L(x + e d) - L(x - e d)) / 2e must match <dL/dx, d> to 1e-3 relative (e = 1e-2: the
    truncation error is O(e^2) ~ 1e-4 relative, fp32 rounding ~1e-7 / e ~ 1e-5)."""
    lengths = [3, 1, 6]
    q, k, v = batch(lengths, 2, 1, 8, 4, torch.float32)
    cu = cu_from_lengths(lengths)
    w = torch.randn(sum(lengths), 2, 4, generator=torch.Generator().manual_seed(3))

    def loss(q_, k_, v_):
        return (cpattn.flash_attn_varlen_func(q_, k_, v_, cu, cu, 6, 6, causal=True) * w).sum()

    grads = torch.autograd.grad(loss(q, k, v), (q, k, v))
    g = torch.Generator().manual_seed(4)
    eps = 1e-2
    for i, name in enumerate("qkv"):
        d = torch.randn(grads[i].shape, generator=g)
        with torch.no_grad():
            plus = [t + eps * d if j == i else t for j, t in enumerate((q, k, v))]
            minus = [t - eps * d if j == i else t for j, t in enumerate((q, k, v))]
            numeric = float(loss(*plus) - loss(*minus)) / (2 * eps)
        analytic = float((grads[i] * d).sum())
        assert abs(numeric - analytic) <= 1e-3 * abs(analytic), f"d{name}: {numeric} vs {analytic}"


def test_options_reach_the_kernel():
    """softcap, window and ALiBi change the result the way the float64 reference says."""
    lengths = [9, 4]
    q, k, v = batch(lengths, 2, 2, 8, 8, torch.float32)
    cu = cu_from_lengths(lengths)
    slopes = torch.tensor([0.5, 0.25])
    out = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True, window_size=(2, 0), softcap=3.0,
                                        alibi_slopes=slopes)
    qd, kd, vd = (t.detach().double() for t in (q, k, v))
    ref = torch.empty_like(out, dtype=torch.float64)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # naive per document, written out
        pos = torch.arange(b - a)
        s = torch.einsum("qhd,khd->hqk", qd[a:b], kd[a:b]) / 8 ** 0.5
        s = 3.0 * torch.tanh(s / 3.0) - slopes.double()[:, None, None] * (pos[:, None] - pos[None, :]).abs()
        visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - 2)
        ref[a:b] = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, -torch.inf).softmax(-1), vd[a:b])
    assert_close("out", out, ref, torch.float32)


def test_window_and_alibi_with_more_queries_than_keys_are_bottom_right():
    """Cross-attention with q_len > k_len and no causal mask: query i sits at key position
    i + k_len - q_len (FlashAttention's alignment, negative for the first queries), which the
    window and the ALiBi distance read; rows that see no key give 0. Gradients too."""
    lq, lk = [6, 9], [3, 4]
    q, k, v = batch(lq, 2, 2, 8, 8, torch.float32, seed=7, lengths_k=lk)
    cu_q, cu_k = cu_from_lengths(lq), cu_from_lengths(lk)
    slopes = torch.tensor([0.5, 0.25])
    out = cpattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 4, window_size=(2, 1), alibi_slopes=slopes)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    parts = []
    for (a, b), (c, e) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()), zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
        qpos, kpos = torch.arange(b - a) + (e - c) - (b - a), torch.arange(e - c)
        dist = qpos[:, None] - kpos[None, :]
        s = torch.einsum("qhd,khd->hqk", qd[a:b], kd[c:e]) / 8 ** 0.5 - slopes.double()[:, None, None] * dist.abs()
        visible = (dist <= 2) & (dist >= -1)
        seen = visible.any(-1, keepdim=True)
        p = s.masked_fill(~visible, -torch.inf).masked_fill(~seen, 0).softmax(-1) * seen
        parts.append(torch.einsum("hqk,khd->qhd", p, vd[c:e]))
    ref = torch.cat(parts)
    assert_close("out", out, ref, torch.float32)
    for name, g, r in zip(("dq", "dk", "dv"), got, torch.autograd.grad(ref, (qd, kd, vd), dout.double())):
        assert_close(name, g, r, torch.float32)


def test_dropout_is_reproducible_and_differentiable():
    lengths = [8, 5]
    q, k, v = batch(lengths, 2, 2, 8, 8, torch.float32)
    cu = cu_from_lengths(lengths)
    torch.manual_seed(5)
    a = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, dropout_p=0.3, causal=True)
    torch.manual_seed(5)
    b = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, dropout_p=0.3, causal=True)
    plain = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, causal=True)
    assert torch.equal(a, b) and not torch.equal(a, plain)
    a.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_return_attn_probs_gives_flash_attention_lse():
    lengths = [5, 3]
    q, k, v = batch(lengths, 3, 1, 8, 8, torch.float32)
    cu = cu_from_lengths(lengths)
    out, lse, probs = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, return_attn_probs=True)
    assert probs is None and lse.shape == (3, 8)  # FlashAttention's [num_heads, total_q]
    ref = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].double().expand(-1, 3, -1)) / 8 ** 0.5
        ref.append(s.logsumexp(-1))
    assert_close("softmax_lse", lse, torch.cat(ref, 1), torch.float32)


def test_bitwise_equal_to_the_cpp_kernels(cli, tmp_path):
    """`cpattn run --cp 1` (the C++ library's kernels, one process) on the same .npy inputs
    writes out, lse, dq, dk, dv that the Python call reproduces bit for bit."""
    lengths = [1, 13, 6]
    q, k, v = batch(lengths, 4, 2, 16, 16, torch.float32, seed=9)
    cu = cu_from_lengths(lengths)
    dout = torch.randn(q.shape[0], 4, 16, generator=torch.Generator().manual_seed(2))
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout), ("cu_seqlens", cu)):
        np.save(tmp_path / f"{name}.npy", t.detach().numpy())
    subprocess.run([str(cli), "run", "--npy-in", str(tmp_path), "--npy-out", str(tmp_path), "--cp", "1",
                    "--dtype", "fp32", "--mask", "causal", "--threads", "1"], check=True, timeout=60,
                   capture_output=True)
    torch.set_num_threads(1)  # results do not depend on threads; the same call as the CLI's
    out, lse, _ = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 13, 13, causal=True, return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for name, got in (("out", out), ("lse", lse.t()), ("dq", dq), ("dk", dk), ("dv", dv)):
        want = np.load(tmp_path / f"{name}.npy")
        assert np.array_equal(got.detach().numpy(), want), f"{name} differs from the C++ kernels' output"


def test_incoming_gradients_of_any_layout():
    """The gradient of a sum over the tokens is expanded over them (stride 0), of a slice has
    gaps, of a permuted view other strides: each gives the gradients of its contiguous copy."""
    lengths = [3, 6]
    cu = cu_from_lengths(lengths)
    q, k, v = batch(lengths, 4, 2, 8, 8, torch.float32, seed=3)
    for name, loss in (("sum over tokens", lambda o: o.sum(0).pow(2).sum()),
                       ("sum over heads", lambda o: o.sum(1).pow(2).sum()),
                       ("every other dim", lambda o: o[..., ::2].pow(2).sum()),
                       ("mean", lambda o: o.mean())):
        out = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
        got = torch.autograd.grad(loss(out), (q, k, v))
        out2 = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
        dout = torch.autograd.grad(loss(out2), out2, retain_graph=True)[0].contiguous()
        want = torch.autograd.grad(out2, (q, k, v), dout)
        for x, y, t in zip(got, want, "qkv"):
            assert torch.equal(x, y), f"{name}: d{t} differs from the contiguous gradient's"


def test_head_major_inputs_and_gradients_are_taken():
    """q, k, v as transposes of head-major [heads, tokens, head_dim] tensors, and an incoming
    gradient of that layout (a model that keeps heads first): the same results and gradients
    as the contiguous call's, bitwise (they were refused: the kernels' views need each token's
    heads together)."""
    lengths = [3, 6]
    cu = cu_from_lengths(lengths)
    q, k, v = batch(lengths, 4, 2, 8, 8, torch.float32, seed=4)
    hq, hk, hv = (t.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_() for t in (q, k, v))
    assert hq.stride(0) == 8 and not hq.is_contiguous()
    out = cpattn.flash_attn_varlen_func(hq, hk, hv, cu, cu, 6, 6, causal=True)
    want = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
    assert torch.equal(out, want)
    g = torch.randn(4, 9, 8, generator=torch.Generator().manual_seed(6))  # heads first
    got = torch.autograd.grad((out.transpose(0, 1) * g).sum(), (hq, hk, hv))
    ref = torch.autograd.grad(want, (q, k, v), g.transpose(0, 1).contiguous())
    for x, y, t in zip(got, ref, "qkv"):
        assert torch.equal(x, y), f"d{t} differs"


def test_a_head_dim_of_another_stride_is_copied():
    """q, k, v whose head_dim is not unit-stride (every other element of a wider tensor): taken
    as their contiguous copies, as FlashAttention's Python function takes them (they were
    refused), with the gradients reaching the wider tensors' elements."""
    lengths = [3, 6]
    cu = cu_from_lengths(lengths)
    wide = [torch.randn(9, h, 16, generator=torch.Generator().manual_seed(s)).requires_grad_()
            for h, s in ((4, 1), (2, 2), (2, 3))]
    q, k, v = (w[:, :, ::2] for w in wide)
    assert q.stride(2) == 2
    out = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
    cq, ck, cv = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    want = cpattn.flash_attn_varlen_func(cq, ck, cv, cu, cu, 6, 6, causal=True)
    assert torch.equal(out, want)
    out.sum().backward()
    want.sum().backward()
    for w, c, t in zip(wide, (cq, ck, cv), "qkv"):
        assert torch.equal(w.grad[:, :, ::2], c.grad), f"d{t}"
        assert torch.count_nonzero(w.grad[:, :, 1::2]) == 0, f"d{t} off the view"


def test_double_backward_is_refused():
    """The backward is not differentiable: a second-order gradient raises instead of silently
    leaving out the first-order gradients' dependence on the inputs."""
    q, k, v = batch([5], 2, 1, 8, 8, torch.float32)
    cu = cu_from_lengths([5])
    out = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    (g,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate twice"):
        g.pow(2).sum().backward()


def test_boundaries_changed_in_place_before_backward_are_refused():
    """cu_seqlens changed in place between forward and backward: torch's in-place error, not the
    gradients of other documents."""
    q, k, v = batch([3, 5], 2, 1, 8, 8, torch.float32)
    cu = cu_from_lengths([3, 5])
    out = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    cu[1] = 5
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_strided_inputs_are_read_in_place():
    """q, k, v as strided views of one packed qkv buffer (unit head_dim stride): the autograd
    context holds the caller's tensors themselves (same storage, same strides), and the result
    equals the contiguous call's bitwise."""
    lengths = [4, 9]
    t, h, d = sum(lengths), 2, 8
    qkv = torch.randn(t, 3, h, d)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # row stride 3*h*d
    assert not q.is_contiguous()
    cu = cu_from_lengths(lengths)
    leaf = [x.requires_grad_() for x in (q.detach(), k.detach(), v.detach())]
    out = cpattn.flash_attn_varlen_func(*leaf, cu, cu, 9, 9, causal=True)
    saved = out.grad_fn.saved_tensors
    for name, x, s in zip("qkv", (q, k, v), saved):
        assert s.data_ptr() == x.data_ptr() and s.stride() == x.stride(), f"{name} was copied"
    want = cpattn.flash_attn_varlen_func(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 9, 9, causal=True)
    assert torch.equal(out, want)


def test_no_allocation_of_the_inputs_size():
    """torch's CPU allocator, as its profiler records it: a forward allocates out and lse and
    nothing else of note (no copy of q, k or v, each far larger than the slack)."""
    lengths = [64, 64]
    q, k, v = (torch.randn(128, 8, 64) for _ in range(3))
    cu = cu_from_lengths(lengths)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, causal=True)
    # Top-level events only: a nested op's allocation is its parent's too.
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None and e.cpu_memory_usage > 0)
    out_and_lse = out.numel() * 4 + 128 * 8 * 4
    assert out_and_lse <= allocated <= out_and_lse + 4096, f"{allocated} bytes allocated, out + lse = {out_and_lse}"
