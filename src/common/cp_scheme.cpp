// The all-to-all groups' head split and the overlap's groups (include/cpattn/cp_scheme.hpp).
#include <cpattn/cp_scheme.hpp>
#include <cpattn/error.hpp>

#include <algorithm>
#include <cmath>

namespace cpattn {

std::string head_split_error(int num_heads_q, int num_heads_k, int inner) {
  const std::string n = std::to_string(inner);
  if (num_heads_q % inner != 0)
    return "num_heads_q = " + std::to_string(num_heads_q) + " must be divisible by the all-to-all group size " + n +
           " (each rank runs num_heads_q / " + n + " query heads)";
  if (num_heads_k % inner != 0 && inner % num_heads_k != 0)
    return "num_heads_k = " + std::to_string(num_heads_k) + " must be divisible by the all-to-all group size " + n +
           " (split KV heads) or divide it (replicated KV heads)";
  return "";
}

HeadSplit head_split(int num_heads_q, int num_heads_k, int inner, std::string_view what) {
  const std::string why = head_split_error(num_heads_q, num_heads_k, inner);
  CPATTN_CHECK(why.empty(), what, ": ", why);
  return {.inner = inner, .hq = num_heads_q, .hkv = num_heads_k};
}

int overlap_kv_groups(int num_heads_k) {
  int groups = std::min(num_heads_k, 4);  // more groups: more progress points, smaller kernel calls
  while (groups > 1 && num_heads_k % groups != 0) --groups;
  return std::max(groups, 1);
}

double document_pairs(int64_t len, bool causal, int64_t window_left, int64_t window_right) {
  if (len <= 0) return 0;
  // Each offset d = key - query in [lo, hi] (lo <= 0 <= hi) has len - |d| pairs; summed in
  // closed form, f(m) = sum over d in [0, m] of (len - d).
  const auto n = static_cast<double>(len);
  double lo = -(n - 1), hi = causal ? 0 : n - 1;
  if (window_left >= 0) lo = std::max(lo, -static_cast<double>(window_left));
  if (window_right >= 0) hi = std::min(hi, static_cast<double>(window_right));
  const auto f = [n](double m) { return (m + 1) * n - m * (m + 1) / 2; };
  return f(hi) + f(-lo) - n;
}

std::vector<OverlapUnit> overlap_units(int groups, bool cut, bool backward) {
  const int split = backward ? groups - 1 : 0;
  std::vector<OverlapUnit> units;
  for (int g = 0; g < groups; ++g)
    if (g == split && cut) {
      units.push_back({.group = g, .part = 0});
      units.push_back({.group = g, .part = 1});
    } else {
      units.push_back({.group = g, .part = -1});
    }
  return units;
}

OverlapDocumentCut overlap_document_cut(std::span<const double> work, bool small_first) {
  double total = 0;
  for (const double w : work) total += w;
  OverlapDocumentCut best;
  double before = 0, best_gap = 1;
  for (std::size_t d = 1; d < work.size(); ++d) {
    before += work[d - 1];
    const double share = (small_first ? before : total - before) / total;
    if (share >= 1.0 / 16 && share <= 0.5 && std::abs(share - 0.25) < best_gap) {
      best_gap = std::abs(share - 0.25);
      best = {.cut = static_cast<int64_t>(d), .share = share};
    }
  }
  return best;
}

}  // namespace cpattn
