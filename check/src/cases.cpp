#include <cpattn/check/cases.hpp>


#include <algorithm>
#include <cmath>

namespace cpattn::check {

std::vector<int64_t> AttnCase::cu(const std::vector<int64_t>& lens) {
  // (a 0: a document empty in both lists, which varlen_worklist skips; the planner's
  // cu_seqlens_from_lengths refuses it)
  std::vector<int64_t> cu{0};
  for (const int64_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}

int64_t AttnCase::visible_pairs() const {
  int64_t n = 0;
  for (std::size_t d = 0; d < q_lens.size(); ++d) {
    const int64_t ql = q_lens[d], kl = k_lens[d];
    // Bottom-right alignment: the queries end where the keys end (varlen_worklist's positions).
    const int64_t q_pos = std::max<int64_t>(kl - ql, 0), k_pos = std::max<int64_t>(ql - kl, 0);
    for (int64_t i = 0; i < ql; ++i) {
      const int64_t qp = q_pos + i;
      int64_t lo = k_pos, hi = k_pos + kl - 1;
      if (window_left >= 0) lo = std::max(lo, qp - window_left);
      if (mask == MaskType::causal) hi = std::min(hi, qp);
      else if (window_right >= 0) hi = std::min(hi, qp + window_right);
      n += std::max<int64_t>(hi - lo + 1, 0);
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
  std::vector<AttnCase> cases = {
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
  // The masks and options of FlashAttention's varlen API. Documents of 1..300 tokens, so
  // that the windows are smaller than, equal to and larger than documents, and span several
  // key blocks (64 / 128 keys) of the long ones.
  auto with = [](AttnCase c, int64_t left, int64_t right, float softcap, bool alibi,
                 float dropout_p) {
    c.window_left = left;
    c.window_right = right;
    c.softcap = softcap;
    c.alibi = alibi;
    c.dropout_p = dropout_p;
    return c;
  };
  const std::vector<int64_t> docs = {300, 5, 70, 1, 130};
  const AttnCase causal{"", docs, docs, 4, 2, 64, 64, M::causal};
  const AttnCase none{"", docs, docs, 4, 2, 64, 64, M::none};
  std::vector<AttnCase> m = {
      with(causal, 70, -1, 0, false, 0),    // left window: < 300 and 130, = 70, > 5 and 1
      with(causal, 0, -1, 0, false, 0),     // each query sees itself only
      with(causal, 1000, -1, 0, false, 0),  // larger than every document: plain causal
      with(causal, 40, 10, 0, false, 0),    // right has no effect under causal
      with(none, 70, -1, 0, false, 0),      // left-only without a mask: keys up to the end
      with(none, 33, 17, 0, false, 0),      // two-sided sliding window
      with(none, -1, 5, 0, false, 0),       // right-only
      with(none, 0, 0, 0, false, 0),        // the diagonal only
      with(none, 500, 500, 0, false, 0),    // larger than every document: no mask
      with(causal, -1, -1, 5.0f, false, 0),   // softcap, causal
      with(none, -1, -1, 0.5f, false, 0),     // softcap, small cap (scores mostly capped)
      with(causal, -1, -1, 0, true, 0),       // ALiBi, causal
      with(none, 50, 50, 0, true, 0),         // ALiBi in a two-sided window
      with(causal, 64, -1, 2.0f, true, 0.2f), // everything with dropout
      with(none, 20, 40, 1.5f, false, 0.1f),  // window, softcap and dropout, no mask
  };
  const char* names[] = {"win_causal_70",   "win_causal_0",      "win_causal_1000",
                         "win_causal_40_10", "win_none_left_70",  "win_none_33_17",
                         "win_none_right_5", "win_none_diagonal", "win_none_500",
                         "softcap_causal",   "softcap_none_0_5",  "alibi_causal",
                         "alibi_win_none",   "all_causal_dropout", "win_softcap_none_dropout"};
  for (std::size_t i = 0; i < m.size(); ++i) m[i].name = names[i];
  // With GQA and MLA (Dqk != Dv), and more queries than keys (cross-attention, no mask).
  m.push_back(with({"win_gqa8_fewer_queries", {5, 40, 1}, {17, 97, 1}, 8, 1, 111, 111, M::causal},
                   20, -1, 0, false, 0));
  m.push_back(with({"win_softcap_alibi_mla", {97, 33, 200}, {97, 33, 200}, 4, 2, 192, 128, M::causal},
                   50, -1, 3.0f, true, 0));
  m.push_back(with({"win_none_mla_gqa_dropout", {150, 7}, {150, 7}, 6, 2, 96, 40, M::none},
                   25, 25, 0, true, 0.15f));
  m.push_back(with({"win_none_more_queries", {50, 7}, {30, 9}, 4, 2, 64, 32, M::none},
                   60, 60, 4.0f, false, 0));
  cases.insert(cases.end(), m.begin(), m.end());
  // One query head per KV head, tasks of 1, 20 and 32 rows over 600-1100 keys (pieces of 256
  // keys on tiles, 128 on vectors): on tiles a forward unit is then one sub-block per piece,
  // the same rows piece after piece, which a pipeline of the tiles' products across pieces
  // must keep in order (a trial of one, its guard for these rows removed, failed only the CP
  // overlap test before this row existed). Last, so that the seeds of the rows before it
  // (1234 + the row's index) stay as they were.
  cases.push_back({"mha_short_queries_long_keys", {1, 20, 32}, {600, 700, 1100}, 2, 2, 64, 64, M::causal});
  // Causal with more queries than keys (FlashAttention 2.1's bottom-right rule: the first
  // q_len - kv_len queries see no key), a document empty on both sides between (a padded
  // batch's), with a window and ALiBi on the second. Last, for the seeds above.
  cases.push_back({"causal_more_queries", {50, 0, 7, 1}, {30, 0, 3, 1}, 4, 2, 64, 32, M::causal});
  cases.push_back(with({"win_alibi_causal_more_queries", {130, 9}, {70, 9}, 4, 1, 48, 48, M::causal},
                       20, -1, 0, true, 0));
  return cases;
}

AttnCase bench_case(std::vector<int64_t> lens, int hq, int hk, int dqk, int dv, MaskType m) {
  // A braced list runs in order: q_lens copies lens before k_lens takes it.
  return {.name = "bench", .q_lens = lens, .k_lens = std::move(lens), .num_heads_q = hq, .num_heads_k = hk,
          .head_dim_qk = dqk, .head_dim_v = dv, .mask = m};
}

}  // namespace cpattn::check
