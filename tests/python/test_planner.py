"""The planner from Python against `cpattn plan --json` and plan.hpp's worked example."""

import json
import subprocess

import numpy as np
import pytest
import torch

import cpattn

CU = [0, 1, 8, 24, 25, 40]  # 1-token documents, odd lengths, padding at cp = 3


@pytest.mark.parametrize("split", ["padded", "padding-free"])
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_fields_match_the_cli_json(cli, cp, split):
    report = json.loads(subprocess.run([str(cli), "plan", "--cu-seqlens", ",".join(map(str, CU)), "--cp", str(cp),
                                        "--split", split, "--json"], check=True, capture_output=True, text=True,
                                       timeout=60).stdout)
    for want in report["ranks"]:
        plan = cpattn.get_thd_load_balanced_cp_metadata(torch.tensor(CU, dtype=torch.int32), cp, want["rank"], split)
        assert (plan.cp, plan.rank, plan.split) == (cp, want["rank"], report["split"])
        np.testing.assert_array_equal(plan.cu_seqlens_padded, report["cu_seqlens_padded"])
        for field in ("local_tokens", "padding_tokens", "rect_work", "visible_pairs"):
            assert getattr(plan, field) == want[field], field
        for field in ("global_token_index", "actual_seq_qlen", "actual_seq_kvlen", "kv_gather_index"):
            np.testing.assert_array_equal(getattr(plan, field), want[field], err_msg=field)
        w = plan.work
        runs = [[{"row": int(w["run_row"][i]), "len": int(w["run_len"][i]), "pos": int(w["run_pos"][i])}
                 for i in range(w["run_begin"][t], w["run_end"][t])] for t in range(len(w["q_row"]))]
        assert runs == want["kv_runs"]
        assert plan.global_tokens == report["seq_len"] and len(plan.real_token_index) == plan.local_tokens


def test_worked_example_of_plan_hpp():
    """[0, 16, 40], cp = 2: rank 0 holds tokens 0-3, 12-15, 16-21, 34-39 (plan.hpp)."""
    plan = cpattn.get_thd_load_balanced_cp_metadata(np.array([0, 16, 40]), 2, 0)
    want = [*range(0, 4), *range(12, 16), *range(16, 22), *range(34, 40)]
    np.testing.assert_array_equal(plan.global_token_index, want)
    np.testing.assert_array_equal(plan.actual_seq_qlen, [4, 8, 14, 20])
    np.testing.assert_array_equal(plan.actual_seq_kvlen, [4, 20, 26, 50])
    assert plan.padding_tokens == 0 and plan.docs["chunk"].tolist() == [4, 6]


def test_read_only_boundaries_are_taken():
    """A read-only array (np.load(mmap_mode="r"), np.broadcast_to) plans as a writable one (it
    met the binding's "incompatible function arguments", naming no argument)."""
    cu = np.array([0, 16, 40])
    ro = cu.copy()
    ro.flags.writeable = False
    plan = cpattn.get_thd_load_balanced_cp_metadata(ro, 2, 0)
    np.testing.assert_array_equal(plan.global_token_index, cpattn.get_thd_load_balanced_cp_metadata(cu, 2, 0).global_token_index)


def test_padding_free_split_by_hand():
    """Documents of 1 and 5 tokens at cp = 2 without padding: each cut into 2 * cp = 4 chunks of sizes
    differing by at most one, every real token on exactly one rank, no padding row anywhere."""
    cu = [0, 1, 6]
    plans = [cpattn.get_thd_load_balanced_cp_metadata(cu, 2, r, split="padding-free") for r in range(2)]
    assert [p.padding_tokens for p in plans] == [0, 0]
    held = sorted(np.concatenate([p.real_token_index for p in plans]).tolist())
    assert held == list(range(6))
    assert sum(p.local_tokens for p in plans) == 6
    tokens = torch.arange(10, 16)
    batch = {"tokens": tokens, "labels": tokens + 100, "position_ids": torch.tensor([0, 0, 1, 2, 3, 4]),
             "loss_mask": torch.ones(6)}
    for p in plans:
        local = cpattn.get_batch_on_this_cp_rank(batch, cu, 2, p.rank, split="padding-free")
        assert torch.equal(local["tokens"], tokens[torch.from_numpy(p.real_token_index)])
        assert torch.equal(cpattn.take_local_rows(tokens, p), local["tokens"])
    with pytest.raises(ValueError, match="split must be one of padded, padding-free"):
        cpattn.get_thd_load_balanced_cp_metadata(cu, 2, 0, split="ragged")


def test_batch_on_this_cp_rank_by_hand():
    """Documents of 1 and 5 tokens at cp = 2: each padded to 4 and 8, chunks of 1 and 2."""
    cu = [0, 1, 6]
    tokens = torch.arange(10, 16)
    batch = {"tokens": tokens, "labels": tokens + 100, "position_ids": torch.tensor([0, 0, 1, 2, 3, 4]),
             "loss_mask": torch.ones(6)}
    local = cpattn.get_batch_on_this_cp_rank(batch, cu, 2, 1, pad_token_id=-7)
    # rank 1: chunk 1 and 2 of each document. Doc 0 (1 token, padded to 4): both padding
    # (positions 1, 2); doc 1 (5 tokens, padded to 8): positions 2-3 and 4-5 (5 is padding).
    assert local["tokens"].tolist() == [-7, -7, 13, 14, 15, -7]
    assert local["labels"].tolist() == [-100, -100, 113, 114, 115, -100]
    assert local["position_ids"].tolist() == [1, 2, 2, 3, 4, 5]
    assert local["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0]
    plan = cpattn.get_thd_load_balanced_cp_metadata(cu, 2, 1)
    assert torch.equal(cpattn.take_local_rows(tokens, plan)[2:5], local["tokens"][2:5])


def test_take_and_put_local_rows_are_inverse():
    cu = [0, 3, 10, 11]
    x = torch.randn(11, 2, 3)
    back = torch.zeros_like(x)
    for rank in range(3):
        plan = cpattn.get_thd_load_balanced_cp_metadata(cu, 3, rank)
        local = cpattn.take_local_rows(x, plan)
        assert torch.all(local[torch.from_numpy(plan.real_token_index < 0)] == 0)
        cpattn.put_local_rows(local, plan, back)
    assert torch.equal(back, x)
