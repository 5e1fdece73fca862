"""The Python package's overhead over the C++ kernel (docs/benchmarks.md).

For a small and a large batch, in one run: the C++ kernel timed by `cpattn bench attention`
(the baseline), the binding's raw call (_cpattn.forward into preallocated out/lse) and
cpattn.flash_attn_varlen_func forward, and forward + backward through torch.autograd; medians
of --repeats runs, one thread.

    python bench/python_overhead.py --cli build/ci/tools/cpattn
"""

import argparse
import json
import subprocess

import torch

import cpattn
from bench_timing import median_seconds
from cpattn import _cpattn

CASES = {"small": ([16, 16], 2, 32), "large": ([1024, 768, 256], 8, 64)}  # lengths, heads, head_dim


def cpp_seconds(cli, lengths, heads, dim, repeats):
    out = subprocess.run([cli, "bench", "attention", "--lengths", ",".join(map(str, lengths)), "--heads", str(heads),
                          "--kv-heads", str(heads), "--head-dim", str(dim), "--threads", "1", "--dtype", "fp32",
                          "--mask", "causal", "--repeats", str(repeats), "--json"],
                         check=True, capture_output=True, text=True).stdout
    j = json.loads(out)
    return j["fwd_seconds"], j["bwd_seconds"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cli", default="build/ci/tools/cpattn")
    p.add_argument("--repeats", type=int, default=0, help="timed runs (default: 200 small, 5 large)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'case':6} {'C++ fwd':>10} {'raw call':>10} {'flash fwd':>10} {'added':>9} "
          f"{'C++ f+b':>10} {'flash f+b':>10} {'added':>9}")
    for name, (lengths, heads, dim) in CASES.items():
        repeats = args.repeats or (200 if name == "small" else 5)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        t, m = int(cu[-1]), max(lengths)
        q, k, v = (torch.randn(t, heads, dim, requires_grad=True) for _ in range(3))
        out, lse = torch.empty(t, heads, dim), torch.empty(t, heads)
        options = _cpattn.make_options(True, None, 0.0, 0, -1, -1, 0.0, 1)
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        raw = median_seconds(lambda: _cpattn.forward(qd, kd, vd, cu, cu, m, m, options, None, out, lse), repeats)
        with torch.no_grad():
            fwd = median_seconds(lambda: cpattn.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True), repeats)

        def fwd_bwd():
            o = cpattn.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True)
            torch.autograd.grad(o, (q, k, v), torch.ones_like(o))

        both = median_seconds(fwd_bwd, repeats)
        cf, cb = cpp_seconds(args.cli, lengths, heads, dim, repeats)
        us = 1e6
        print(f"{name:6} {cf * us:9.1f}u {raw * us:9.1f}u {fwd * us:9.1f}u {(fwd - cf) * us:8.1f}u "
              f"{(cf + cb) * us:9.1f}u {both * us:9.1f}u {(both - cf - cb) * us:8.1f}u   "
              f"ratios fwd {fwd / cf:.3f}, f+b {both / (cf + cb):.3f}")


if __name__ == "__main__":
    main()
