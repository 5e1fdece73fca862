"""The padding-free split against the padded one: padding tokens and visible-pair imbalance
(max/mean over ranks) at every cp in 2..16 (or --cps), from `cpattn plan --json`
(docs/benchmarks.md, "The padding-free split: padding and balance"). Counts, not times: the
figures are exact and the same on every machine.

  python3 bench/split_bench.py build/release/tools/cpattn [--cps 2,4,8,16]

Corpora: short, 821 documents of log-normal lengths (median 18 tokens, seed 15); long, 64
documents of log-normal lengths (median 4096 tokens, seed 16); the training example's, its 14
license files (/usr/share/common-licenses) as documents of bytes + 1 end-of-document token; and
the same stream packed into 128-token sequences as `cpattn train --seq-len 128` cuts it (one
batch of all its segments)."""
import argparse
import json
import math
import os
import random
import subprocess
import tempfile


def cp_list(text):
    try:
        cps = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': comma-separated integers expected")
    if any(c < 1 for c in cps):
        raise argparse.ArgumentTypeError(f"'{text}': every cp must be >= 1")
    return cps


ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("cpattn", help="the cpattn binary")
ap.add_argument("--cps", type=cp_list, default=list(range(2, 17)), help="comma-separated cp values (default 2..16)")
args = ap.parse_args()
CPATTN = args.cpattn
CPS = args.cps


def short_corpus():
    rng = random.Random(15)
    return [max(1, round(math.exp(rng.gauss(math.log(18), 0.9)))) for _ in range(821)]


def long_corpus():
    rng = random.Random(16)
    return [max(1, round(math.exp(rng.gauss(math.log(4096), 0.9)))) for _ in range(64)]


def license_lengths():
    root = "/usr/share/common-licenses"
    files = sorted({os.path.realpath(os.path.join(root, f)) for f in os.listdir(root)})
    return [os.path.getsize(f) + 1 for f in files if os.path.isfile(f) and os.path.getsize(f) > 0]


def packed(lengths, seq_len):
    out, left = [], seq_len
    for n in lengths:
        while n > 0:
            take = min(n, left)
            out.append(take)
            n -= take
            left -= take
            if left == 0:
                left = seq_len
    return out


def plan(lengths, cp):
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(map(str, lengths)))
    try:
        r = subprocess.run([CPATTN, "plan", "--lengths-file", f.name, "--cp", str(cp), "--json"],
                           capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    return {s["split"]: s for s in json.loads(r.stdout)["splits"]}


corpora = [("short (821 docs, median 18)", short_corpus()),
           ("long (64 docs, median 4096)", long_corpus()),
           ("license files (14 docs)", license_lengths()),
           ("license stream in 128-token sequences", packed(license_lengths(), 128))]
print("| corpus | tokens | cp | padded: padding | padded: imbalance | padding-free: padding | "
      "padding-free: imbalance (bound) | lower bound |")
print("|---|---|---|---|---|---|---|---|")
for name, lengths in corpora:
    for cp in CPS:
        s = plan(lengths, cp)
        a, b = s["padded"], s["padding-free"]
        print(f"| {name} | {sum(lengths)} | {cp} | {a['padding_tokens']} ({a['padding_percent']:.1f}%) | "
              f"{a['imbalance']:.4f} | {b['padding_tokens']} | {b['imbalance']:.4f} ({b['imbalance_bound']:.4f}) | "
              f"{b['imbalance_lower_bound']:.4f} |")
