#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <algorithm>

#include "plan_math.hpp"

namespace cpattn {

double BalanceReport::padding_percent() const {
  return real_tokens == 0 ? 0.0 : 100.0 * static_cast<double>(padding_tokens()) / static_cast<double>(real_tokens);
}

namespace {

double max_over_mean(const std::vector<RankBalance>& ranks, Workload RankBalance::*which) {
  int64_t max = 0;
  double sum = 0;
  for (const RankBalance& r : ranks) {
    max = std::max(max, (r.*which).visible_pairs);
    sum += static_cast<double>((r.*which).visible_pairs);
  }
  const double mean = sum / static_cast<double>(ranks.size());
  return mean > 0 ? static_cast<double>(max) / mean : 1.0;
}

// The guarantee of each split, as max / mean of visible pairs (plan.hpp's BalanceReport).
double imbalance_bound(std::span<const int64_t> cu, const SplitLayout& layout, int64_t pairs) {
  if (pairs == 0) return 1.0;
  if (layout.split == CpSplit::padding_free)
    return 1.0 + static_cast<double>(layout.cp - 1) * static_cast<double>(layout.max_doc_spread) /
                     static_cast<double>(pairs);
  double padded = 0;  // sum P(P+1) / sum L(L+1)
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    const auto p = static_cast<double>(padded_length(cu[d + 1] - cu[d], layout.cp));
    padded += p * (p + 1) / (2 * static_cast<double>(pairs));
  }
  return padded;
}

}  // namespace

BalanceReport balance_report(std::span<const int64_t> cu_seqlens, int cp, CpSplit split) {
  const SplitLayout layout = split_layout(cu_seqlens, cp, split);
  BalanceReport report;
  report.cp = cp;
  report.split = split;
  report.real_tokens = cu_seqlens.back();
  report.padded_tokens = layout.rank_begin.back();
  report.ranks.resize(cp);
  for (int r = 0; r < cp; ++r) {
    report.ranks[r].rank = r;
    report.ranks[r].local_tokens = layout.rank_tokens(r);
  }
  // Every chunk is one task of its rank: queries [pos, pos + len) over keys [0, pos + len),
  // positions at or past the document's length (padding) cut out of both.
  const int64_t n = chunks_per_document(cp);
  int64_t pairs = 0, longest = 0;
  for (std::size_t d = 0; d + 1 < cu_seqlens.size(); ++d) {
    const int64_t len = cu_seqlens[d + 1] - cu_seqlens[d];
    detail::checked_add(pairs, detail::checked_visible_pairs(0, len, len));
    longest = std::max(longest, len);
    for (int64_t m = 0; m < n; ++m) {
      const DocChunk& c = layout.chunks[d * n + m];
      RankBalance& rb = report.ranks[c.rank];
      rb.padding_tokens += std::clamp<int64_t>(c.pos + c.len - std::max(len, c.pos), 0, c.len);
      rb.tasks += c.len > 0;
      const Workload real = detail::real_task_work(c.pos, c.len, c.pos + c.len, len);
      detail::checked_add(rb.balanced.rect_work, real.rect_work);
      detail::checked_add(rb.balanced.visible_pairs, real.visible_pairs);
    }
  }
  for (int r = 0; r < cp; ++r) {
    RankBalance& rb = report.ranks[r];
    // The plain split: real tokens [r*T/cp, (r+1)*T/cp), each query seeing its document's
    // prefix; as one kernel task per document piece, keys 0 .. last query.
    const int64_t t = report.real_tokens;
    const int64_t lo = r * t / cp, hi = (r + 1) * t / cp;
    rb.contiguous_tokens = hi - lo;
    auto d = std::upper_bound(cu_seqlens.begin(), cu_seqlens.end(), lo) - cu_seqlens.begin() - 1;
    for (; lo < hi && d + 1 < static_cast<std::ptrdiff_t>(cu_seqlens.size()); ++d) {
      const int64_t a = std::max(lo, cu_seqlens[d]) - cu_seqlens[d];
      const int64_t b = std::min(hi, cu_seqlens[d + 1]) - cu_seqlens[d];
      if (a >= b) break;
      detail::checked_add(rb.contiguous.rect_work, detail::checked_mul(b - a, b));
      detail::checked_add(rb.contiguous.visible_pairs, detail::checked_visible_pairs(a, b - a, b));
    }
  }
  report.imbalance_balanced = max_over_mean(report.ranks, &RankBalance::balanced);
  report.imbalance_contiguous = max_over_mean(report.ranks, &RankBalance::contiguous);
  report.imbalance_bound = imbalance_bound(cu_seqlens, layout, pairs);
  const double mean = static_cast<double>(pairs) / cp;
  const int64_t lower = std::max((pairs + cp - 1) / cp, longest);
  report.imbalance_lower_bound = pairs == 0 ? 1.0 : std::max(1.0, static_cast<double>(lower) / mean);
  return report;
}

BalanceReport balance_report(std::span<const int32_t> cu_seqlens, int cp, CpSplit split) {
  const std::vector<int64_t> wide = widen_boundaries(cu_seqlens);
  return balance_report(std::span<const int64_t>(wide), cp, split);
}

}  // namespace cpattn
