"""`cpattn mesh` and `cpattn pipeline` end to end: the JSON against hand-worked tables, the SVG
as well-formed XML with one block per action, and exit code 2 with one line for bad flags."""
import json
import os
import sys
import tempfile
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/cli_lib.py
from cli_lib import check, finish, job


def run(*args):
    return job(0, *args, timeout=60)


# ---- mesh: world 16 = tp 2 x cp 4 x pp 2, nodes of 8 -------------------------------------
r = run("mesh", "--world", "16", "--tp", "2", "--cp", "4", "--pp", "2", "--ranks-per-node", "8",
        "--json")
check(r.returncode == 0, f"mesh json failed: {r.stderr}")
j = json.loads(r.stdout)
check(j["sizes"] == {"tp": 2, "cp": 4, "dp": 1, "pp": 2, "etp": 2, "ep": 1, "edp": 4}, "sizes")
check([x["rank"] for x in j["ranks"]] == list(range(16)), "rank order")
for x in j["ranks"]:
    c, rank = x["coords"], x["rank"]
    check(rank == c["tp"] + 2 * (c["cp"] + 4 * (c["dp"] + 1 * c["pp"])), f"coords of {rank}")
check(j["ranks"][13]["coords"]["tp"] == 1 and j["ranks"][13]["coords"]["cp"] == 2
      and j["ranks"][13]["coords"]["pp"] == 1, "rank 13")
