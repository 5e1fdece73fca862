// `cpattn run`'s batch source: the flags -> the global batch (check::Batch).
#include "run.hpp"

#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/tensor.hpp>

#include <cstdint>
#include <optional>
#include <utility>

#include "../vocab.hpp"

namespace cpattn::cli::run_cmd {

int64_t flag_tokens(const RunArgs& a) {
  if (a.lengths.empty()) return a.seq_len;
  int64_t t = 0;
  for (const int64_t n : a.lengths) t = n > 0 && t <= INT64_MAX - n ? t + n : t;  // bad lengths: make_batch's error
  return t;
}

check::BatchShape flag_shape(const RunArgs& a) {
  return {.heads_q = a.heads,
          .heads_k = a.kv_heads,
          .head_dim_qk = a.head_dim_qk ? a.head_dim_qk : a.head_dim,
          .head_dim_v = a.head_dim_v ? a.head_dim_v : a.head_dim};
}

check::Batch make_batch(const RunArgs& a) {
  const DType t = parse_dtype(a.dtype);
  if (!a.npy_in.empty()) return check::npy_batch(a.npy_in, t, "--npy-in");
  std::vector<int64_t> cu = a.lengths.empty()
                                ? cu_seqlens_from_lengths(check::document_mix(a.seq_len, a.seed))
                                : cu_seqlens_from_lengths(a.lengths, "--lengths");
  return check::random_batch(std::move(cu), flag_shape(a), t, a.seed);
}

void check_batch_finite(const check::Batch& b) {
  const std::pair<const char*, const check::Tensor*> inputs[] = {{"q", &b.q}, {"k", &b.k}, {"v", &b.v},
                                                                 {"dout", &b.dout}};
  for (const auto& [name, tensor] : inputs) {
    const std::optional<ElementIndex> bad = first_nonfinite(tensor->view());
    CPATTN_CHECK(!bad, "input ",
                 describe_element(name, tensor->f[static_cast<std::size_t>(tensor->view().offset(bad->row, bad->head) + bad->dim)],
                                  bad->row, *bad),
                 ": inputs must be finite (--no-check-finite skips this check)");
  }
}

}  // namespace cpattn::cli::run_cmd
