"""cpattn against PyTorch's CPU scaled_dot_product_attention on the same shapes, in one run.

For one long document and for a packed batch of documents of varied lengths (PyTorch: the
per-document loop a PyTorch user writes, since its CPU path has no varlen), causal, GQA, fp32
and bf16, forward and backward: the median of --repeats runs of each side, its GFLOP/s (the
FLOP count of the causal pairs, `cpattn bench attention`'s) and the ratio PyTorch time / cpattn
time (> 1: cpattn is faster). cpattn is timed by `cpattn bench attention --json` (which checks
its result against the float64 reference first); PyTorch by this script, its flash kernel
forced (torch.nn.attention.sdpa_kernel(FLASH_ATTENTION)), GQA through enable_gqa.

PyTorch comes from PyPI, in a virtual environment: $CPATTN_TORCH_VENV when set (one that has
torch, reused as it is), else build/torch-peer-venv, made and filled (`pip install torch`) on
the first run. The script re-executes itself under that environment's python.

    CPATTN_TORCH_VENV=/work/pyenv python3 bench/torch_peer.py --cli build/ci/tools/cpattn
    python3 bench/torch_peer.py --seq-len 4096 --heads 16 --kv-heads 4 --repeats 5   # issue 14's shape
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from bench_timing import median_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_torch():
    """Re-executes this script under a python that has torch (see the module docstring)."""
    try:
        import torch  # noqa: F401
        return
    except ImportError:
        pass
    venv = os.environ.get("CPATTN_TORCH_VENV") or os.path.join(ROOT, "build", "torch-peer-venv")
    py = os.path.join(venv, "bin", "python")
    if os.path.realpath(sys.prefix) == os.path.realpath(venv):  # already running under it
        sys.exit(f"torch_peer.py: {py} has no torch")
    if not os.path.exists(py):
        if os.environ.get("CPATTN_TORCH_VENV"):
            sys.exit(f"torch_peer.py: CPATTN_TORCH_VENV={venv} has no bin/python")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    if subprocess.run([py, "-c", "import torch"], capture_output=True).returncode != 0:
        if os.environ.get("CPATTN_TORCH_VENV"):
            sys.exit(f"torch_peer.py: CPATTN_TORCH_VENV={venv} has no torch (pip install torch there)")
        subprocess.run([py, "-m", "pip", "install", "-q", "torch"], check=True)
    os.execv(py, [py, *sys.argv])


def varied_lengths(total, seed=14):
    """Document lengths summing to `total`: mostly short, some long, a 1-token one."""
    rng = random.Random(seed)
    lengths, left = [1], total - 1
    while left > 0:
        n = min(left, int(rng.choice([rng.randint(2, 64), rng.randint(64, 384), rng.randint(384, 1024)])))
        lengths.append(n)
        left -= n
    rng.shuffle(lengths)
    return lengths


def cpattn_seconds(a, lengths, dtype):
    cmd = [a.cli, "bench", "attention", "--lengths", ",".join(map(str, lengths)), "--heads", str(a.heads),
           "--kv-heads", str(a.kv_heads), "--head-dim", str(a.head_dim), "--dtype", dtype, "--mask", "causal",
           "--threads", str(a.threads), "--repeats", str(a.repeats), "--json"]
    j = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return j


def torch_seconds(a, lengths, dtype):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    T = sum(lengths)
    # [1, heads, tokens, head_dim] per document, as a PyTorch user slices a packed batch
    q = torch.randn(1, a.heads, T, a.head_dim, dtype=dt)
    k = torch.randn(1, a.kv_heads, T, a.head_dim, dtype=dt)
    v = torch.randn(1, a.kv_heads, T, a.head_dim, dtype=dt)
    dout = torch.randn(1, a.heads, T, a.head_dim, dtype=dt)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    docs = list(zip(bounds[:-1], bounds[1:]))

    def sdpa(qq, kk, vv):
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=a.heads != a.kv_heads)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        def forward():
            with torch.no_grad():
                for s, e in docs:
                    sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e])

        fwd = median_seconds(forward, a.repeats)
        leaves = [[t[:, :, s:e].clone().requires_grad_() for t in (q, k, v)] for s, e in docs]
        douts = [dout[:, :, s:e] for s, e in docs]
        times = []
        for rep in range(a.repeats + 1):  # the first is the warm-up
            outs = [sdpa(*lv) for lv in leaves]  # the graph, outside the timing
            t0 = time.perf_counter()
            torch.autograd.backward(outs, douts)
            if rep > 0:
                times.append(time.perf_counter() - t0)
            for lv in leaves:
                for t in lv:
                    t.grad = None
        return fwd, statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli", default=os.path.join(ROOT, "build", "ci", "tools", "cpattn"), help="the cpattn command")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens of the long document and of the packed batch")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of the table")
    a = ap.parse_args()
    ensure_torch()
    import torch

    torch.set_num_threads(a.threads)
    batches = {"one document": [a.seq_len], "packed batch": varied_lengths(a.seq_len)}
    print(f"torch {torch.__version__}, {a.threads} thread(s), heads {a.heads}, kv heads {a.kv_heads}, "
          f"head dim {a.head_dim}, causal; packed batch: {len(batches['packed batch'])} documents of "
          f"{min(batches['packed batch'])}..{max(batches['packed batch'])} tokens", flush=True)
    if not a.json:
        print(f"{'batch':14s} {'dtype':5s} {'dir':4s} {'cpattn s':>9s} {'torch s':>9s} {'cpattn GF/s':>11s} "
              f"{'torch GF/s':>10s} {'torch/cpattn':>12s}  path")
    for name, lengths in batches.items():
        for dtype in a.dtypes.split(","):
            c = cpattn_seconds(a, lengths, dtype)
            t_fwd, t_bwd = torch_seconds(a, lengths, dtype)
            for d, cs, ts, flops in (("fwd", c["fwd_seconds"], t_fwd, c["fwd_flops"]),
                                     ("bwd", c["bwd_seconds"], t_bwd, c["bwd_flops"])):
                row = {"batch": name, "dtype": dtype, "direction": d, "cpattn_seconds": cs, "torch_seconds": ts,
                       "cpattn_gflops": flops / cs / 1e9, "torch_gflops": flops / ts / 1e9, "ratio": ts / cs,
                       "kernel_path": c["kernel_path"], "documents": len(lengths), "tokens": sum(lengths)}
                if a.json:
                    print(json.dumps(row), flush=True)
                else:
                    print(f"{name:14s} {dtype:5s} {d:4s} {cs:9.3f} {ts:9.3f} {row['cpattn_gflops']:11.1f} "
                          f"{row['torch_gflops']:10.1f} {row['ratio']:12.2f}  {c['kernel_path']}", flush=True)


if __name__ == "__main__":
    main()
