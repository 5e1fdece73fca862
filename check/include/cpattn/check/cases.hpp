// The one table of attention cases: the kernel tests iterate it, the benchmark times its
// shapes. A case knows its shapes and its FLOP count; its tolerance is tolerance.hpp's.
#pragma once

#include <cpattn/attention.hpp>

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

namespace cpattn::check {

struct AttnCase {
  std::string name;
  std::vector<int64_t> q_lens;  // queries per document
  std::vector<int64_t> k_lens;  // keys per document (bottom-right aligned to the queries; 0 with q_lens' 0)
  int num_heads_q = 1;
  int num_heads_k = 1;
  int head_dim_qk = 64;
  int head_dim_v = 64;
  MaskType mask = MaskType::causal;
  // AttnOptions' masks and options (attention.hpp): window, soft cap, ALiBi (slopes from
  // alibi_slopes(num_heads_q)), dropout.
  int64_t window_left = -1;
  int64_t window_right = -1;
  float softcap = 0.0f;
  bool alibi = false;
  float dropout_p = 0.0f;

  int64_t total_q() const { return std::accumulate(q_lens.begin(), q_lens.end(), int64_t{0}); }
  int64_t total_k() const { return std::accumulate(k_lens.begin(), k_lens.end(), int64_t{0}); }
  static std::vector<int64_t> cu(const std::vector<int64_t>& lens);
  std::vector<int64_t> cu_seqlens_q() const { return cu(q_lens); }
  std::vector<int64_t> cu_seqlens_k() const { return cu(k_lens); }
  // Visible (query, key) pairs per query head.
  int64_t visible_pairs() const;
  // FLOPs as the issue counts them: 2*(Dqk+Dv) forward, 2*(3*Dqk+2*Dv) backward, per visible
  // pair per query head.
  double fwd_flops() const;
  double bwd_flops() const;
};

std::vector<AttnCase> attention_cases();

// The standard ALiBi slopes (the library's, include/cpattn/attention.hpp).
using ::cpattn::alibi_slopes;

// A case of equal query and key lengths (the benchmark's: T = 8192, Hq = 16, Hkv = 4, D = 128,
// causal by default on the command line).
AttnCase bench_case(std::vector<int64_t> lens, int hq, int hk, int dqk, int dv, MaskType m);

}  // namespace cpattn::check
