// The data side: get_batch_on_this_cp_rank against a hand-worked example and against the
// planner's own token mapping on random batches.
#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace cpattn {
namespace {

using V = std::vector<int64_t>;

// A packed batch as a data loader makes it: labels are the next token inside a document and
// kIgnoreIndex on a document's last token; positions restart at every document.
TokenBatch make_batch(const V& cu) {
  TokenBatch b;
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    for (int64_t i = cu[d]; i < cu[d + 1]; ++i) {
      b.tokens.push_back(1000 + i);
      b.labels.push_back(i + 1 < cu[d + 1] ? 1000 + i + 1 : kIgnoreIndex);
      b.position_ids.push_back(i - cu[d]);
      b.loss_mask.push_back(i + 1 < cu[d + 1] ? 1.0f : 0.0f);
    }
  }
  return b;
}

TEST(Batch, HandWorkedPaddedExample) {
  // Documents of 5 and 1 tokens, cp = 2: padded to 8 (chunks of 2) and 4 (chunks of 1).
  const V cu{0, 5, 6};
  const TokenBatch g = make_batch(cu);
  const TokenBatch r0 = get_batch_on_this_cp_rank(g, cu, 2, 0, /*pad_token_id=*/7);
  EXPECT_EQ(r0.tokens, (V{1000, 1001, 7, 7, 1005, 7}));
  EXPECT_EQ(r0.labels, (V{1001, 1002, -100, -100, -100, -100}));
  EXPECT_EQ(r0.position_ids, (V{0, 1, 6, 7, 0, 3}));
  EXPECT_EQ(r0.loss_mask, (std::vector<float>{1, 1, 0, 0, 0, 0}));
  const TokenBatch r1 = get_batch_on_this_cp_rank(g, cu, 2, 1, 7);
  EXPECT_EQ(r1.tokens, (V{1002, 1003, 1004, 7, 7, 7}));
  EXPECT_EQ(r1.labels, (V{1003, 1004, -100, -100, -100, -100}));
  EXPECT_EQ(r1.position_ids, (V{2, 3, 4, 5, 1, 2}));
  EXPECT_EQ(r1.loss_mask, (std::vector<float>{1, 1, 0, 0, 0, 0}));
}

TEST(Batch, CpOneReturnsTheBatchAsItIs) {
  // No padding at cp = 1: every array comes back unchanged (lengths 5, 1, 6 would be padded
  // to 8, 4, 8 at cp = 2).
  const V cu{0, 5, 6, 12};
  const TokenBatch g = make_batch(cu);
  const TokenBatch l = get_batch_on_this_cp_rank(g, cu, 1, 0, /*pad_token_id=*/7);
  EXPECT_EQ(l.tokens, g.tokens);
  EXPECT_EQ(l.labels, g.labels);
  EXPECT_EQ(l.position_ids, g.position_ids);
  EXPECT_EQ(l.loss_mask, g.loss_mask);
}

TEST(Batch, RealTokensKeepEverythingPaddingIsIgnored) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    V cu{0};
    const int docs = 1 + static_cast<int>(rng() % 20);
    for (int d = 0; d < docs; ++d) cu.push_back(cu.back() + 1 + static_cast<int64_t>(rng() % 90));
    const int cp = 1 + static_cast<int>(rng() % 6);
    const TokenBatch g = make_batch(cu);
    int64_t real_seen = 0;
    for (int r = 0; r < cp; ++r) {
      const RankPlan p = get_thd_load_balanced_cp_metadata(cu, cp, r);
      const TokenBatch l = get_batch_on_this_cp_rank(g, cu, cp, r);
      ASSERT_EQ(static_cast<int64_t>(l.tokens.size()), p.local_tokens);
      // From the plan (no second plan): the same arrays.
      const TokenBatch from_plan = get_batch_on_this_cp_rank(g, p);
      ASSERT_EQ(from_plan.tokens, l.tokens);
      ASSERT_EQ(from_plan.labels, l.labels);
      ASSERT_EQ(from_plan.position_ids, l.position_ids);
      ASSERT_EQ(from_plan.loss_mask, l.loss_mask);
      for (int64_t i = 0; i < p.local_tokens; ++i) {
        const int64_t gi = p.real_token_index[i];
        // Positions continue through padding: the position is the padded index's offset
        // in its document, for real and padding tokens alike.
        const auto d = std::upper_bound(p.cu_seqlens_padded.begin(), p.cu_seqlens_padded.end(),
                                        p.global_token_index[i]) - p.cu_seqlens_padded.begin() - 1;
        ASSERT_EQ(l.position_ids[i], p.global_token_index[i] - p.cu_seqlens_padded[d]);
        if (gi >= 0) {
          ++real_seen;
          ASSERT_EQ(l.tokens[i], g.tokens[gi]);
          ASSERT_EQ(l.labels[i], g.labels[gi]);
          ASSERT_EQ(l.loss_mask[i], g.loss_mask[gi]);
        } else {
          ASSERT_EQ(l.labels[i], kIgnoreIndex);
          ASSERT_EQ(l.loss_mask[i], 0.0f);
        }
      }
    }
    ASSERT_EQ(real_seen, cu.back());
  }
}

TEST(Batch, ArraysMustMatchTheBoundaries) {
  const V cu{0, 4};
  TokenBatch b = make_batch(cu);
  b.labels.pop_back();
  EXPECT_THROW(get_batch_on_this_cp_rank(b, cu, 2, 0), Error);
  EXPECT_THROW(get_batch_on_this_cp_rank(make_batch(cu), cu, 2, 2), Error);
}

}  // namespace
}  // namespace cpattn
