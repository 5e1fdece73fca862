// The worked examples of docs/design.md sections 3-4 and the public cases, value by value.
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace cpattn {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using V = std::vector<int64_t>;

V iota(int64_t a, int64_t b) {  // [a, b]
  V v(static_cast<std::size_t>(b - a + 1));
  std::iota(v.begin(), v.end(), a);
  return v;
}
V cat(std::initializer_list<V> parts) {
  V out;
  for (const V& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

TEST(Plan, WorkedExampleOfDesignSections3And4) {
  const V cu{0, 16, 40};
  const RankPlan r0 = get_thd_load_balanced_cp_metadata(cu, 2, 0);
  const RankPlan r1 = get_thd_load_balanced_cp_metadata(cu, 2, 1);
  EXPECT_EQ(r0.local_tokens, 20);
  EXPECT_EQ(r0.global_tokens, 40);
  EXPECT_EQ(r0.global_tokens_padded, 40);
  EXPECT_EQ(r0.padding_tokens, 0);
  EXPECT_EQ(r0.cu_seqlens_padded, (V{0, 16, 40}));
  EXPECT_EQ(r0.global_token_index, cat({iota(0, 3), iota(12, 15), iota(16, 21), iota(34, 39)}));
  EXPECT_EQ(r1.global_token_index, cat({iota(4, 7), iota(8, 11), iota(22, 27), iota(28, 33)}));
  EXPECT_EQ(r0.actual_seq_qlen, (V{4, 8, 14, 20}));
  EXPECT_EQ(r1.actual_seq_qlen, (V{4, 8, 14, 20}));
  EXPECT_EQ(r0.actual_seq_kvlen, (V{4, 20, 26, 50}));
  EXPECT_EQ(r1.actual_seq_kvlen, (V{8, 20, 32, 50}));
  EXPECT_EQ(r0.cu_seqlens_q, (V{0, 4, 8, 14, 20}));
  EXPECT_EQ(r0.cu_seqlens_kv, (V{0, 4, 20, 26, 50}));
  EXPECT_EQ(r0.kv_gather_index, cat({iota(0, 3), iota(0, 3), iota(20, 27), iota(4, 7), iota(8, 13),
                                     iota(8, 13), iota(28, 39), iota(14, 19)}));
  // The same keys as runs of the gathered buffer: chunks 1 and 2 of a document sit side by
  // side on rank 1 and merge into one run.
  ASSERT_EQ(r0.work.tasks.size(), 4u);
  const auto runs_of = [&](const RankPlan& p, std::size_t t) {
    std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
    for (int64_t i = p.work.tasks[t].run_begin; i < p.work.tasks[t].run_end; ++i)
      out.emplace_back(p.work.runs[i].row, p.work.runs[i].len, p.work.runs[i].pos);
    return out;
  };
  using R = std::tuple<int64_t, int64_t, int64_t>;
  EXPECT_THAT(runs_of(r0, 0), ElementsAre(R{0, 4, 0}));
  EXPECT_THAT(runs_of(r0, 1), ElementsAre(R{0, 4, 0}, R{20, 8, 4}, R{4, 4, 12}));
  EXPECT_THAT(runs_of(r0, 2), ElementsAre(R{8, 6, 0}));
  EXPECT_THAT(runs_of(r0, 3), ElementsAre(R{8, 6, 0}, R{28, 12, 6}, R{14, 6, 18}));
  EXPECT_EQ(r0.work.tasks[1].q_row, 4);
  EXPECT_EQ(r0.work.tasks[1].q_pos, 12);
  EXPECT_EQ(r0.work.tasks[3].doc, 1);
  // Work: no padding, so every query and key is real: (2cp+1) c^2 and (2cp-1) c^2 + c(c+1)
  // per document, on both ranks (c = 4 and 6).
  for (const RankPlan* p : {&r0, &r1}) {
    EXPECT_EQ(p->workload.rect_work, 5 * 16 + 5 * 36);
    EXPECT_EQ(p->workload.visible_pairs, (3 * 16 + 4 * 5) + (3 * 36 + 6 * 7));
  }
}

TEST(Plan, PaddedWorkCountsRealPairsOnly) {
  // Lengths 5 and 1 at cp = 2 (see PaddedDocumentsHoldPaddingAtTheirTails): chunks 2 and 1.
  // Per task, q_real = queries below the real length, kv_real = keys below it:
  //   rank 0: doc 0 chunk 0 (pos 0,1 over keys 0,1): q 2, kv 2, rect 4, pairs 1+2 = 3;
  //           doc 0 chunk 3 (pos 6,7: padding):      q 0, rect 0, pairs 0;
  //           doc 1 chunk 0 (pos 0 over key 0):      q 1, kv 1, rect 1, pairs 1;
  //           doc 1 chunk 3 (pos 3: padding):        0.            total rect 5, pairs 4.
  //   rank 1: doc 0 chunk 1 (pos 2,3 over keys 0-3): q 2, kv 4, rect 8, pairs 3+4 = 7;
  //           doc 0 chunk 2 (pos 4 real, 5 padding, keys 0-5 of which 0-4 real):
  //                                                  q 1, kv 5, rect 5, pairs 5;
  //           doc 1 chunks 1, 2 (pos 1, 2: padding): 0.            total rect 13, pairs 12.
  // Together 4 + 12 = 16 = 5*6/2 + 1*2/2, every real causal pair once. (Counting padded
  // chunks whole, as before, gave rect 25 and pairs 23 on both ranks.)
  const V cu{0, 5, 6};
  const RankPlan r0 = get_thd_load_balanced_cp_metadata(cu, 2, 0);
  const RankPlan r1 = get_thd_load_balanced_cp_metadata(cu, 2, 1);
  EXPECT_EQ(r0.workload.rect_work, 5);
  EXPECT_EQ(r0.workload.visible_pairs, 4);
  EXPECT_EQ(r1.workload.rect_work, 13);
  EXPECT_EQ(r1.workload.visible_pairs, 12);
  // The same as the work the CP layer runs: the tasks with padding cut out.
  for (const RankPlan* p : {&r0, &r1}) {
    const WorkList w = without_padding(*p, p->work);
    int64_t rect = 0;
    for (const AttnTask& t : w.tasks)
      for (int64_t i = t.run_begin; i < t.run_end; ++i) rect += t.q_len * w.runs[i].len;
    EXPECT_EQ(rect, p->workload.rect_work);
  }
}

// The public cases: every document's query lengths (c, c), key lengths
// ((r+1)c, (2cp-r)c).
void expect_public_case(const V& ends, int cp) {
  V cu{0};
  cu.insert(cu.end(), ends.begin(), ends.end());
  for (int r = 0; r < cp; ++r) {
    const RankPlan p = get_thd_load_balanced_cp_metadata(cu, cp, r);
    V q{0}, kv{0};
    for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
      const int64_t c = (cu[d + 1] - cu[d]) / (2 * cp);
      q.push_back(q.back() + c);
      q.push_back(q.back() + c);
      kv.push_back(kv.back() + (r + 1) * c);
      kv.push_back(kv.back() + (2 * cp - r) * c);
    }
    EXPECT_EQ(p.cu_seqlens_q, q) << "cp " << cp << " rank " << r;
    EXPECT_EQ(p.cu_seqlens_kv, kv) << "cp " << cp << " rank " << r;
    EXPECT_EQ(p.local_tokens, ends.back() / cp);
    EXPECT_EQ(p.padding_tokens, 0);
  }
}

TEST(Plan, PublicCaseCp2) { expect_public_case({16, 40, 72}, 2); }
TEST(Plan, PublicCaseCp4) { expect_public_case({32, 80, 144}, 4); }

TEST(Plan, PaddedDocumentsHoldPaddingAtTheirTails) {
  // Lengths 5 and 1 at cp = 2: padded to 8 and 4, chunks of 2 and 1.
  const V cu{0, 5, 6};
  const RankPlan r0 = get_thd_load_balanced_cp_metadata(cu, 2, 0);
  const RankPlan r1 = get_thd_load_balanced_cp_metadata(cu, 2, 1);
  EXPECT_EQ(r0.cu_seqlens_padded, (V{0, 8, 12}));
  EXPECT_EQ(r0.local_tokens, 6);
  // rank 0: doc 0 chunks 0 (pos 0,1) and 3 (pos 6,7: padding); doc 1 chunks 0 (pos 0) and 3.
  EXPECT_EQ(r0.global_token_index, (V{0, 1, 6, 7, 8, 11}));
  EXPECT_EQ(r0.real_token_index, (V{0, 1, -1, -1, 5, -1}));
  EXPECT_EQ(r0.padding_tokens, 3);
  // rank 1: doc 0 chunks 1 (pos 2,3) and 2 (pos 4: real, 5: padding); doc 1 chunks 1 and 2.
  EXPECT_EQ(r1.real_token_index, (V{2, 3, 4, -1, -1, -1}));
  EXPECT_EQ(r1.padding_tokens, 3);
}

TEST(Plan, CpOneIsOneTaskPerDocumentWithoutPadding) {
  static_assert(chunks_per_document(1) == 1 && tasks_per_document(1) == 1);
  static_assert(chunks_per_document(2) == 4 && tasks_per_document(2) == 2);
  const RankPlan p = get_thd_load_balanced_cp_metadata(V{0, 3}, 1, 0);
  // No padding at cp = 1: one chunk of 3, queries [0,3) over keys [0,3).
  EXPECT_EQ(p.cu_seqlens_padded, (V{0, 3}));
  EXPECT_EQ(p.local_tokens, 3);
  EXPECT_EQ(p.padding_tokens, 0);
  EXPECT_EQ(p.docs[0].chunk, 3);
  EXPECT_EQ(p.actual_seq_qlen, (V{3}));
  EXPECT_EQ(p.actual_seq_kvlen, (V{3}));
  EXPECT_EQ(p.kv_gather_index, (V{0, 1, 2}));
  EXPECT_EQ(p.real_token_index, (V{0, 1, 2}));
  EXPECT_EQ(p.workload.rect_work, 3 * 3);
  EXPECT_EQ(p.workload.visible_pairs, 1 + 2 + 3);
}

TEST(Plan, CpOneIsTheSingleProcessVarlenCall) {
  // Documents of 16 and 25 tokens (25 would be padded to 28 at cp = 2; at cp = 1 nothing is):
  // the plan is FlashAttention's varlen call on the batch as it is.
  const V cu{0, 16, 41};
  const RankPlan p = get_thd_load_balanced_cp_metadata(cu, 1, 0);
  EXPECT_EQ(p.global_tokens_padded, 41);
  EXPECT_EQ(p.local_tokens, 41);
  EXPECT_EQ(p.padding_tokens, 0);
  EXPECT_EQ(p.cu_seqlens_padded, cu);
  EXPECT_EQ(p.cu_seqlens_q, cu);
  EXPECT_EQ(p.cu_seqlens_kv, cu);
  EXPECT_EQ(p.actual_seq_qlen, (V{16, 41}));
  EXPECT_EQ(p.actual_seq_kvlen, (V{16, 41}));
  EXPECT_EQ(p.global_token_index, iota(0, 40));
  EXPECT_EQ(p.real_token_index, iota(0, 40));
  EXPECT_EQ(p.kv_gather_index, iota(0, 40));
  ASSERT_EQ(p.work.tasks.size(), 2u);
  ASSERT_EQ(p.work.runs.size(), 2u);
  EXPECT_EQ(p.work.tasks[1].q_row, 16);
  EXPECT_EQ(p.work.tasks[1].q_len, 25);
  EXPECT_EQ(p.work.tasks[1].q_pos, 0);
  EXPECT_EQ(p.work.runs[1].row, 16);
  EXPECT_EQ(p.work.runs[1].len, 25);
  // rect 16^2 + 25^2 = 256 + 625 = 881; pairs 16*17/2 + 25*26/2 = 136 + 325 = 461.
  EXPECT_EQ(p.workload.rect_work, 881);
  EXPECT_EQ(p.workload.visible_pairs, 461);
  // Nothing to cut.
  const WorkList w = without_padding(p, p.work);
  ASSERT_EQ(w.tasks.size(), 2u);
  for (std::size_t t = 0; t < 2; ++t) {
    EXPECT_EQ(w.tasks[t].q_len, p.work.tasks[t].q_len);
    EXPECT_EQ(w.runs[t].len, p.work.runs[t].len);
  }
  // The balance report agrees, and at cp = 1 the contiguous split is the same split.
  const BalanceReport b = balance_report(cu, 1);
  ASSERT_EQ(b.ranks.size(), 1u);
  EXPECT_EQ(b.padded_tokens, 41);
  EXPECT_EQ(b.ranks[0].tasks, 2);
  EXPECT_EQ(b.ranks[0].padding_tokens, 0);
  EXPECT_EQ(b.ranks[0].balanced.rect_work, 881);
  EXPECT_EQ(b.ranks[0].balanced.visible_pairs, 461);
  EXPECT_EQ(b.ranks[0].contiguous.rect_work, 881);
  EXPECT_EQ(b.ranks[0].contiguous.visible_pairs, 461);
  EXPECT_DOUBLE_EQ(b.imbalance_balanced, 1.0);
}

void expect_same_plan(const RankPlan& a, const RankPlan& b) {
  EXPECT_EQ(a.cp, b.cp);
  EXPECT_EQ(a.rank, b.rank);
  EXPECT_EQ(a.global_tokens, b.global_tokens);
  EXPECT_EQ(a.global_tokens_padded, b.global_tokens_padded);
  EXPECT_EQ(a.local_tokens, b.local_tokens);
  EXPECT_EQ(a.padding_tokens, b.padding_tokens);
  EXPECT_EQ(a.cu_seqlens, b.cu_seqlens);
  EXPECT_EQ(a.cu_seqlens_padded, b.cu_seqlens_padded);
  EXPECT_EQ(a.global_token_index, b.global_token_index);
  EXPECT_EQ(a.real_token_index, b.real_token_index);
  EXPECT_EQ(a.cu_seqlens_q, b.cu_seqlens_q);
  EXPECT_EQ(a.cu_seqlens_kv, b.cu_seqlens_kv);
  EXPECT_EQ(a.actual_seq_qlen, b.actual_seq_qlen);
  EXPECT_EQ(a.actual_seq_kvlen, b.actual_seq_kvlen);
  EXPECT_EQ(a.kv_gather_index, b.kv_gather_index);
  ASSERT_EQ(a.work.tasks.size(), b.work.tasks.size());
  ASSERT_EQ(a.work.runs.size(), b.work.runs.size());
  for (std::size_t i = 0; i < a.work.runs.size(); ++i) {
    EXPECT_EQ(a.work.runs[i].row, b.work.runs[i].row);
    EXPECT_EQ(a.work.runs[i].len, b.work.runs[i].len);
    EXPECT_EQ(a.work.runs[i].pos, b.work.runs[i].pos);
  }
  EXPECT_EQ(a.workload.rect_work, b.workload.rect_work);
  EXPECT_EQ(a.workload.visible_pairs, b.workload.visible_pairs);
}

// One RankPlan planned into again and again (every rank of a batch in turn keeps the batch's
// layout; another batch, cp or split, or a call that failed, builds it anew): each time the
// plan a fresh RankPlan gets. Also the layout itself, whose reuse the fields above would miss.
TEST(Plan, AReusedPlanIsTheFreshPlanWhateverItHeldBefore) {
  const V a{0, 5, 6, 40, 41}, b{0, 37, 38, 100};
  RankPlan reused;
  const auto expect_fresh = [&](const V& cu, int cp, int rank, CpSplit split) {
    SCOPED_TRACE(::testing::Message() << "documents " << cu.size() - 1 << " cp " << cp << " rank " << rank
                                      << " split " << to_string(split));
    get_thd_load_balanced_cp_metadata(cu, cp, rank, PlanOptions{.split = split}, reused);
    const RankPlan fresh = get_thd_load_balanced_cp_metadata(cu, cp, rank, PlanOptions{.split = split});
    expect_same_plan(reused, fresh);
    EXPECT_EQ(reused.split, fresh.split);
    EXPECT_EQ(reused.layout.rank_begin, fresh.layout.rank_begin);
    ASSERT_EQ(reused.docs.size(), fresh.docs.size());
    for (std::size_t d = 0; d < fresh.docs.size(); ++d) {  // (local_begin is the rank's)
      EXPECT_EQ(reused.docs[d].local_begin, fresh.docs[d].local_begin);
      EXPECT_EQ(reused.docs[d].padded_len, fresh.docs[d].padded_len);
    }
    ASSERT_EQ(reused.layout.chunks.size(), fresh.layout.chunks.size());
    for (std::size_t i = 0; i < fresh.layout.chunks.size(); ++i) {
      EXPECT_EQ(reused.layout.chunks[i].pos, fresh.layout.chunks[i].pos);
      EXPECT_EQ(reused.layout.chunks[i].len, fresh.layout.chunks[i].len);
      EXPECT_EQ(reused.layout.chunks[i].rank, fresh.layout.chunks[i].rank);
    }
  };
  for (const CpSplit split : {CpSplit::padded, CpSplit::padding_free})
    for (const int cp : {2, 3})
      for (const V* cu : {&a, &b})
        for (int r = 0; r < cp; ++r) expect_fresh(*cu, cp, r, split);
  expect_fresh(a, 3, 1, CpSplit::padded);
  expect_fresh(a, 2, 1, CpSplit::padded);        // another cp
  expect_fresh(a, 2, 1, CpSplit::padding_free);  // another split
  expect_fresh(V{0, 5, 6, 40}, 2, 0, CpSplit::padding_free);  // a prefix of the batch held
  EXPECT_THROW(get_thd_load_balanced_cp_metadata(V{0, 5, 5}, 2, 0, {}, reused), Error);
  expect_fresh(a, 2, 1, CpSplit::padded);
  // After a failed call, empty boundaries are checked (they matched the cleared boundaries and
  // returned the batch held before, reading back() of an empty span).
  EXPECT_THROW(get_thd_load_balanced_cp_metadata(V{0, 5, 5}, 2, 0, {}, reused), Error);
  EXPECT_THROW(get_thd_load_balanced_cp_metadata(V{}, 2, 0, {}, reused), Error);
  expect_fresh(b, 2, 0, CpSplit::padded);
  // The plan's own boundaries, at another cp: read before they are replaced, and not after
  // (one document: its last boundary was read from the freed storage; ASan sees it).
  for (const V& batch : {b, V{0, 100}}) {
    expect_fresh(batch, 2, 0, CpSplit::padded);
    const V own = reused.cu_seqlens;
    get_thd_load_balanced_cp_metadata(reused.cu_seqlens, 3, 2, PlanOptions{}, reused);
    expect_same_plan(reused, get_thd_load_balanced_cp_metadata(own, 3, 2, PlanOptions{}));
    EXPECT_EQ(reused.cu_seqlens, own);
    EXPECT_EQ(reused.global_tokens, own.back());
  }
  // A batch whose layout fails after its documents were split (the padding-free split of a
  // document past 2^32 tokens), then the batch held before: planned anew, not the failed
  // batch's documents beside the held boundaries.
  expect_fresh(a, 2, 1, CpSplit::padding_free);
  EXPECT_THROW(get_thd_load_balanced_cp_metadata(V{0, int64_t{1} << 33}, 2, 1, PlanOptions{.split = CpSplit::padding_free},
                                                 reused),
               Error);
  expect_fresh(a, 2, 1, CpSplit::padding_free);
}

TEST(Plan, Int32BoundariesGiveTheInt64Plan) {
  const std::vector<int32_t> cu32{0, 5, 6, 40, 41};
  const V cu64{0, 5, 6, 40, 41};
  for (const int cp : {1, 2, 3}) {
    for (int r = 0; r < cp; ++r) {
      SCOPED_TRACE(::testing::Message() << "cp " << cp << " rank " << r);
      expect_same_plan(get_thd_load_balanced_cp_metadata(cu32, cp, r),
                       get_thd_load_balanced_cp_metadata(cu64, cp, r));
    }
    const BalanceReport b32 = balance_report(cu32, cp), b64 = balance_report(cu64, cp);
    EXPECT_EQ(b32.padded_tokens, b64.padded_tokens);
    ASSERT_EQ(b32.ranks.size(), b64.ranks.size());
    for (std::size_t r = 0; r < b32.ranks.size(); ++r) {
      EXPECT_EQ(b32.ranks[r].padding_tokens, b64.ranks[r].padding_tokens);
      EXPECT_EQ(b32.ranks[r].balanced.visible_pairs, b64.ranks[r].balanced.visible_pairs);
      EXPECT_EQ(b32.ranks[r].balanced.rect_work, b64.ranks[r].balanced.rect_work);
      EXPECT_EQ(b32.ranks[r].contiguous.visible_pairs, b64.ranks[r].contiguous.visible_pairs);
    }
    EXPECT_EQ(b32.imbalance_balanced, b64.imbalance_balanced);
    EXPECT_EQ(b32.imbalance_contiguous, b64.imbalance_contiguous);
  }
  // int32 errors are the int64 ones.
  try {
    get_thd_load_balanced_cp_metadata(std::vector<int32_t>{0, 8, 8}, 2, 0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("cu_seqlens[1] = 8 and cu_seqlens[2] = 8"));
  }
  EXPECT_THROW(balance_report(std::vector<int32_t>{1, 8}, 2), Error);
}

TEST(Plan, BadArgumentsAreNamed) {
  const V cu{0, 8};
  EXPECT_THROW(get_thd_load_balanced_cp_metadata(V{0, 8, 8}, 2, 0), Error);
  try {
    get_thd_load_balanced_cp_metadata(cu, 2, 2);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("rank must be in [0, cp) = [0, 2), got 2"));
  }
  try {
    get_thd_load_balanced_cp_metadata(cu, 0, 0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("cp must be >= 1, got 0"));
  }
}

// One document of 2^47 tokens: the rank's index arrays (2.5 PB, past any address space, so
// even an overcommitting kernel refuses them) cannot be allocated; the plan says so with the
// sizes (it was a bare std::bad_alloc).
TEST(Plan, ABatchPastMemoryIsAnErrorWithItsSizes) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizers' allocators end the process on a request this large instead of failing it";
#else
  try {
    get_thd_load_balanced_cp_metadata(V{0, int64_t{1} << 47}, 2, 0);
    FAIL() << "a plan of 2^47 tokens was allocated";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("plan of rank 0 of cp 2 for 140737488355328 tokens: its 70368744177664 "
                                       "token indices (x2) and 175921860444160 key gather indices"));
    EXPECT_THAT(e.message(), HasSubstr("could not be allocated"));
  }
