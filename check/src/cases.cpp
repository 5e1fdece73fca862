#include <cpattn/check/cases.hpp>

#include <cpattn/layout.hpp>

namespace cpattn::check {

std::vector<int64_t> AttnCase::cu(const std::vector<int64_t>& lens) { return cu_seqlens_from_lengths(lens); }

int64_t AttnCase::visible_pairs() const {
  int64_t n = 0;
  for (std::size_t d = 0; d < q_lens.size(); ++d) {
    const int64_t ql = q_lens[d], kl = k_lens[d];
    if (mask == MaskType::none) {
      n += ql * kl;
    } else {
      for (int64_t i = 0; i < ql; ++i) n += kl - ql + i + 1;
    }
  }
  return n;
}

double AttnCase::fwd_flops() const {
  return 2.0 * (head_dim_qk + head_dim_v) * static_cast<double>(visible_pairs()) * num_heads_q;
}
double AttnCase::bwd_flops() const {
  return 2.0 * (3.0 * head_dim_qk + 2.0 * head_dim_v) * static_cast<double>(visible_pairs()) *
         num_heads_q;
}

std::vector<AttnCase> attention_cases() {
  using M = MaskType;
  return {
      {"single_doc_97", {97}, {97}, 4, 2, 64, 64, M::causal},
      {"many_docs", {1, 97, 3, 64, 1, 130}, {1, 97, 3, 64, 1, 130}, 4, 4, 128, 128, M::causal},
      {"one_token_docs", {1, 1, 1, 1, 1}, {1, 1, 1, 1, 1}, 2, 1, 59, 59, M::causal},
      {"fewer_queries_gqa8", {5, 40, 1}, {17, 97, 1}, 8, 1, 111, 111, M::causal},
      {"mla_192_128", {97, 33}, {97, 33}, 2, 2, 192, 128, M::causal},
      {"seqlen_1025", {1025}, {1025}, 2, 1, 64, 64, M::causal},
      {"no_mask_fewer_queries", {7, 50}, {30, 97}, 4, 2, 128, 128, M::none},
      {"no_mask_dim59", {97}, {97}, 2, 2, 59, 59, M::none},
      // Cross-attention: more queries than keys (and fewer) without a mask.
      {"no_mask_more_queries", {50, 7, 1}, {30, 3, 9}, 4, 2, 64, 32, M::none},
      {"seqlen_1_dim16", {1}, {1}, 1, 1, 16, 16, M::causal},
      {"dim256_gqa2", {70, 3}, {70, 3}, 2, 1, 256, 256, M::causal},
      // GQA 6: the forward runs a kv head's query heads in sets of 4, here 4 + 2.
      {"gqa6_head_sets_4_2", {45, 70}, {45, 70}, 6, 1, 48, 48, M::causal},
  };
}

AttnCase bench_case(std::vector<int64_t> lens, int hq, int hk, int dqk, int dv, MaskType m) {
  AttnCase c;
  c.name = "bench";
  c.q_lens = lens;
  c.k_lens = std::move(lens);
  c.num_heads_q = hq;
  c.num_heads_k = hk;
  c.head_dim_qk = dqk;
  c.head_dim_v = dv;
  c.mask = m;
  return c;
}

}  // namespace cpattn::check
