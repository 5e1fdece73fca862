"""The load-balancing planner from Python (docs/planner.md, docs/python.md).

get_thd_load_balanced_cp_metadata returns the C++ RankPlan's fields under their C++ names
(those of `cpattn plan --json` too) as NumPy int64 arrays; get_batch_on_this_cp_rank and
take_local_rows lay a global batch out for one rank.
"""

from dataclasses import dataclass

import numpy as np
import torch

from . import _cpattn
from .attention import integer

IGNORE_INDEX = -100  # cpattn::kIgnoreIndex: the label of a token the loss skips


@dataclass(frozen=True)
class RankPlan:
    """What rank `rank` of `cp` holds of one batch; fields as cpattn::RankPlan (plan.hpp).

    docs, work and work_indexed hold one array per field of DocSplit / AttnTask and KeyRun
    (work["q_row"], work["run_row"], ...); rect_work and visible_pairs are its Workload.
    """

    cp: int
    rank: int
    split: str
    global_tokens: int
    global_tokens_padded: int
    local_tokens: int
    padding_tokens: int
    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray
    docs: dict
    global_token_index: np.ndarray
    real_token_index: np.ndarray
    cu_seqlens_q: np.ndarray
    cu_seqlens_kv: np.ndarray
    actual_seq_qlen: np.ndarray
    actual_seq_kvlen: np.ndarray
    kv_gather_index: np.ndarray
    work: dict
    work_indexed: dict
    rect_work: int
    visible_pairs: int


def as_boundaries(cu_seqlens, name="cu_seqlens"):
    """cu_seqlens (a torch tensor, NumPy array or sequence of ints) as a contiguous int array."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got device {cu_seqlens.device}")
        cu_seqlens = cu_seqlens.detach().numpy()
    a = np.asarray(cu_seqlens)
    if a.dtype not in (np.int32, np.int64):
        if a.dtype.kind not in "iu" and a.size:
            raise TypeError(f"{name} must hold integers (int32 or int64), got {a.dtype}")
        if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
            raise ValueError(f"{name} must fit in int64, got {int(a.max())}")
        a = a.astype(np.int64)
    a = np.ascontiguousarray(a)
    # (the binding takes writable arrays only: a read-only one, from np.load(mmap_mode="r") or
    # np.broadcast_to, met nanobind's "incompatible function arguments" naming no argument)
    return a if a.flags.writeable else a.copy()


def check_cp(cp_size, rank):
    for name, value in (("cp_size", cp_size), ("rank", rank)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 1 <= cp_size <= 65536:  # (cpattn::kMaxCp; past int, nanobind's message named no argument)
        raise ValueError(f"cp_size must be in 1..65536, got {cp_size}")
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank must be in [0, cp_size) = [0, {cp_size}), got {rank}")


def check_split(split):
    if not isinstance(split, str):
        raise TypeError(f"split must be a str ('padded' or 'padding-free'), got {type(split).__name__}")


def get_thd_load_balanced_cp_metadata(cu_seqlens, cp_size, rank, split="padded"):
    """Rank `rank`'s plan for the real (unpadded) boundaries `cu_seqlens` split over cp_size ranks.

    split: "padded" (TransformerEngine's, the default) or "padding-free" (docs/planner.md).
    """
    check_cp(cp_size, rank)
    check_split(split)
    return RankPlan(**_cpattn.plan(as_boundaries(cu_seqlens), int(cp_size), int(rank), split))


def check_rows(name, t, rows, field):
    """TypeError unless t is a torch.Tensor of at least one dimension; ValueError unless its
    first dimension is the plan's `field` (= rows)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__} (torch.from_numpy converts an array)")
    if t.dim() < 1:
        raise ValueError(f"{name} must have a token dimension first, got a 0-d tensor")
    if t.shape[0] != rows:
        raise ValueError(f"{name}.shape[0] must equal the plan's {field} = {rows}, got {t.shape[0]}")


def take_local_rows(x, plan):
    """This rank's rows of a global tensor x [global_tokens, ...] in the plan's order; padding rows 0.

    Differentiable (an index copy): the gradient flows back to x's rows.
    """
    check_rows("x", x, plan.global_tokens, "global_tokens")
    real = torch.from_numpy(plan.real_token_index)
    keep = real >= 0
    local = x.new_zeros((plan.local_tokens,) + tuple(x.shape[1:]))
    return local.index_put((keep.nonzero().squeeze(1),), x[real[keep]])


def put_local_rows(local, plan, out=None):
    """The inverse of take_local_rows: the real rows of `local` at their global rows of `out`."""
    check_rows("local", local, plan.local_tokens, "local_tokens")
    if out is None:
        out = local.new_zeros((plan.global_tokens,) + tuple(local.shape[1:]))
    else:
        check_rows("out", out, plan.global_tokens, "global_tokens")
    real = torch.from_numpy(plan.real_token_index)
    keep = real >= 0
    out[real[keep]] = local[keep]
    return out


_BATCH_FIELDS = {"tokens": np.int64, "labels": np.int64, "position_ids": np.int64, "loss_mask": np.float32}


def get_batch_on_this_cp_rank(batch, cu_seqlens, cp_size, rank, pad_token_id=0, split="padded"):
    """Megatron's get_batch_on_this_cp_rank for a packed (THD) batch (cpattn::get_batch_on_this_cp_rank).

    batch: a dict with "tokens", "labels", "position_ids" and "loss_mask", 1-D tensors or
    arrays of the batch's tokens each. Returns the same keys as torch tensors (int64; loss_mask
    float32) of this rank's local_tokens, in the split's order: padding tokens get
    pad_token_id, label -100, loss mask 0 and positions continuing their document's; real
    tokens keep their values. split: as for get_thd_load_balanced_cp_metadata.
    """
    check_cp(cp_size, rank)
    check_split(split)
    pad_token_id = integer("pad_token_id", pad_token_id)  # (1.7 was truncated to 1, "7" read as 7)
    if not isinstance(batch, dict):
        raise TypeError(f"batch must be a dict with keys {', '.join(_BATCH_FIELDS)}, got {type(batch).__name__}")
    arrays = {}
    for key, dtype in _BATCH_FIELDS.items():
        if key not in batch:
            raise ValueError(f"batch must have the key '{key}' (it needs {', '.join(_BATCH_FIELDS)})")
        x = np.asarray(batch[key].detach().numpy() if isinstance(batch[key], torch.Tensor) else batch[key])
        if dtype is np.int64 and x.size and x.dtype.kind not in "iu":
            raise TypeError(f"batch['{key}'] must hold integers, got {x.dtype}")  # (floats were truncated)
        if dtype is np.int64 and x.size and x.dtype.kind == "u" and int(x.max()) > np.iinfo(np.int64).max:
            raise ValueError(f"batch['{key}'] must fit in int64, got {int(x.max())}")  # (it wrapped to negative)
        arrays[key] = np.ascontiguousarray(x, dtype=dtype)
        if arrays[key].ndim != 1:
            raise ValueError(f"batch['{key}'] must be 1-D [tokens], got shape {list(arrays[key].shape)}")
    local = _cpattn.batch_on_rank(**arrays, cu_seqlens=as_boundaries(cu_seqlens), cp_size=int(cp_size),
                                  rank=int(rank), pad_token_id=pad_token_id, split=split)
    return {key: torch.from_numpy(value) for key, value in local.items()}
