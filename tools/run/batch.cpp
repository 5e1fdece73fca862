// `cpattn run`'s batch source: the flags -> the global batch (check::Batch).
#include "run.hpp"

#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>

#include "../vocab.hpp"

namespace cpattn::cli::run_cmd {

check::Batch make_batch(const RunArgs& a) {
  const DType t = parse_dtype(a.dtype);
  if (!a.npy_in.empty()) return check::npy_batch(a.npy_in, t, "--npy-in");
  std::vector<int64_t> cu = a.lengths.empty()
                                ? cu_seqlens_from_lengths(check::document_mix(a.seq_len, a.seed))
                                : cu_seqlens_from_lengths(a.lengths, "--lengths");
  const check::BatchShape shape{.heads_q = a.heads,
                                .heads_k = a.kv_heads,
                                .head_dim_qk = a.head_dim_qk ? a.head_dim_qk : a.head_dim,
                                .head_dim_v = a.head_dim_v ? a.head_dim_v : a.head_dim};
  return check::random_batch(std::move(cu), shape, t, a.seed);
}

}  // namespace cpattn::cli::run_cmd
