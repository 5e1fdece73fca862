"""Shared helpers of the Python package's tests: the independent reference and the tolerances."""

import os
import pathlib

import pytest
import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]

# check/include/cpattn/check/tolerance.hpp, the one table of the C++ tests: fp32 relative L2
# error; fp16/bf16 elementwise atol + rtol |ref| (atol = rtol).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2.5e-2}


def assert_close(name, got, want, dtype):
    """The pass rule of tolerance.hpp for storage dtype `dtype`."""
    got, want = got.detach().double(), want.detach().double()
    tol = TOLERANCE[dtype]
    if dtype == torch.float32:
        err = float((got - want).norm() / want.norm().clamp_min(1e-300))
        assert err <= tol, f"{name}: relative L2 error {err:.3g} > {tol}"
    else:
        excess = float(((got - want).abs() - (tol + tol * want.abs())).max())
        assert excess <= 0, f"{name}: |diff| exceeds {tol} + {tol}|ref| by {excess:.3g}"
        err = float((got - want).norm() / want.norm().clamp_min(1e-300))
        assert err <= tol, f"{name}: relative L2 error {err:.3g} > {tol}"


def sdpa_reference(q, k, v, cu_q, cu_k, causal, scale=None):
    """PyTorch's own attention, document by document, in float64: out [total_q, Hq, Dv].

    Bottom-right aligned under causal (FlashAttention's rule for q_len != k_len): query i of a
    document with q_len queries and k_len keys sees keys 0 .. k_len - q_len + i.
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    outs = []
    for d in range(len(cu_q) - 1):
        qd = q[cu_q[d]:cu_q[d + 1]].transpose(0, 1)
        kd = k[cu_k[d]:cu_k[d + 1]].repeat_interleave(group, 1).transpose(0, 1)
        vd = v[cu_k[d]:cu_k[d + 1]].repeat_interleave(group, 1).transpose(0, 1)
        mask = None
        if causal:
            lq, lk = qd.shape[1], kd.shape[1]
            mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def cu_from_lengths(lengths, dtype=torch.int32):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(dtype)


@pytest.fixture(scope="session")
def cli():
    """The cpattn command line (CPATTN_CLI, or the ci preset's build)."""
    path = pathlib.Path(os.environ.get("CPATTN_CLI", ROOT / "build/ci/tools/cpattn"))
    if not path.exists():
        pytest.fail(f"the cpattn command line is not built at {path} (cmake --build --preset ci --target cpattn_cli, "
                    "or set CPATTN_CLI)")
    return path
