"""How cpattn's planner splits a packed batch over CP ranks (docs/planner.md).

    python examples/plan_split.py --lengths 16,24,5 --cp 2
    python examples/plan_split.py --lengths 16,24,5 --cp 2 --split padding-free
"""

import argparse

import numpy as np

import cpattn


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="16,24,5", help="document lengths, comma-separated")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--split", default="padded", help="padded or padding-free")
    args = p.parse_args()
    cu = np.concatenate([[0], np.cumsum([int(x) for x in args.lengths.split(",")])])
    print(f"cu_seqlens {cu.tolist()}, cp = {args.cp}, split {args.split}")
    for rank in range(args.cp):
        plan = cpattn.get_thd_load_balanced_cp_metadata(cu, args.cp, rank, args.split)
        tokens = ["pad" if r < 0 else str(r) for r in plan.real_token_index]
        print(f"\nrank {rank}: {plan.local_tokens} local tokens ({plan.padding_tokens} padding), "
              f"{plan.visible_pairs} visible (query, key) pairs")
        print("  global tokens:   ", " ".join(tokens))
        print("  actual_seq_qlen: ", plan.actual_seq_qlen.tolist())
        print("  actual_seq_kvlen:", plan.actual_seq_kvlen.tolist())


if __name__ == "__main__":
    main()