#endif
}

TEST(Plan, RowsGoToTheirRankAndBack) {
  const V cu{0, 5, 6, 13};
  const int cp = 3;
  const int64_t row = 3;  // three floats per token
  std::vector<float> global(13 * row);
  std::iota(global.begin(), global.end(), 1.0f);
  std::vector<float> back(global.size(), -1.0f);
  for (int r = 0; r < cp; ++r) {
    const RankPlan p = get_thd_load_balanced_cp_metadata(cu, cp, r);
    std::vector<float> local(p.local_tokens * row, 99.0f);
    take_local_rows(global.data(), row * 4, p, local.data());
    for (int64_t i = 0; i < p.local_tokens; ++i)
      for (int64_t e = 0; e < row; ++e)
        EXPECT_EQ(local[i * row + e],
                  p.real_token_index[i] < 0 ? 0.0f : global[p.real_token_index[i] * row + e]);
    put_local_rows(local.data(), row * 4, p, back.data());
  }
  EXPECT_EQ(back, global);
}

TEST(Balance, WorkedExampleAgainstTheContiguousSplit) {
  const BalanceReport b = balance_report(V{0, 16, 40}, 2);
  ASSERT_EQ(b.ranks.size(), 2u);
  EXPECT_EQ(b.padding_tokens(), 0);
  EXPECT_DOUBLE_EQ(b.imbalance_balanced, 1.0);
  // Contiguous: rank 0 holds tokens 0-19 (doc 0, and doc 1 positions 0-3), rank 1 positions
  // 4-23 of doc 1. Visible pairs: 136 + 10 = 146 against sum(5..24) = 290; max/mean = 290/218.
  EXPECT_EQ(b.ranks[0].contiguous.visible_pairs, 146);
  EXPECT_EQ(b.ranks[1].contiguous.visible_pairs, 290);
  EXPECT_EQ(b.ranks[0].contiguous.rect_work, 16 * 16 + 4 * 4);
  EXPECT_EQ(b.ranks[1].contiguous.rect_work, 20 * 24);
  EXPECT_DOUBLE_EQ(b.imbalance_contiguous, 290.0 / 218.0);
  // No padding: the balanced split is exact, 260 rect and 218 pairs on both ranks.
  for (const RankBalance& r : b.ranks) {
    EXPECT_EQ(r.balanced.rect_work, 80 + 180);
    EXPECT_EQ(r.balanced.visible_pairs, 218);
  }
  EXPECT_EQ(b.ranks[0].tasks, 4);
}

