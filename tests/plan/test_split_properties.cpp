// The padding-free split (plan.hpp, docs/planner.md "The padding-free split"): a hand-worked
// example, then its invariants as properties over random boundaries at cp = 2..16, checked
// against a brute-force count of every token of every rank.
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

namespace cpattn {
namespace {

constexpr PlanOptions kFree{.split = CpSplit::padding_free};

TEST(SplitPaddingFree, HandWorkedTwoDocumentsOfFive) {
  // cp = 2, 4 chunks of 1 token per document and 1 extra. The extra at the front gives slot 0
  // (chunks 0, 3) positions 0,1 and 4: pairs 1+2+5 = 8, slot 1 positions 2,3: 3+4 = 7 (in the
  // middle: 6 and 9, at the back: 10 and 5; the front is the most even). Document 0: slot 0
  // to rank 0 (loads tie); document 1: slot 0 (8) to rank 1, the less loaded (7): 15 and 15.
  const std::vector<int64_t> cu{0, 5, 10};
  const RankPlan r0 = get_thd_load_balanced_cp_metadata(cu, 2, 0, kFree);
  const RankPlan r1 = get_thd_load_balanced_cp_metadata(cu, 2, 1, kFree);
  EXPECT_EQ(r0.real_token_index, (std::vector<int64_t>{0, 1, 4, 7, 8}));
  EXPECT_EQ(r1.real_token_index, (std::vector<int64_t>{2, 3, 5, 6, 9}));
  EXPECT_EQ(r0.layout.rank_begin, (std::vector<int64_t>{0, 5, 10}));
  EXPECT_EQ(r0.padding_tokens + r1.padding_tokens, 0);
  EXPECT_EQ(r0.workload.visible_pairs, 15);
  EXPECT_EQ(r1.workload.visible_pairs, 15);
  EXPECT_EQ(r0.layout.max_doc_spread, 1);
  // Rank 1's back chunk of document 1 (position 4) reads the whole document: rank 1's rows
  // 2,3 (positions 0,1) sit at gathered rows 7,8, then rank 0's rows 3,4 (positions 2,3) at
  // 3,4, then its own row 4 at 9.
  EXPECT_EQ(r1.cu_seqlens_q, (std::vector<int64_t>{0, 1, 2, 4, 5}));
  EXPECT_EQ(r1.cu_seqlens_kv, (std::vector<int64_t>{0, 3, 7, 9, 14}));
  EXPECT_EQ(std::vector<int64_t>(r1.kv_gather_index.end() - 5, r1.kv_gather_index.end()),
            (std::vector<int64_t>{7, 8, 3, 4, 9}));
  const BalanceReport b = balance_report(cu, 2, CpSplit::padding_free);
  EXPECT_EQ(b.padded_tokens, 10);
  EXPECT_DOUBLE_EQ(b.imbalance_balanced, 1.0);
  EXPECT_DOUBLE_EQ(b.imbalance_bound, 1.0 + 1.0 / 30.0);  // 1 + (cp-1) * spread / pairs
  EXPECT_DOUBLE_EQ(b.imbalance_lower_bound, 1.0);
  EXPECT_EQ(balance_report(cu, 2).padded_tokens, 16);  // the padded split: 5 -> 8 twice
}

TEST(SplitPaddingFree, EqualWorkKeepsThePaddedSplit) {
  // Documents that need no padding give every slot the same work: the loads tie after every
  // document, and slot s goes to rank s, as in the padded split.
  const std::vector<int64_t> cu{0, 16, 40};
  for (int r = 0; r < 2; ++r) {
    const RankPlan a = get_thd_load_balanced_cp_metadata(cu, 2, r);
    const RankPlan b = get_thd_load_balanced_cp_metadata(cu, 2, r, kFree);
    EXPECT_EQ(a.real_token_index, b.real_token_index);
    EXPECT_EQ(a.kv_gather_index, b.kv_gather_index);
    EXPECT_EQ(b.split, CpSplit::padding_free);
  }
}

// Every invariant of the split for one batch, against brute force.
void check_split(const std::vector<int64_t>& cu, int cp) {
  const int64_t total = cu.back(), docs = static_cast<int64_t>(cu.size()) - 1, n = 2 * int64_t{cp};
  std::vector<RankPlan> plans;
  for (int r = 0; r < cp; ++r) plans.push_back(get_thd_load_balanced_cp_metadata(cu, cp, r, kFree));
  const SplitLayout& layout = plans[0].layout;
  std::vector<int64_t> doc_of(static_cast<std::size_t>(total));
  for (int64_t d = 0; d < docs; ++d) std::fill(doc_of.begin() + cu[d], doc_of.begin() + cu[d + 1], d);

  // The chunk sizes: floor(L / 2cp) or one more, the larger ones consecutive, tiling the
  // document in order; chunks s and 2cp-1-s on one rank, every rank holding one such slot.
  int64_t spread = 0;
  for (int64_t d = 0; d < docs; ++d) {
    const int64_t len = cu[d + 1] - cu[d], b = len / n;
    const DocChunk* ch = layout.chunks.data() + d * n;
    int64_t pos = 0, big_first = -1, big_last = -1;
    std::vector<int> slots_of_rank(cp, 0);
    std::vector<int64_t> slot_pairs(cp, 0);
    for (int64_t m = 0; m < n; ++m) {
      ASSERT_EQ(ch[m].pos, pos);
      ASSERT_TRUE(ch[m].len == b || ch[m].len == b + 1) << "doc " << d << " chunk " << m;
      if (ch[m].len == b + 1) {
        if (big_first < 0) big_first = m;
        ASSERT_TRUE(big_last < 0 || big_last == m - 1) << "larger chunks not consecutive";
        big_last = m;
      }
      ASSERT_EQ(ch[m].rank, ch[n - 1 - m].rank);
      if (m < cp) ++slots_of_rank[ch[m].rank];
      for (int64_t p = ch[m].pos; p < ch[m].pos + ch[m].len; ++p) slot_pairs[std::min(m, n - 1 - m)] += p + 1;
      pos += ch[m].len;
    }
    ASSERT_EQ(pos, len);
    for (int r = 0; r < cp; ++r) ASSERT_EQ(slots_of_rank[r], 1);
    spread = std::max(spread, *std::max_element(slot_pairs.begin(), slot_pairs.end()) -
                                  *std::min_element(slot_pairs.begin(), slot_pairs.end()));
  }
  EXPECT_EQ(layout.max_doc_spread, spread);

  // Every token on exactly one rank, no padding, document order kept (each rank's tokens in
  // increasing global order), and the rank-major gathered buffer.
  std::vector<int> owners(static_cast<std::size_t>(total), 0);
  std::vector<int64_t> gathered;
  for (int r = 0; r < cp; ++r) {
    const RankPlan& p = plans[r];
    ASSERT_EQ(p.layout.rank_begin, layout.rank_begin);
    ASSERT_EQ(p.local_tokens, layout.rank_tokens(r));
    ASSERT_EQ(layout.rank_begin[r], static_cast<int64_t>(gathered.size()));
    EXPECT_EQ(p.padding_tokens, 0);
    EXPECT_EQ(p.global_token_index, p.real_token_index);
    for (int64_t i = 0; i < p.local_tokens; ++i) {
      const int64_t g = p.real_token_index[i];
      ASSERT_TRUE(g >= 0 && g < total);
      ++owners[g];
      if (i > 0) {
        ASSERT_LT(p.real_token_index[i - 1], g) << "rank " << r << " row " << i;
      }
    }
    gathered.insert(gathered.end(), p.real_token_index.begin(), p.real_token_index.end());
  }
  for (int64_t g = 0; g < total; ++g) ASSERT_EQ(owners[g], 1) << "token " << g;

  // The work lists: each task's queries are consecutive positions of one document, and its
  // keys (runs and gather index alike) that document's positions 0 .. its last query.
  int64_t max_pairs = 0, all_pairs = 0;
  for (int r = 0; r < cp; ++r) {
    const RankPlan& p = plans[r];
    int64_t visible = 0, rows = 0;
    for (std::size_t t = 0; t < p.work.tasks.size(); ++t) {
      const AttnTask& task = p.work.tasks[t];
      ASSERT_GE(task.q_len, 1);
      rows += task.q_len;
      for (int64_t i = 0; i < task.q_len; ++i) {
        const int64_t g = p.real_token_index[task.q_row + i];
        ASSERT_EQ(doc_of[g], task.doc);
        ASSERT_EQ(g - cu[task.doc], task.q_pos + i);
        visible += task.q_pos + i + 1;
      }
      int64_t k = 0;
      for (int64_t ri = task.run_begin; ri < task.run_end; ++ri) {
        const KeyRun& run = p.work.runs[ri];
        ASSERT_GE(run.len, 1);
        ASSERT_EQ(run.pos, k);
        for (int64_t e = 0; e < run.len; ++e, ++k) {
          ASSERT_EQ(gathered[run.row + e], cu[task.doc] + k);
          ASSERT_EQ(gathered[p.kv_gather_index[p.work_indexed.runs[t].row + k]], cu[task.doc] + k);
        }
      }
      ASSERT_EQ(k, task.q_pos + task.q_len);
      ASSERT_EQ(p.work_indexed.runs[t].len, k);
    }
    ASSERT_EQ(rows, p.local_tokens);  // the tasks tile the local rows
    EXPECT_EQ(p.workload.visible_pairs, visible);
    max_pairs = std::max(max_pairs, visible);
    all_pairs += visible;
  }
  int64_t real_pairs = 0, longest = 0;
  for (int64_t d = 0; d < docs; ++d) {
    const int64_t len = cu[d + 1] - cu[d];
    real_pairs += len * (len + 1) / 2;
    longest = std::max(longest, len);
  }
  EXPECT_EQ(all_pairs, real_pairs);
  // The guarantee: max <= mean + (cp - 1) / cp * spread, and the report says so.
  EXPECT_LE(max_pairs * cp, real_pairs + (cp - 1) * spread);
  const BalanceReport b = balance_report(cu, cp, CpSplit::padding_free);
  EXPECT_EQ(b.padded_tokens, total);
  for (int r = 0; r < cp; ++r) {
    EXPECT_EQ(b.ranks[r].balanced.visible_pairs, plans[r].workload.visible_pairs);
    EXPECT_EQ(b.ranks[r].local_tokens, plans[r].local_tokens);
    EXPECT_EQ(b.ranks[r].tasks, static_cast<int64_t>(plans[r].work.tasks.size()));
  }
  const double mean = static_cast<double>(real_pairs) / cp;
  EXPECT_DOUBLE_EQ(b.imbalance_balanced, static_cast<double>(max_pairs) / mean);
  EXPECT_LE(b.imbalance_balanced, b.imbalance_bound * (1 + 1e-12));
  EXPECT_GE(b.imbalance_balanced * (1 + 1e-12), b.imbalance_lower_bound);
  EXPECT_GE(static_cast<double>(max_pairs) * (1 + 1e-12), static_cast<double>(longest));
}

std::vector<int64_t> random_boundaries(std::mt19937_64& rng, int64_t max_docs, double max_len) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const auto docs = std::max<int64_t>(1, static_cast<int64_t>(std::exp(u(rng) * std::log(double(max_docs)))));
  std::vector<int64_t> cu{0};
  for (int64_t d = 0; d < docs; ++d) cu.push_back(cu.back() + static_cast<int64_t>(std::exp(u(rng) * std::log(max_len))));
  return cu;
}

TEST(SplitPaddingFree, RandomBatchesCp2To16) {
  std::mt19937_64 rng(20261201);
  for (int cp = 2; cp <= 16; ++cp)
    for (int b = 0; b < 8; ++b) {
      const std::vector<int64_t> cu = random_boundaries(rng, 120, 3000.0);
      SCOPED_TRACE(::testing::Message() << "cp " << cp << " batch " << b << " docs " << cu.size() - 1);
      check_split(cu, cp);
      if (::testing::Test::HasFailure()) return;
    }
}

TEST(SplitPaddingFree, OneTokenDocumentsAndOneHugeOne) {
  for (const int cp : {2, 3, 7, 16}) {
    SCOPED_TRACE(::testing::Message() << "cp " << cp);
    check_split({0, 1}, cp);
    std::vector<int64_t> many{0};
    for (int i = 0; i < 301; ++i) many.push_back(many.back() + 1);
    check_split(many, cp);
    check_split({0, 100003}, cp);
    many.push_back(many.back() + 5000);  // one long document after the 1-token ones
    check_split(many, cp);
  }
}

// The first padding-free planner, kept as the reference of the faster one (which works each
// document length out once, and sorts the ranks from the last document's order): for every
// document, the three cuts (extras at the front, the middle, the back: the most even slot work,
// ties to the earlier), the slots heaviest first to the ranks least loaded first, both by stable
// sorts from 0..cp-1.
SplitLayout reference_padding_free_layout(const std::vector<int64_t>& cu, int cp) {
  const int64_t n = 2 * int64_t{cp};
  SplitLayout out;
  out.split = CpSplit::padding_free;
  out.cp = cp;
  std::vector<int64_t> load(cp, 0), rows(cp, 0);
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t len = cu[d + 1] - cu[d], b = len / n, e = len % n;
    // Chunk m's length and position when the e longer chunks start at chunk e0.
    const auto chunk_len = [&](int64_t e0, int64_t m) { return b + (m >= e0 && m < e0 + e ? 1 : 0); };
    const auto slot_work = [&](int64_t e0) {
      std::vector<int64_t> w(cp, 0);
      for (int64_t m = 0, pos = 0; m < n; pos += chunk_len(e0, m), ++m)
        for (int64_t i = 0; i < chunk_len(e0, m); ++i) w[std::min(m, n - 1 - m)] += pos + i + 1;
      return w;
    };
    const auto spread = [](const std::vector<int64_t>& w) {
      return *std::max_element(w.begin(), w.end()) - *std::min_element(w.begin(), w.end());
    };
    int64_t best_e0 = 0;
    std::vector<int64_t> work = slot_work(0);
    if (e != 0)
      for (const int64_t e0 : {(n - e) / 2, n - e})
        if (const std::vector<int64_t> w = slot_work(e0); spread(w) < spread(work)) {
          work = w;
          best_e0 = e0;
        }
    out.max_doc_spread = std::max(out.max_doc_spread, spread(work));
    std::vector<int> slots(cp), ranks(cp), rank_of_slot(cp);
    std::iota(slots.begin(), slots.end(), 0);
    std::iota(ranks.begin(), ranks.end(), 0);
    std::stable_sort(slots.begin(), slots.end(), [&](int x, int y) { return work[x] > work[y]; });
    std::stable_sort(ranks.begin(), ranks.end(), [&](int x, int y) { return load[x] < load[y]; });
    for (int i = 0; i < cp; ++i) {
      rank_of_slot[slots[i]] = ranks[i];
      load[ranks[i]] += work[slots[i]];
    }
    for (int64_t m = 0, pos = 0; m < n; ++m) {
      const int r = rank_of_slot[std::min(m, n - 1 - m)];
      const int64_t c = chunk_len(best_e0, m);
      out.chunks.push_back(DocChunk{.pos = pos, .len = c, .local_row = rows[r], .rank = r});
      rows[r] += c;
      pos += c;
    }
  }
  out.rank_begin.assign(1, 0);
  for (int r = 0; r < cp; ++r) out.rank_begin.push_back(out.rank_begin.back() + rows[r]);
  return out;
}

