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

}  // namespace

BalanceReport balance_report(std::span<const int64_t> cu_seqlens, int cp) {
  const std::vector<DocSplit> docs = split_documents(cu_seqlens, cp);
  BalanceReport report;
  report.cp = cp;
  report.real_tokens = cu_seqlens.back();
  report.padded_tokens = docs.back().padded_begin + docs.back().padded_len;
  report.ranks.resize(cp);
  for (int r = 0; r < cp; ++r) {
    RankBalance& rb = report.ranks[r];
    rb.rank = r;
    rb.local_tokens = report.padded_tokens / cp;
    rb.tasks = tasks_per_document(cp) * static_cast<int64_t>(docs.size());
    for (const DocSplit& s : docs) {
      for (int half = 0; half < tasks_per_document(cp); ++half) {
        const int64_t j = task_chunk(half, cp, r);
        const int64_t c = s.chunk;
        // Positions [j*c, (j+1)*c) of the document; those at or past its length are padding.
        rb.padding_tokens += std::clamp<int64_t>((j + 1) * c - std::max(s.len, j * c), 0, c);
        // Queries [j*c, (j+1)*c) over keys [0, (j+1)*c), padding cut out of both.
        const Workload real = detail::real_task_work(j * c, c, detail::checked_mul(j + 1, c), s.len);
        detail::checked_add(rb.balanced.rect_work, real.rect_work);
        detail::checked_add(rb.balanced.visible_pairs, real.visible_pairs);
      }
    }
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
  return report;
}

BalanceReport balance_report(std::span<const int32_t> cu_seqlens, int cp) {
  const std::vector<int64_t> wide = widen_boundaries(cu_seqlens);
  return balance_report(std::span<const int64_t>(wide), cp);
}

}  // namespace cpattn
