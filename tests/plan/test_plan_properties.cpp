// Property tests over random batches: the invariants of docs/design.md sections 3-4, checked
// against a brute-force model of the padded global batch, for every rank of every cp.
#include <cpattn/plan.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

namespace cpattn {
namespace {

struct Token {  // one token of the padded global batch, as the brute-force model sees it
  int64_t doc;
  int64_t pos;   // position in its document
  int64_t real;  // index in the real batch, or -1 for padding
};

std::vector<int64_t> random_boundaries(std::mt19937_64& rng) {
  // Log-uniform counts and lengths, so that tiny and huge documents both come up often.
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const auto docs = static_cast<int64_t>(std::exp(u(rng) * std::log(200.0)));
  std::vector<int64_t> cu{0};
  for (int64_t d = 0; d < std::max<int64_t>(docs, 1); ++d)
    cu.push_back(cu.back() + static_cast<int64_t>(std::exp(u(rng) * std::log(5000.0))));
  return cu;
}

void check_batch(const std::vector<int64_t>& cu, int cp) {
  // The brute-force padded batch.
  // The model's own rules, not the planner's helpers: 2*cp chunks and 2 tasks per document,
  // except one chunk and one task (no padding) at cp = 1.
  const int64_t chunks = cp == 1 ? 1 : 2 * cp;
  const std::size_t tasks_per_doc = cp == 1 ? 1 : 2;
  std::vector<Token> padded;
  // Real pairs of the batch, and an upper bound on any rank's: the padded batch's per-rank
  // count, P(P+1)/(2cp) per document (c(2cp*c + 1) with P = 2cp*c; real pairs are a subset).
  int64_t real_pairs = 0, padded_pairs_per_rank = 0;
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t len = cu[d + 1] - cu[d];
    const int64_t m = chunks;
    const int64_t plen = (len + m - 1) / m * m;
    for (int64_t p = 0; p < plen; ++p)
      padded.push_back({static_cast<int64_t>(d), p, p < len ? cu[d] + p : -1});
    real_pairs += len * (len + 1) / 2;
    padded_pairs_per_rank += cp == 1 ? plen * (plen + 1) / 2 : plen * (plen + 1) / (2 * cp);
  }
  const bool needs_padding = static_cast<int64_t>(padded.size()) != cu.back();
  const auto t_pad = static_cast<int64_t>(padded.size());
  ASSERT_EQ(t_pad % cp, 0);

  std::vector<RankPlan> plans;
  for (int r = 0; r < cp; ++r) plans.push_back(get_thd_load_balanced_cp_metadata(cu, cp, r));
  const int64_t t_loc = plans[0].local_tokens;
  ASSERT_EQ(t_loc * cp, t_pad);

  // Every padded token is owned by exactly one rank; real tokens keep their index.
  std::vector<int> owners(static_cast<std::size_t>(t_pad), 0);
  std::vector<int64_t> gathered;  // the rank-major all-gather of global token indices
  for (const RankPlan& p : plans) {
    ASSERT_EQ(p.local_tokens, t_loc) << "local counts differ";
    int64_t pad = 0;
    for (int64_t i = 0; i < t_loc; ++i) {
      const int64_t g = p.global_token_index[i];
      ASSERT_GE(g, 0);
      ASSERT_LT(g, t_pad);
      ++owners[g];
      ASSERT_EQ(p.real_token_index[i], padded[g].real);
      pad += padded[g].real < 0;
    }
    EXPECT_EQ(p.padding_tokens, pad);
    gathered.insert(gathered.end(), p.global_token_index.begin(), p.global_token_index.end());
  }
  for (int64_t g = 0; g < t_pad; ++g) ASSERT_EQ(owners[g], 1) << "token " << g;