void expect_reference_layout(const std::vector<int64_t>& cu, int cp) {
  const SplitLayout got = split_layout(cu, cp, CpSplit::padding_free), want = reference_padding_free_layout(cu, cp);
  ASSERT_EQ(got.chunks.size(), want.chunks.size());
  for (std::size_t i = 0; i < got.chunks.size(); ++i) {
    const DocChunk &g = got.chunks[i], &w = want.chunks[i];
    ASSERT_TRUE(g.pos == w.pos && g.len == w.len && g.local_row == w.local_row && g.rank == w.rank)
        << "chunk " << i << " (document " << i / (2 * cp) << "): got pos " << g.pos << " len " << g.len << " row "
        << g.local_row << " rank " << g.rank << ", the first planner's pos " << w.pos << " len " << w.len << " row "
        << w.local_row << " rank " << w.rank;
  }
  EXPECT_EQ(got.rank_begin, want.rank_begin);
  EXPECT_EQ(got.max_doc_spread, want.max_doc_spread);
}

TEST(SplitPaddingFree, SameChunkTableAsTheFirstPlanner) {
  std::mt19937_64 rng(15);
  for (int cp = 2; cp <= 16; ++cp) {
    SCOPED_TRACE(::testing::Message() << "cp " << cp);
    for (int b = 0; b < 6; ++b) expect_reference_layout(random_boundaries(rng, 400, 3000.0), cp);
    // Lengths repeated many times (each worked out once), 1-token documents among them, and
    // documents past the lengths worked out once (16384 tokens) between them.
    std::vector<int64_t> cu{0};
    for (int d = 0; d < 600; ++d) {
      const int64_t len = d % 97 == 0 ? 16384 + static_cast<int64_t>(rng() % 40000) : 1 + static_cast<int64_t>(rng() % 40);
      cu.push_back(cu.back() + len);
    }
    expect_reference_layout(cu, cp);
    if (::testing::Test::HasFailure()) return;
  }
  // More lengths than the memo holds at cp = 64 (262144 slots: 4096 lengths): the lengths past
  // it are worked out every time, in shuffled order, and then repeated.
  std::vector<int64_t> lengths;
  for (int64_t len = 1; len <= 4400; ++len) lengths.push_back(len);
  std::shuffle(lengths.begin(), lengths.end(), rng);
  lengths.insert(lengths.end(), lengths.begin(), lengths.begin() + 400);
  SCOPED_TRACE("cp 64, 4400 lengths");
  expect_reference_layout(cu_seqlens_from_lengths(lengths), 64);
}

