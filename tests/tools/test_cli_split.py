"""`--split padded|padding-free` end to end (docs/planner.md): `cpattn plan` shows both splits
side by side and draws them (--svg), `cpattn run --split padding-free` passes its own check
against a single process at 2 and 3 ranks, `cpattn train --cp 2 --split padding-free` gives
CP=1's losses (fp32, 1e-5 relative), and bad values exit 2 naming --split."""
import json
import os
import re
import sys
import tempfile
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/cli_lib.py
from cli_lib import check, finish, job


with tempfile.TemporaryDirectory() as tmp:
    p = lambda name: os.path.join(tmp, name)

    # plan: docs/planner.md's example [0, 5, 10] at cp = 2, by hand: the padded split pads both
    # documents to 8 (6 padding tokens), the padding-free split none, with 15 pairs per rank.
    r = job(0, "plan", "--lengths", "5,5", "--cp", "2", "--split", "padding-free", "--json")
    check(r.returncode == 0, f"plan json: {r.stderr}")
    if r.returncode == 0:
        j = json.loads(r.stdout)
        check(j["split"] == "padding-free" and j["padding_tokens"] == 0, "padding-free split, no padding")
        check([x["visible_pairs"] for x in j["ranks"]] == [15, 15], "15 pairs per rank")
        check(j["ranks"][0]["global_token_index"] == [0, 1, 4, 7, 8], "rank 0's tokens")
        check(j["ranks"][1]["global_token_index"] == [2, 3, 5, 6, 9], "rank 1's tokens")
        splits = {s["split"]: s for s in j["splits"]}
        check(splits["padded"]["padding_tokens"] == 6 and splits["padding-free"]["padding_tokens"] == 0,
              "both splits' padding side by side")
        check(splits["padding-free"]["imbalance"] == 1.0, "balanced exactly")
        check(abs(splits["padding-free"]["imbalance_bound"] - (1 + 1 / 30)) < 1e-12, "bound 1 + spread/pairs")
    # The table names both; the SVG is well-formed and holds one rectangle per non-empty chunk.
    r = job(0, "plan", "--lengths", "5,1,30", "--cp", "3", "--split", "padding_free", "--svg", p("plan.svg"))
    check(r.returncode == 0 and "padding-free" in r.stdout and "padded " in r.stdout,
          f"plan table: {r.returncode}\n{r.stdout}\n{r.stderr}")
    if os.path.exists(p("plan.svg")):
        rects = [e for e in ET.parse(p("plan.svg")).iter("{http://www.w3.org/2000/svg}rect") if e.find(
            "{http://www.w3.org/2000/svg}title") is not None]
        # 5 tokens in 6 chunks (5 of 1), 1 token (1 chunk), 30 tokens (6 of 5): 12 chunks.
        check(len(rects) == 12, f"svg chunks: {len(rects)}")
    else:
        check(False, "--svg wrote no file")
    # The padded split drawn: every document in 2 cp = 6 chunks, chunk c on rank c or 2 cp - 1 - c,
    # the padding marked (5 -> 6 tokens: its last chunk; 1 -> 6: its last five; 30: none).
    r = job(0, "plan", "--lengths", "5,1,30", "--cp", "3", "--split", "padded", "--svg", p("padded.svg"))
    check(r.returncode == 0 and os.path.exists(p("padded.svg")), f"padded --svg: {r.returncode}\n{r.stderr}")
    if os.path.exists(p("padded.svg")):
        titles = [t.text for t in ET.parse(p("padded.svg")).iter("{http://www.w3.org/2000/svg}title")]
        chunks = [re.match(r"document (\d+) chunk (\d+): rank (\d+), positions (\d+)\.\.(\d+)( \(padding\))?$", t)
                  for t in titles if t and t.startswith("document ")]
        check(len(chunks) == 18 and all(chunks), f"padded svg chunks: {titles}")
        if len(chunks) == 18 and all(chunks):
            # chunk c of a document padded to 6 s tokens holds positions c s .. c s + s - 1
            got = [(int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5]), m[6] is not None) for m in chunks]
            want = [(d, c, c if c < 3 else 5 - c, c * s, c * s + s - 1, (d == 0 and c == 5) or (d == 1 and c >= 1))
                    for d, s in enumerate((1, 1, 5)) for c in range(6)]
            check(got == want, f"padded svg: chunk ranks or padding {got}")
    r = job(0, "plan", "--split", "nopad")
    check(r.returncode == 2 and "--split" in r.stderr and "padding-free" in r.stderr, f"bad --split: {r.stderr}")
    r = job(0, "plan", "--svg", p("missing/dir/x.svg"))
    check(r.returncode == 2 and "--svg" in r.stderr, f"--svg into a missing folder: {r.stderr}")

    # run: the distributed run checks itself against a single process (exit 1 when it fails).
    for np_ in (2, 3):
        r = job(np_, "run", "--split", "padding-free", "--lengths", "37,1,100,2,23", "--heads", "4",
                "--kv-heads", "2", "--head-dim", "32", "--json")
        check(r.returncode == 0, f"run np {np_}: exit {r.returncode}\n{r.stderr[-1500:]}")
        if r.returncode == 0:
            j = json.loads(r.stdout)
            check(j["split"] == "padding-free" and j["padded_tokens"] == 163, f"run np {np_} report")
    # A 1-token document: every rank but one holds no token (empty views, null data) and takes part.
    for np_ in (2, 3):
        r = job(np_, "run", "--split", "padding-free", "--lengths", "1", "--heads", "2", "--kv-heads", "1",
                "--head-dim", "16")
        check(r.returncode == 0 and "PASS" in r.stdout, f"run np {np_}, one token: exit {r.returncode}\n{r.stderr[-1500:]}")
    r = job(2, "run", "--split", "padding-free", "--scheme", "ring", "--lengths", "9,9")
    check(r.returncode == 2 and r.stderr.count("padding-free split needs scheme allgather") >= 1,
          f"ring refuses the padding-free split: {r.returncode} {r.stderr[-800:]}")

    # train: CP=2 with the padding-free split on the training example's data is CP=1's curve.
    small = ["train", "--layers", "1", "--dim", "32", "--heads", "4", "--kv-heads", "2", "--seq-len", "130",
             "--warmup", "2", "--steps", "4"]
    r1 = job(0, *small, "--json-log", p("cp1.jsonl"))
    r2 = job(2, *small, "--cp", "2", "--split", "padding-free", "--json-log", p("cp2.jsonl"))
    r3 = job(2, *small, "--cp", "2", "--split", "padded", "--json-log", p("cp2_padded.jsonl"))
    check(r1.returncode == 0 and r2.returncode == 0 and r3.returncode == 0,
          f"train: {r1.returncode} {r2.returncode} {r3.returncode}\n{r2.stderr[-1500:]}\n{r3.stderr[-1500:]}")
    if r1.returncode == 0 and r2.returncode == 0 and r3.returncode == 0:
        load = lambda f: [json.loads(line) for line in open(f) if line.strip()]
        a, b, c = load(p("cp1.jsonl")), load(p("cp2.jsonl")), load(p("cp2_padded.jsonl"))
        check(len(a) == 4 and len(b) == 4 and len(c) == 4, "one log line per step")
        for x, y, z in zip(a, b, c):  # CP = 1, CP = 2 padding-free, CP = 2 padded: one curve
            for w in (y, z):
                check(abs(x["loss"] - w["loss"]) <= 1e-5 * x["loss"], f"step {x['step']}: {x['loss']} vs {w['loss']}")
                check(abs(x["grad_norm"] - w["grad_norm"]) <= 1e-5 * x["grad_norm"], f"grad norm step {x['step']}")
        # The split reached the planner: padding-free, the ranks' rows are the sequence's 130
        # tokens (split over both); padded, each document is rounded up to a multiple of 2 cp = 4,
        # so the step's 130 tokens take at least 132 rows.
        check([x["local_tokens_per_rank"] for x in a] == [[130]] * 4, f"cp1 rows: {[x['local_tokens_per_rank'] for x in a]}")
        free, padded = [sum(y["local_tokens_per_rank"]) for y in b], [sum(z["local_tokens_per_rank"]) for z in c]
        check(free == [130] * 4 and all(len(y["local_tokens_per_rank"]) == 2 for y in b), f"padding-free rows: {free}")
        check(all(n >= 132 and n % 4 == 0 for n in padded), f"padded rows: {padded}")
    r = job(0, *small, "--split", "even")
    check(r.returncode == 2 and "--split" in r.stderr, f"train bad --split: {r.stderr}")

finish()
print("ok")