TEST(Balance, WorkThatOverflowsInt64IsAnErrorNotAWrongNumber) {
  // Found by fuzz_cli: one document of 4.4e9 tokens has more attention pairs than int64 holds.
  try {
    balance_report(V{0, 6, 6 + 4444444448}, 1);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("work count overflows int64"));
  }
  EXPECT_THROW(get_thd_load_balanced_cp_metadata(V{0, (int64_t{1} << 48) + 1}, 1, 0), Error);
  EXPECT_THROW(balance_report(V{0, 8}, kMaxCp + 1), Error);
}

TEST(Balance, PaddingOverhead) {
  const BalanceReport b = balance_report(V{0, 5, 6}, 2);
  EXPECT_EQ(b.real_tokens, 6);
  EXPECT_EQ(b.padded_tokens, 12);
  EXPECT_EQ(b.padding_tokens(), 6);
  EXPECT_DOUBLE_EQ(b.padding_percent(), 100.0);
  EXPECT_EQ(b.ranks[0].padding_tokens, 3);
  EXPECT_EQ(b.ranks[1].padding_tokens, 3);  // see PaddedDocumentsHoldPaddingAtTheirTails
  // Real work only (see PaddedWorkCountsRealPairsOnly): rank 0 holds the padded last chunks.
  EXPECT_EQ(b.ranks[0].balanced.rect_work, 5);
  EXPECT_EQ(b.ranks[0].balanced.visible_pairs, 4);
  EXPECT_EQ(b.ranks[1].balanced.rect_work, 13);
  EXPECT_EQ(b.ranks[1].balanced.visible_pairs, 12);
  // max / mean = 12 / ((4 + 12) / 2) = 1.5, inside the bound sum P(P+1) / sum L(L+1)
  // = (8*9 + 4*5) / (5*6 + 1*2) = 92 / 32 (tiny documents, so a loose bound).
  EXPECT_DOUBLE_EQ(b.imbalance_balanced, 1.5);
  EXPECT_LE(b.imbalance_balanced, 92.0 / 32.0);
}

