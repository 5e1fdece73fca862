"""cpattn: context-parallel attention on packed variable-length sequences, for PyTorch on the CPU.

    import cpattn
    out = cpattn.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, causal=True)

See docs/python.md.
"""

from ._cpattn import __version__
from .attention import flash_attn_varlen_func
from .cp import ContextParallelAttention
from .planner import (IGNORE_INDEX, RankPlan, get_batch_on_this_cp_rank, get_thd_load_balanced_cp_metadata,
                      put_local_rows, take_local_rows)

__all__ = [
    "__version__",
    "flash_attn_varlen_func",
    "ContextParallelAttention",
    "RankPlan",
    "get_thd_load_balanced_cp_metadata",
    "get_batch_on_this_cp_rank",
    "take_local_rows",
    "put_local_rows",
    "IGNORE_INDEX",
]
