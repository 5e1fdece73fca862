// The one table of attention cases: tests/kernels iterate it, bench/ times its entries.
// A case knows its shapes, its FLOP count and (per dtype) its tolerance.
#pragma once

#include <cpattn/attention.hpp>

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

namespace cpattn::testing {

struct AttnCase {
  std::string name;
  std::vector<int64_t> q_lens;  // queries per document
  std::vector<int64_t> k_lens;  // keys per document (>= q_lens: bottom-right alignment)
  int num_heads_q = 1;
  int num_heads_k = 1;
  int head_dim_qk = 64;
  int head_dim_v = 64;
  MaskType mask = MaskType::causal;

  int64_t total_q() const { return std::accumulate(q_lens.begin(), q_lens.end(), int64_t{0}); }
  int64_t total_k() const { return std::accumulate(k_lens.begin(), k_lens.end(), int64_t{0}); }
  std::vector<int64_t> cu(const std::vector<int64_t>& lens) const {
    std::vector<int64_t> c{0};
    for (int64_t l : lens) c.push_back(c.back() + l);
    return c;
  }
  std::vector<int64_t> cu_seqlens_q() const { return cu(q_lens); }
  std::vector<int64_t> cu_seqlens_k() const { return cu(k_lens); }
  // Visible (query, key) pairs per query head.
  int64_t visible_pairs() const {
    int64_t n = 0;
    for (size_t d = 0; d < q_lens.size(); ++d) {
      const int64_t ql = q_lens[d], kl = k_lens[d];
      if (mask == MaskType::none) {
        n += ql * kl;
      } else {
        for (int64_t i = 0; i < ql; ++i) n += kl - ql + i + 1;
      }
    }
    return n;
  }
  // FLOPs as the issue counts them: 2*(Dqk+Dv) forward, 2*(3*Dqk+2*Dv) backward, per visible
  // pair per query head.
  double fwd_flops() const {
    return 2.0 * (head_dim_qk + head_dim_v) * static_cast<double>(visible_pairs()) * num_heads_q;
  }
  double bwd_flops() const {
    return 2.0 * (3.0 * head_dim_qk + 2.0 * head_dim_v) * static_cast<double>(visible_pairs()) *
           num_heads_q;
  }
};

// Tolerances against the float64 reference. f32: ||diff|| / ||ref|| <= rel_norm. f16/bf16:
// elementwise |diff| <= atol + rtol |ref| (the reference design's values) and the norm error
// at most `naive_factor` times a naive same-precision implementation's.
struct Tolerance {
  double rel_norm;
  double atol, rtol;
  double naive_factor;
};
inline Tolerance tolerance(DType t) {
  switch (t) {
    case DType::f32: return {1e-5, 0.0, 0.0, 0.0};
    case DType::f16: return {0.0, 5e-3, 5e-3, 2.0};
    case DType::bf16: return {0.0, 2.5e-2, 2.5e-2, 2.0};
  }
  return {};
}

inline std::vector<AttnCase> attention_cases() {
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
      {"seqlen_1_dim16", {1}, {1}, 1, 1, 16, 16, M::causal},
      {"dim256_gqa2", {70, 3}, {70, 3}, 2, 1, 256, 256, M::causal},
      // GQA 6: the forward runs a kv head's query heads in sets of 4, here 4 + 2.
      {"gqa6_head_sets_4_2", {45, 70}, {45, 70}, 6, 1, 48, 48, M::causal},
  };
}

// The benchmark's headline shapes (issue 3): T = 8192, Hq = 16, Hkv = 4, D = 128, causal.
inline AttnCase bench_case(std::vector<int64_t> lens, int hq, int hk, int dqk, int dv, MaskType m) {
  AttnCase c;
  c.name = "bench";
  c.q_lens = lens;
  c.k_lens = lens;
  c.num_heads_q = hq;
  c.num_heads_k = hk;
  c.head_dim_qk = dqk;
  c.head_dim_v = dv;
  c.mask = m;
  return c;
}

}  // namespace cpattn::testing