check(j["groups"]["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]], "cp")
check(j["groups"]["pp"] == [[i, i + 8] for i in range(8)], "pp groups")
check(j["groups"]["tp"] == [[2 * i, 2 * i + 1] for i in range(8)], "tp groups")
check(j["groups"]["dp_cp"] == j["groups"]["cp"], "dp_cp groups")
check(all(j["crosses_nodes"]["pp"]) and not any(j["crosses_nodes"]["cp"]), "crossings at 8")

# Expert axes: world 16, tp 2 cp 2 dp 2 pp 2, ep 2 etp 1 (docs/mesh.md's worked example).
r = run("mesh", "--world", "16", "--tp", "2", "--cp", "2", "--dp", "2", "--pp", "2", "--ep", "2",
        "--etp", "1", "--json")
j = json.loads(r.stdout)
check(j["sizes"]["edp"] == 4, "edp derived")
check(j["groups"]["ep"] == [[2 * i, 2 * i + 1] for i in range(8)], "ep groups")
check(j["groups"]["edp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]], "edp")
check(j["ranks"][13]["coords"]["edp"] == 2 and j["ranks"][13]["coords"]["ep"] == 1, "rank 13 expert")

# Nodes of 4 split the cp groups.
r = run("mesh", "--world", "16", "--tp", "2", "--cp", "4", "--pp", "2", "--ranks-per-node", "4")
check(r.returncode == 0 and "cp      size 4       4 groups, 4 cross nodes" in r.stdout,
      f"table: {r.stdout}")

# ---- pipeline ------------------------------------------------------------------------------
r = run("pipeline", "--stages", "3", "--micro", "4", "--schedule", "fill-drain", "--json")
check(r.returncode == 0, f"pipeline json failed: {r.stderr}")
p = json.loads(r.stdout)
check(p["ticks"] == [["F0", "idle", "idle"], ["F1", "F0", "idle"], ["F2", "F1", "F0"],
                     ["F3", "F2", "F1"], ["idle", "F3", "F2"], ["idle", "idle", "F3"]],
      f"the overview's table: {p['ticks']}")
check(p["makespan"] == 6 and abs(p["utilization"] - 2 / 3) < 1e-12
      and abs(p["bubble_fraction"] - 1 / 3) < 1e-12, "fill-drain figures")

r = run("pipeline", "--stages", "3", "--micro", "4", "--schedule", "1f1b", "--json")
p = json.loads(r.stdout)
check(p["actions"][0] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"], "1f1b stage 0 order")
check(p["peak_activations"] == [3, 2, 1], "1f1b peaks")
check(len(p["ticks"]) == 12, "1f1b ticks")
g = json.loads(run("pipeline", "--stages", "3", "--micro", "4", "--schedule", "gpipe",
                   "--json").stdout)
check(g["peak_activations"] == [4, 4, 4], "gpipe peaks")
z = json.loads(run("pipeline", "--stages", "4", "--micro", "8", "--schedule", "zb-h1",
                   "--json").stdout)
o = json.loads(run("pipeline", "--stages", "4", "--micro", "8", "--schedule", "1f1b",
                   "--json").stdout)
check(z["makespan"] == 27 and o["makespan"] == 33, f"zb-h1 {z['makespan']} 1f1b {o['makespan']}")
check(z["bubble_fraction"] < o["bubble_fraction"], "zero bubble idles less")
check(any(c.startswith("W") for row in z["ticks"] for c in row), "zb-h1 has W")
i = json.loads(run("pipeline", "--stages", "2", "--micro", "2", "--schedule", "interleaved",
                   "--json").stdout)
check(i["virtual_stages"] == 2 and i["ticks"][0] == ["F0.0", "idle"], f"interleaved: {i['ticks']}")
c = json.loads(run("pipeline", "--stages", "2", "--micro", "2", "--costs", "1,2,0/2,1,0",
                   "--transfer", "0.5", "--json").stdout)
check(c["costs"]["forward"] == [1, 2] and c["costs"]["transfer"] == 0.5, "costs parsed")
# By hand: s0 F0 [0,1] F1 [1,2]; s1 F0 [1.5,3.5] B0 [3.5,4.5] F1 [4.5,6.5] B1 [6.5,7.5];
# s0 B0 [5,7] B1 [8,10].
check(c["makespan"] == 10, f"costed makespan {c['makespan']}")
check(c["timeline"][0][3] == {"action": "B1", "start": 8, "end": 10}, "timeline")

# The SVG: well-formed, one labelled block per action, a title with the figures.
with tempfile.TemporaryDirectory() as d:
    for sched in ("fill-drain", "gpipe", "1f1b", "interleaved", "zb-h1"):
        path = os.path.join(d, sched + ".svg")
        r = run("pipeline", "--stages", "4", "--micro", "8", "--schedule", sched, "--svg", path)
        check(r.returncode == 0 and os.path.exists(path), f"svg {sched}: {r.stderr}")
        root = ET.parse(path).getroot()
        ns = "{http://www.w3.org/2000/svg}"
        blocks = [e for e in root.iter(ns + "rect") if e.find(ns + "title") is not None]
        n_actions = {"fill-drain": 32, "gpipe": 64, "1f1b": 64, "interleaved": 128, "zb-h1": 96}
        check(len(blocks) == n_actions[sched], f"svg {sched}: {len(blocks)} blocks")
        text = "".join(t.text or "" for t in root.iter(ns + "text"))
        check("makespan" in text and "bubble" in text and "idle" in text, f"svg {sched} text")
    # Tiny costs: every tick of the time axis lies on the plot (1e-15 costs put them millions of
    # pixels to the right, from an absolute 1e-9 floor), and the labels cover the makespan.
    for tiny in ("1e-15", "3e-9"):
        path = os.path.join(d, "tiny.svg")
        r = run("pipeline", "--stages", "2", "--micro", "2", "--costs", f"{tiny},{tiny},{tiny}", "--svg", path)
        check(r.returncode == 0, f"svg of costs {tiny}: {r.stderr}")
        root = ET.parse(path).getroot()
        axis = [e for e in root.iter(ns + "line") if e.get("stroke") == "#333"]
        left, right = float(axis[0].get("x1")), float(axis[0].get("x2"))
        xs = [float(e.get("x1")) for e in axis[1:]]
        check(len(xs) >= 2 and all(left - 1e-6 <= x <= right + 1e-6 for x in xs),
              f"svg of costs {tiny}: ticks at {xs[:4]}... outside [{left}, {right}]")
    # A subnormal cost is a number >= 0 (stod called it out of range)
    r = run("pipeline", "--costs", "1e-310,1,1", "--json")
    check(r.returncode == 0 and json.loads(r.stdout)["costs"]["forward"][0] == 1e-310, f"--costs 1e-310: {r.stderr}")
    bad_svg = run("pipeline", "--svg", os.path.join(d, "no", "such", "dir", "x.svg"))
    check(bad_svg.returncode == 2 and "--svg" in bad_svg.stderr, f"bad svg: {bad_svg.stderr}")

# Bad flags and values: exit code 2, one line naming the problem.
bad = {
    ("mesh", "--world", "12", "--tp", "2", "--cp", "4", "--dp", "1", "--pp", "2"):
        "tp * cp * dp * pp = 2*4*1*2 = 16 but the world has 12 ranks",
    ("mesh", "--world", "12", "--tp", "2", "--cp", "4", "--pp", "2"): "tp * cp * pp = 2*4*2 = 16",
    ("mesh", "--world", "8", "--tp", "2", "--ep", "3"): "expert axes do not fold",
    ("mesh", "--world", "8", "--tp", "0"): "tp must be >= 1",
    ("mesh", "--world", "8", "--cp", "-1"): "cp must be >= 1",
    ("mesh", "--tp", "2"): "--world",
    ("mesh", "--world", "x"): "--world",
    ("mesh", "--world", "8", "--ranks-per-node", "0"): "--ranks-per-node: must be >= 1, got 0",
    ("pipeline", "--stages", "0"): "--stages must be >= 1",
    ("pipeline", "--micro", "0"): "--micro must be >= 1",
    ("pipeline", "--schedule", "2f2b"): "--schedule",
    ("pipeline", "--schedule", "interleaved", "--stages", "4", "--micro", "6"): "multiple of --stages",
    ("pipeline", "--schedule", "interleaved", "--virtual", "0"): "--virtual must be >= 1",
    ("pipeline", "--schedule", "gpipe", "--virtual", "2"): "--virtual applies to",
    ("pipeline", "--costs", "1,2"): "--costs",
    ("pipeline", "--costs", "1,-2,1"): "--costs",
    ("pipeline", "--stages", "3", "--costs", "1,1,1/1,1,1"): "--costs",
    ("pipeline", "--transfer", "-1"): "--transfer must be >= 0",
    ("pipeline", "--costs", "1,1,1/"): "--costs",  # (trailing separators were dropped)
    ("pipeline", "--costs", "1,1,1,"): "--costs",
    ("pipeline", "--costs", "1,,1"): "--costs: every cost must be a number >= 0, got ''",
    ("pipeline", "--stages", "2", "--costs", "1,1,1//"): "--costs: give one F,B,W triple or one per stage (2), got 3",
    # finite costs whose sum is not: the --svg axis loop ran forever on the infinite makespan
    ("pipeline", "--costs", "1e308,1e308,1", "--svg", "/tmp/cpattn_pipeline_inf.svg"): "--costs, --transfer: the costs add up",
    ("pipeline", "--transfer", "1e308"): "--costs, --transfer: the costs add up",
    ("pipeline", "--bogus"): "--bogus",
    # the schedule's limits by flag, before the per-stage costs (a billion stages: bad_alloc, or
    # 24 GB allocated first)
    ("pipeline", "--stages", "1000000000", "--micro", "1"): "--stages must be <= 1024, got 1000000000",
    ("pipeline", "--stages", "1000", "--micro", "1001"): "--stages * --micro * --virtual must be <= 10^6",
    ("simulate", "--lengths", "64", "--pp", "2", "--layers", "4", "--schedule", "interleaved", "--virtual", "0"):
        "--virtual: must be >= 1, got 0",
    ("simulate", "--lengths", "4096", "--cp", "2", "--heads", "16777216", "--kv-heads", "16777216"):
        "--heads must be <= 65536, got 16777216",
}
for args, needle in bad.items():
    r = run(*args)
    lines = r.stderr.strip().splitlines()
    check(r.returncode == 2, f"{args}: exit {r.returncode}, want 2")
    check(len(lines) == 1 and needle in lines[0], f"{args}: stderr {r.stderr!r} lacks {needle!r}")

# Costs near the largest double: the makespan is finite, and so are the bubble and the
# utilization (S x makespan overflowed: bubble NaN, utilization 0).
r = run("pipeline", "--stages", "2", "--micro", "1", "--schedule", "fill-drain", "--costs", "5e307,0,0", "--json")
check(r.returncode == 0, f"huge costs: {r.stderr}")
if r.returncode == 0:
    hj = json.loads(r.stdout)
    check(hj["makespan"] == 1e308 and hj["bubble_fraction"] == 0.5 and hj["utilization"] == 0.5,
          f"huge costs: makespan {hj['makespan']}, bubble {hj['bubble_fraction']}, utilization {hj['utilization']}")

h = run("pipeline", "--help")
for flag in ("--stages", "--micro", "--schedule", "--virtual", "--costs", "--transfer", "--json", "--svg"):
    check(flag in h.stdout, f"pipeline help lacks {flag}")

finish()
print("cli mesh/pipeline: all checks passed")
