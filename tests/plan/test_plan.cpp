// The worked examples of DESIGN.md sections 3-4 and the public cases, value by value.
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

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
  // Work: (2cp+1) c^2 and (2cp-1) c^2 + c(c+1) per document, on both ranks.
  for (const RankPlan* p : {&r0, &r1}) {
    EXPECT_EQ(p->workload.rect_work, 5 * 16 + 5 * 36);
    EXPECT_EQ(p->workload.visible_pairs, (3 * 16 + 4 * 5) + (3 * 36 + 6 * 7));
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

TEST(Plan, CpOneIsOneTaskPairPerDocumentOverItsPrefix) {
  const RankPlan p = get_thd_load_balanced_cp_metadata(V{0, 3}, 1, 0);
  // padded to 4, chunk 2: front [0,2) over keys [0,2), back [2,4) over keys [0,4).
  EXPECT_EQ(p.actual_seq_qlen, (V{2, 4}));
  EXPECT_EQ(p.actual_seq_kvlen, (V{2, 6}));
  EXPECT_EQ(p.kv_gather_index, (V{0, 1, 0, 1, 2, 3}));
  EXPECT_EQ(p.real_token_index, (V{0, 1, 2, -1}));
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
  EXPECT_EQ(b.ranks[0].balanced.visible_pairs, b.ranks[1].balanced.visible_pairs);
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
}

// Past 2^31 tokens (4.3 billion here, two documents of more than 2^31 each): the split and
// the balance report from the boundaries alone, against sums worked out in 128-bit integers.
// Per document of chunk c, rank r's chunks r and 2cp-1-r hold c*(r*c) + c(c+1)/2 and
// c*((2cp-1-r)*c) + c(c+1)/2 visible pairs: (2cp-1)c^2 + c(c+1), the same on every rank.
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
    I128 padded_total = 0, pairs_per_rank = 0, real_pairs = 0;
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
      pairs_per_rank += (2 * cp - 1) * c * c + c * (c + 1);
      real_pairs += l * (l + 1) / 2;
    }
    const BalanceReport b = balance_report(cu, cp);
    EXPECT_EQ(b.real_tokens, cu.back());
    EXPECT_EQ(b.padded_tokens, static_cast<int64_t>(padded_total));
    ASSERT_EQ(static_cast<int>(b.ranks.size()), cp);
    I128 contiguous_pairs = 0;
    for (const RankBalance& r : b.ranks) {
      EXPECT_EQ(r.local_tokens, static_cast<int64_t>(padded_total / cp));
      EXPECT_EQ(r.balanced.visible_pairs, static_cast<int64_t>(pairs_per_rank));
      contiguous_pairs += r.contiguous.visible_pairs;
    }
    EXPECT_TRUE(contiguous_pairs == real_pairs);
    EXPECT_DOUBLE_EQ(b.imbalance_balanced, 1.0);
    EXPECT_GT(b.imbalance_contiguous, 1.1);
  }
}

}  // namespace
}  // namespace cpattn