  for (const RankPlan& p : plans) {
    int64_t visible = 0, rect = 0;
    ASSERT_EQ(p.work.tasks.size(), tasks_per_doc * (cu.size() - 1));
    for (std::size_t t = 0; t < p.work.tasks.size(); ++t) {
      const AttnTask& task = p.work.tasks[t];
      const int64_t q_len = p.cu_seqlens_q[t + 1] - p.cu_seqlens_q[t];
      const int64_t kv_len = p.cu_seqlens_kv[t + 1] - p.cu_seqlens_kv[t];
      ASSERT_EQ(task.q_row, p.cu_seqlens_q[t]);
      ASSERT_EQ(task.q_len, q_len);
      // Queries are local rows of one document, consecutive positions starting at q_pos.
      for (int64_t i = 0; i < q_len; ++i) {
        const Token& q = padded[p.global_token_index[task.q_row + i]];
        ASSERT_EQ(q.doc, task.doc);
        ASSERT_EQ(q.pos, task.q_pos + i);
      }
      // docs/design.md section 1: the gather index selects exactly the keys of the document visible
      // to its last query, in sequence order, and bottom-right alignment lets query i see
      // keys 0 .. kv_len - q_len + i, which is its own position.
      ASSERT_EQ(kv_len - q_len, task.q_pos);
      for (int64_t k = 0; k < kv_len; ++k) {
        const int64_t at = p.kv_gather_index[p.cu_seqlens_kv[t] + k];
        ASSERT_GE(at, 0);
        ASSERT_LT(at, cp * t_loc);
        const Token& key = padded[gathered[at]];
        ASSERT_EQ(key.doc, task.doc);
        ASSERT_EQ(key.pos, k);
      }
      // The runs describe the same gathered positions as the index, in the same order.
      int64_t k = 0;
      for (int64_t ri = task.run_begin; ri < task.run_end; ++ri) {
        const KeyRun& run = p.work.runs[ri];
        ASSERT_EQ(run.pos, k);
        for (int64_t e = 0; e < run.len; ++e, ++k)
          ASSERT_EQ(run.row + e, p.kv_gather_index[p.cu_seqlens_kv[t] + k]);
      }
      ASSERT_EQ(k, kv_len);
      const KeyRun& ir = p.work_indexed.runs[p.work_indexed.tasks[t].run_begin];
      ASSERT_EQ(ir.row, p.cu_seqlens_kv[t]);
      ASSERT_EQ(ir.len, kv_len);
      // Real work only: the task's real queries times its real keys, and each real query at
      // position pos sees keys 0..pos, all of them real.
      int64_t real_q = 0, real_kv = 0;
      for (int64_t i = 0; i < q_len; ++i) {
        if (padded[p.global_token_index[task.q_row + i]].real < 0) continue;
        ++real_q;
        visible += task.q_pos + i + 1;
      }
      for (int64_t j = 0; j < kv_len; ++j)
        real_kv += padded[gathered[p.kv_gather_index[p.cu_seqlens_kv[t] + j]]].real >= 0;
      rect += real_q * real_kv;
    }
    EXPECT_EQ(p.workload.rect_work, rect);
    EXPECT_EQ(p.workload.visible_pairs, visible);
    // ... which is the rectangle of the work the CP layer runs, padding cut out.
    const WorkList cut = without_padding(p, p.work);
    int64_t cut_rect = 0;
    for (const AttnTask& task : cut.tasks)
      for (int64_t ri = task.run_begin; ri < task.run_end; ++ri) cut_rect += task.q_len * cut.runs[ri].len;
    EXPECT_EQ(cut_rect, rect);
    EXPECT_LE(p.workload.visible_pairs, padded_pairs_per_rank);
    if (!needs_padding) {  // then the split is exact
      EXPECT_EQ(p.workload.rect_work, plans[0].workload.rect_work) << "rect work differs";
      EXPECT_EQ(p.workload.visible_pairs, plans[0].workload.visible_pairs) << "pairs differ";
    }
  }
  const BalanceReport b = balance_report(cu, cp);
  int64_t pairs = 0;
  for (int r = 0; r < cp; ++r) {
    EXPECT_EQ(b.ranks[r].balanced.visible_pairs, plans[r].workload.visible_pairs);
    EXPECT_EQ(b.ranks[r].balanced.rect_work, plans[r].workload.rect_work);
    EXPECT_EQ(b.ranks[r].padding_tokens, plans[r].padding_tokens);
    EXPECT_EQ(b.ranks[r].tasks, static_cast<int64_t>(plans[r].work.tasks.size()));
    pairs += plans[r].workload.visible_pairs;
  }
  EXPECT_EQ(pairs, real_pairs);  // every real causal pair on exactly one rank
  // max/mean <= padded_pairs_per_rank / (real_pairs / cp) = sum P(P+1) / sum L(L+1).
  if (!needs_padding) {
    EXPECT_DOUBLE_EQ(b.imbalance_balanced, 1.0);
  } else {
    EXPECT_GE(b.imbalance_balanced, 1.0);
    EXPECT_LE(b.imbalance_balanced, static_cast<double>(padded_pairs_per_rank) * cp /
                                        static_cast<double>(real_pairs) * (1 + 1e-12));
  }
}

TEST(PlanProperties, RandomBatchesEveryCp) {
  // CPATTN_PLAN_PROPERTY_BATCHES raises the count for a longer local soak.
  const char* env = std::getenv("CPATTN_PLAN_PROPERTY_BATCHES");
  const int batches = env ? std::atoi(env) : 1000;
  std::mt19937_64 rng(20261130);
  const int cps[] = {1, 2, 3, 4, 5, 8, 16};
  for (int b = 0; b < batches; ++b) {
    const std::vector<int64_t> cu = random_boundaries(rng);
    const int cp = cps[b % 7];
    SCOPED_TRACE(::testing::Message() << "batch " << b << " docs " << cu.size() - 1 << " cp " << cp);
    check_batch(cu, cp);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(PlanProperties, AwkwardBatches) {
  for (const int cp : {1, 2, 3, 5, 16}) {
    check_batch({0, 1}, cp);                       // one 1-token document
    std::vector<int64_t> many{0};                  // many 1-token documents
    for (int i = 0; i < 300; ++i) many.push_back(many.back() + 1);
    check_batch(many, cp);
    check_batch({0, 200000}, cp);                  // one huge document
    check_batch({0, 1, 2 * cp + 1, 4 * cp + 1}, cp);  // lengths 1, 2cp, 2cp
  }
}

}  // namespace
}  // namespace cpattn