TEST(SplitPaddingFree, CpOneIsThePaddedPlan) {
  const std::vector<int64_t> cu{0, 3, 10};
  const RankPlan a = get_thd_load_balanced_cp_metadata(cu, 1, 0);
  const RankPlan b = get_thd_load_balanced_cp_metadata(cu, 1, 0, kFree);
  EXPECT_EQ(a.kv_gather_index, b.kv_gather_index);
  EXPECT_EQ(a.real_token_index, b.real_token_index);
  EXPECT_EQ(b.padding_tokens, 0);
}

TEST(SplitPaddingFree, BatchFollowsTheSplit) {
  const std::vector<int64_t> cu{0, 5, 10};
  TokenBatch batch;
  for (int64_t i = 0; i < 10; ++i) {
    batch.tokens.push_back(100 + i);
    batch.labels.push_back(200 + i);
    batch.position_ids.push_back(i % 5);
    batch.loss_mask.push_back(1.0f);
  }
  const TokenBatch r1 = get_batch_on_this_cp_rank(batch, cu, 2, 1, 0, kFree);
  EXPECT_EQ(r1.tokens, (std::vector<int64_t>{102, 103, 105, 106, 109}));
  EXPECT_EQ(r1.position_ids, (std::vector<int64_t>{2, 3, 0, 1, 4}));
  EXPECT_EQ(r1.labels, (std::vector<int64_t>{202, 203, 205, 206, 209}));
}

}  // namespace
}  // namespace cpattn
