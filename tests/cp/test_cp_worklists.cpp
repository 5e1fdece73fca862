// The per-block work lists of the ring and pass-Q schemes (src/cp/cp_internal.hpp): cut to the
// mask and the sliding window, they keep every visible (query, key) pair exactly once and
// leave the blocks that the window hides without work, so that those steps are skipped.
#include "../src/cp/cp_internal.hpp"

#include <cpattn/cp_scheme.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace cpattn::cp_detail {
namespace {

bool visible(int64_t qp, int64_t kp, const AttnOptions& o) {
  if (o.window_size_left >= 0 && kp < qp - o.window_size_left) return false;
  if (o.mask == MaskType::causal) return kp <= qp;
  return o.window_size_right < 0 || kp <= qp + o.window_size_right;
}

struct Census {
  int64_t pairs = 0;       // visible pairs inside the lists' runs
  int64_t keys = 0;        // key rows the lists hold (over all tasks)
  int64_t busy_steps = 0;  // (rank, block) lists with a task
};

// Every rank's lists over every rank's block.
Census census(const std::vector<int64_t>& cu, int cp, const AttnOptions& o) {
  Census c;
  for (int r = 0; r < cp; ++r) {
    const RankPlan p = get_thd_load_balanced_cp_metadata(cu, cp, r);
    const WorkList keys = without_padding(p, keys_for_mask(p, o.mask));
    for (int block = 0; block < cp; ++block) {
      const WorkList w = work_on_block(p, keys, o, block);
      c.busy_steps += !w.tasks.empty();
      for (const AttnTask& t : w.tasks)
        for (int64_t i = t.run_begin; i < t.run_end; ++i) {
          const KeyRun& k = w.runs[i];
          EXPECT_GE(k.row, 0);
          EXPECT_LE(k.row + k.len, p.local_tokens) << "a run leaves its block";
          c.keys += k.len;
          for (int64_t qp = t.q_pos; qp < t.q_pos + t.q_len; ++qp)
            for (int64_t kp = k.pos; kp < k.pos + k.len; ++kp) c.pairs += visible(qp, kp, o);
        }
    }
  }
  return c;
}

// The visible pairs of the batch, document by document.
int64_t dense_pairs(const std::vector<int64_t>& cu, const AttnOptions& o) {
  int64_t n = 0;
  for (std::size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t qp = 0; qp < cu[d + 1] - cu[d]; ++qp)
      for (int64_t kp = 0; kp < cu[d + 1] - cu[d]; ++kp) n += visible(qp, kp, o);
  return n;
}

TEST(CpWorkLists, EveryVisiblePairOnceUnderEveryMaskAndWindow) {
  const std::vector<int64_t> lengths{37, 100, 1, 64, 23, 9, 3};
  const std::vector<int64_t> cu = cu_seqlens_from_lengths(lengths);
  const AttnOptions opts[] = {{.mask = MaskType::causal},
                              {.mask = MaskType::none},
                              {.mask = MaskType::causal, .window_size_left = 0},
                              {.mask = MaskType::causal, .window_size_left = 7},
                              {.mask = MaskType::causal, .window_size_left = 40},
                              {.mask = MaskType::none, .window_size_left = 5, .window_size_right = 5},
                              {.mask = MaskType::none, .window_size_left = -1, .window_size_right = 2},
                              {.mask = MaskType::none, .window_size_left = 30, .window_size_right = -1}};
  for (const int cp : {1, 2, 3, 4})
    for (const AttnOptions& o : opts) {
      SCOPED_TRACE(::testing::Message() << "cp " << cp << " window " << o.window_size_left << ","
                                        << o.window_size_right << (o.mask == MaskType::causal ? " causal" : " none"));
      EXPECT_EQ(census(cu, cp, o).pairs, dense_pairs(cu, o));
    }
}

// ranks_seeing_block (the chunk table alone) against planning every rank and asking its work
// list over the block: the same for every (rank, block), mask and window, on batches with
// 1-token documents, documents shorter than 2 cp (padding chunks) and long ones, cp 1..5.
TEST(CpWorkLists, RanksSeeingABlockAgreeWithEveryRanksPlan) {
  const std::vector<std::vector<int64_t>> batches{{37, 100, 1, 64, 23, 9, 3}, {1}, {1, 1, 2, 5}, {300}, {7, 1, 250}};
  const AttnOptions opts[] = {{.mask = MaskType::causal},
                              {.mask = MaskType::none},
                              {.mask = MaskType::causal, .window_size_left = 0},
                              {.mask = MaskType::causal, .window_size_left = 6},
                              {.mask = MaskType::none, .window_size_left = 3, .window_size_right = 3},
                              {.mask = MaskType::none, .window_size_left = -1, .window_size_right = 0},
                              {.mask = MaskType::none, .window_size_left = 0, .window_size_right = -1}};
  int64_t hidden = 0, seen = 0;  // both answers occur (the comparison can fail either way)
  for (const std::vector<int64_t>& lengths : batches)
    for (const int cp : {1, 2, 3, 4, 5})
      for (const AttnOptions& o : opts) {
        const std::vector<int64_t> cu = cu_seqlens_from_lengths(lengths);
        std::vector<RankPlan> plans;
        for (int r = 0; r < cp; ++r) plans.push_back(get_thd_load_balanced_cp_metadata(cu, cp, r));
        for (int block = 0; block < cp; ++block) {
          const std::vector<char> sees = ranks_seeing_block(plans[static_cast<std::size_t>(block)], o, block);
          ASSERT_EQ(sees.size(), static_cast<std::size_t>(cp));
          for (int q = 0; q < cp; ++q) {
            const RankPlan& p = plans[static_cast<std::size_t>(q)];
            const bool planned = !work_on_block(p, without_padding(p, keys_for_mask(p, o.mask)), o, block).tasks.empty();
            EXPECT_EQ(sees[static_cast<std::size_t>(q)] != 0, planned)
                << "cp " << cp << " block " << block << " rank " << q << " window " << o.window_size_left << ","
                << o.window_size_right << (o.mask == MaskType::causal ? " causal" : " none") << " docs "
                << lengths.size();
            (planned ? seen : hidden) += 1;
          }
        }
      }
  EXPECT_GT(hidden, 0);
  EXPECT_GT(seen, 0);
}

TEST(CpWorkLists, BlocksTheWindowHidesGetNoWork) {
  // One document of 160 tokens at cp = 4: chunks of 20. Causal without a window, every rank's
  // back chunk sees every rank's front chunk: all 16 (rank, block) lists are busy. A window of
  // 0 keeps each query's own key, in its own chunk: only the 4 own blocks. A window of 5
  // reaches into the previous chunk: chunks 1..7 each reach chunk j - 1, another rank's except
  // for chunk 4 (rank 3's, as chunk 3 is): 4 + 6 = 10.
  const std::vector<int64_t> cu{0, 160};
  const Census all = census(cu, 4, {.mask = MaskType::causal});
  const Census own = census(cu, 4, {.mask = MaskType::causal, .window_size_left = 0});
  const Census near = census(cu, 4, {.mask = MaskType::causal, .window_size_left = 5});
  EXPECT_EQ(all.busy_steps, 16);
  EXPECT_EQ(own.busy_steps, 4);
  EXPECT_EQ(near.busy_steps, 10);
  // The runs are cut to the window: each task of 20 queries holds its 20 own keys and, with a
  // window of 5, 5 keys of the chunk before (8 tasks, 7 with a chunk before).
  EXPECT_EQ(own.keys, 8 * 20);
  EXPECT_EQ(near.keys, 8 * 20 + 7 * 5);
}

// document_order_moves (the all-gather scheme's copy into document order): over random batches
// (many 1-token documents, one long one) at cp = 1..8, both splits, the moves cover every
// gathered row and every ordered row exactly once (backward's dK/dV buffers are resized, not
// zeroed, relying on it), each chunk's rows land at their document's rows in position order,
// and cp = 1 needs no move (nor any plan whose gathered rows already are in document order).
TEST(CpDocumentOrder, MovesCoverEveryRowOnceAndPutEachChunkAtItsPosition) {
  std::mt19937_64 rng(15);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<int64_t> cu{0};
    const int docs = 1 + static_cast<int>(rng() % 12);
    for (int d = 0; d < docs; ++d) {
      const uint64_t kind = rng() % 4;
      const int64_t len = kind == 0 ? 1 : kind == 3 && d == 0 ? 300 + static_cast<int64_t>(rng() % 700)
                                                              : 1 + static_cast<int64_t>(rng() % 40);
      cu.push_back(cu.back() + len);
    }
    for (const CpSplit split : {CpSplit::padded, CpSplit::padding_free})
      for (int cp = 1; cp <= 8; ++cp) {
        SCOPED_TRACE(::testing::Message() << "trial " << trial << " cp " << cp << " split " << to_string(split));
        const RankPlan p = get_thd_load_balanced_cp_metadata(cu, cp, trial % cp, PlanOptions{.split = split});
        const int64_t rows = p.layout.rank_begin.back();
        std::vector<RowMove> moves = document_order_moves(p);
        EXPECT_TRUE(cp > 1 || moves.empty()) << "one rank's gathered rows are in document order already";
        // No move: the gathered rows already are in document order (checked below as the
        // identity move; e.g. the padding-free split with every document on one rank).
        if (moves.empty()) moves.push_back({.gathered = 0, .ordered = 0, .len = rows});
        std::vector<int> from(static_cast<std::size_t>(rows)), to(static_cast<std::size_t>(rows));
        std::vector<int64_t> ordered_of(static_cast<std::size_t>(rows), -1);
        for (const RowMove& m : moves) {
          ASSERT_GE(m.gathered, 0);
          ASSERT_GE(m.ordered, 0);
          ASSERT_LE(m.gathered + m.len, rows);
          ASSERT_LE(m.ordered + m.len, rows);
          for (int64_t i = 0; i < m.len; ++i) {
            ++from[m.gathered + i];
            ++to[m.ordered + i];
            ordered_of[m.gathered + i] = m.ordered + i;
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          ASSERT_EQ(from[r], 1) << "gathered row " << r;
          ASSERT_EQ(to[r], 1) << "ordered row " << r;
        }
        // Each chunk from its rank's rows to its document's rows at its position.
        const int64_t n = chunks_per_document(cp);
        for (std::size_t d = 0; d < p.docs.size(); ++d)
          for (int64_t c = 0; c < n; ++c) {
            const DocChunk& ch = p.layout.chunks[d * n + c];
            for (int64_t i = 0; i < ch.len; ++i)
              ASSERT_EQ(ordered_of[p.layout.gathered_row(ch) + i], p.docs[d].padded_begin + ch.pos + i)
                  << "document " << d << " chunk " << c;
          }
      }
  }
}

// The overlap's work per document in closed form against the pairs counted one by one.
TEST(CpWorkLists, DocumentPairsAreTheVisiblePairsOfEveryMaskAndWindow) {
  const std::pair<int64_t, int64_t> windows[] = {{-1, -1}, {0, 0}, {1, -1}, {-1, 2}, {3, 2}, {5, 0}, {200, 200}};
  for (const int64_t len : {1, 2, 3, 7, 64, 129})
    for (const MaskType mask : {MaskType::causal, MaskType::none})
      for (const auto& [left, right] : windows) {
        AttnOptions o;
        o.mask = mask;
        o.window_size_left = left;
        o.window_size_right = right;
        EXPECT_EQ(document_pairs(len, mask == MaskType::causal, left, right),
                  static_cast<double>(dense_pairs({0, len}, o)))
            << "len " << len << " causal " << (mask == MaskType::causal) << " window " << left << "," << right;
      }
  EXPECT_EQ(document_pairs(0, true, -1, -1), 0.0);
}

// Hand-worked cuts: the small group's share nearest 1/4 within [1/16, 1/2].
TEST(CpWorkLists, OverlapDocumentCutsByHand) {
  const auto cut = [](std::vector<double> w, bool small_first) { return overlap_document_cut(w, small_first); };
  EXPECT_EQ(cut({1, 1, 1, 1}, true).cut, 1);  // [1 | 1 1 1]: 1/4
  EXPECT_EQ(cut({1, 1, 1, 1}, false).cut, 3);
  EXPECT_DOUBLE_EQ(cut({1, 1, 1, 1}, false).share, 0.25);
  // total 31: prefixes 3, 4, 8 (8/31 = 0.258), 9, 14, 23; suffixes 6, 8 (0.258), 17 (over 1/2)
  EXPECT_EQ(cut({3, 1, 4, 1, 5, 9, 2, 6}, true).cut, 3);
  EXPECT_EQ(cut({3, 1, 4, 1, 5, 9, 2, 6}, false).cut, 6);
  EXPECT_DOUBLE_EQ(cut({3, 1, 4, 1, 5, 9, 2, 6}, true).share, 8.0 / 31);
  // No cut: one document; the first (last) holds most of the work; the rest under 1/16.
  EXPECT_EQ(cut({5}, true).cut, 0);
  EXPECT_EQ(cut({100, 1, 1}, true).cut, 0);
  EXPECT_EQ(cut({1, 1, 100}, false).cut, 0);
  EXPECT_EQ(cut({100, 1, 1}, false).cut, 0);  // 2/102 < 1/16
  EXPECT_EQ(cut({100, 1, 1}, false).share, 0.0);
  // A sliding window makes long documents' work linear in their length: the cut moves.
  const std::vector<int64_t> lens{4000, 1000, 1000, 1000, 1000};
  const auto work = [&](int64_t left) {
    std::vector<double> w;
    for (const int64_t l : lens) w.push_back(document_pairs(l, true, left, -1));
    return w;
  };
  // Causal: the last four documents hold 0.2 of the work (a 1000-token document 0.05).
  EXPECT_EQ(overlap_document_cut(work(-1), false).cut, 1);
  // Window 128 wide: a document's work is about 128 len, the last two hold 0.244.
  EXPECT_EQ(overlap_document_cut(work(127), false).cut, 3);
}

// The CP layer's cut from a plan: by the pairs the mask and window leave, not by len^2; and the
// units' order it and the simulator share.
TEST(CpWorkLists, TheLayersCutFollowsTheWindowAndTheUnitsTheirOrder) {
  const std::vector<int64_t> cu = cu_seqlens_from_lengths(std::vector<int64_t>{400, 100, 100, 100, 100});
  for (const int cp : {2, 3}) {
    const RankPlan p = get_thd_load_balanced_cp_metadata(cu, cp, 0);
    AttnOptions o;  // causal: the last four documents hold 0.20 of the pairs (3 of them 0.15)
    EXPECT_EQ(overlap_doc_cut(p, o, false), 1);
    EXPECT_EQ(overlap_doc_cut(p, o, true), 0);  // the first document holds 0.80
    o.window_size_left = 15;                    // 16 keys at most: the last two hold 0.243
    EXPECT_EQ(overlap_doc_cut(p, o, false), 3);
    EXPECT_EQ(overlap_doc_cut(p, o, true), 0);  // 0.515: over 1/2
  }
  const auto order = [](int groups, bool cut, bool backward) {
    std::vector<std::pair<int, int>> v;
    for (const OverlapUnit& u : overlap_units(groups, cut, backward)) v.emplace_back(u.group, u.part);
    return v;
  };
  using V = std::vector<std::pair<int, int>>;
  EXPECT_EQ(order(3, true, false), (V{{0, 0}, {0, 1}, {1, -1}, {2, -1}}));
  EXPECT_EQ(order(3, true, true), (V{{0, -1}, {1, -1}, {2, 0}, {2, 1}}));
  EXPECT_EQ(order(1, true, true), (V{{0, 0}, {0, 1}}));
  EXPECT_EQ(order(2, false, false), (V{{0, -1}, {1, -1}}));
}

// Named rows: the union of every task's runs, sorted and merged, whatever the tasks' order.
TEST(CpWorkLists, NamedKeyRowsAreTheRunsUnion) {
  WorkList w;
  w.runs = {{.row = 10, .len = 5}, {.row = 0, .len = 3}, {.row = 3, .len = 2}, {.row = 12, .len = 10}, {.row = 30, .len = 1}};
  w.tasks = {{.q_len = 1, .run_begin = 0, .run_end = 2}, {.q_len = 1, .run_begin = 2, .run_end = 5},
             {.q_len = 1, .run_begin = 0, .run_end = 1}};
  const std::vector<std::pair<int64_t, int64_t>> want{{0, 5}, {10, 22}, {30, 31}};
  EXPECT_EQ(named_key_rows(w), want);
  EXPECT_TRUE(named_key_rows(WorkList{}).empty());
}

}  // namespace
}  // namespace cpattn::cp_detail
