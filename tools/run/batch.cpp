// `cpattn run`'s batch source: the flags -> the global batch (check::Batch).
#include "run.hpp"

#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>

namespace cpattn::cli::run_cmd {

DType parse_dtype(const std::string& s) {
  if (s == "fp32") return DType::f32;
  if (s == "fp16") return DType::f16;
  if (s == "bf16") return DType::bf16;
  CPATTN_CHECK(false, "--dtype must be fp32, fp16 or bf16, got '", s, "'");
  return DType::f32;
}

check::Batch make_batch(const RunArgs& a) {
  const DType t = parse_dtype(a.dtype);
  if (!a.npy_in.empty()) return check::npy_batch(a.npy_in, t, "--npy-in");
  std::vector<int64_t> cu = a.lengths.empty()
                                ? cu_seqlens_from_lengths(check::document_mix(a.tokens, a.seed))
                                : cu_seqlens_from_lengths(a.lengths, "--lengths");
  const check::BatchShape shape{.heads_q = a.heads,
                                .heads_k = a.kv_heads,
                                .head_dim_qk = a.head_dim_qk ? a.head_dim_qk : a.head_dim,
                                .head_dim_v = a.head_dim_v ? a.head_dim_v : a.head_dim};
  return check::random_batch(std::move(cu), shape, t, a.seed);
}

}  // namespace cpattn::cli::run_cmd