// Past 2^31 tokens (4.3 billion here, two documents of more than 2^31 each): the split and
// the balance report from the boundaries alone, against sums worked out in 128-bit integers.
// Real work only: per document of length l and chunk c, rank r's chunks j = r and 2cp-1-r
// hold q = clamp(l - j*c, 0, c) real queries at positions j*c .. j*c+q-1, each seeing its
// own prefix: q*(j*c) + q(q+1)/2 visible pairs, and q * min((j+1)*c, l) rect work. Without
// padding that is (2cp-1)c^2 + c(c+1) on every rank; the padding (2cp - l mod 2cp tokens, at
// the tail) costs the ranks holding the last chunks a little.
__extension__ typedef __int128 I128;  // GCC and Clang; -Wpedantic accepts it marked so

TEST(Balance, BatchesPast2To31TokensUse64BitArithmetic) {
  const int64_t big = (int64_t{1} << 31) + 13;
  const V lengths{big, 1, big + 13, 5};
  V cu{0};
  for (const int64_t l : lengths) cu.push_back(cu.back() + l);
  ASSERT_GT(cu.back(), int64_t{1} << 32);
  for (const int cp : {3, 4}) {
    SCOPED_TRACE(cp);
    const std::vector<DocSplit> docs = split_documents(cu, cp);
    ASSERT_EQ(docs.size(), lengths.size());
    I128 padded_total = 0, real_pairs = 0, padded_pairs = 0, real_sq = 0;
    std::vector<I128> rank_pairs(cp, 0), rank_rect(cp, 0);
    for (std::size_t d = 0; d < lengths.size(); ++d) {
      const I128 l = lengths[d];
      const I128 p = (l + 2 * cp - 1) / (2 * cp) * (2 * cp);
      const I128 c = p / (2 * cp);
      EXPECT_EQ(docs[d].begin, cu[d]);
      EXPECT_EQ(docs[d].padded_begin, static_cast<int64_t>(padded_total));
      EXPECT_EQ(docs[d].padded_len, static_cast<int64_t>(p));
      EXPECT_EQ(docs[d].chunk, static_cast<int64_t>(c));
      EXPECT_EQ(docs[d].local_begin, static_cast<int64_t>(padded_total / cp));
      padded_total += p;
      real_pairs += l * (l + 1) / 2;
      real_sq += l * (l + 1);
      padded_pairs += p * (p + 1);
      for (int r = 0; r < cp; ++r) {
        for (const I128 j : {I128{r}, I128{2 * cp - 1 - r}}) {
          const I128 q = std::clamp<I128>(l - j * c, 0, c);
          rank_pairs[r] += q * (j * c) + q * (q + 1) / 2;
          rank_rect[r] += q * std::min<I128>((j + 1) * c, l);
        }
      }
    }
    const BalanceReport b = balance_report(cu, cp);
    EXPECT_EQ(b.real_tokens, cu.back());
    EXPECT_EQ(b.padded_tokens, static_cast<int64_t>(padded_total));
    ASSERT_EQ(static_cast<int>(b.ranks.size()), cp);
    I128 contiguous_pairs = 0, balanced_pairs = 0, max_pairs = 0;
    for (const RankBalance& r : b.ranks) {
      EXPECT_EQ(r.local_tokens, static_cast<int64_t>(padded_total / cp));
      EXPECT_EQ(r.balanced.visible_pairs, static_cast<int64_t>(rank_pairs[r.rank]));
      EXPECT_EQ(r.balanced.rect_work, static_cast<int64_t>(rank_rect[r.rank]));
      contiguous_pairs += r.contiguous.visible_pairs;
      balanced_pairs += r.balanced.visible_pairs;
      max_pairs = std::max<I128>(max_pairs, r.balanced.visible_pairs);
    }
    EXPECT_TRUE(contiguous_pairs == real_pairs);
    EXPECT_TRUE(balanced_pairs == real_pairs);  // every real causal pair on exactly one rank
    // Rank 0 holds the padded last chunks: it does the least, and some rank more than the mean.
    EXPECT_TRUE(rank_pairs[0] < max_pairs);
    EXPECT_DOUBLE_EQ(b.imbalance_balanced, static_cast<double>(max_pairs) /
                                               (static_cast<double>(real_pairs) / cp));
    EXPECT_GT(b.imbalance_balanced, 1.0);
    EXPECT_LE(b.imbalance_balanced, static_cast<double>(padded_pairs) / static_cast<double>(real_sq));
    EXPECT_LT(b.imbalance_balanced, 1.0 + 1e-8);  // 2^31-token documents: padding is noise
    EXPECT_GT(b.imbalance_contiguous, 1.1);
  }
}

}  // namespace
}  // namespace cpattn
