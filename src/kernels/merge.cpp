// Partial softmax merge (docs/design.md section 6), one template for fp32 and float64.
#include <cpattn/error.hpp>
#include <cpattn/merge.hpp>

#include <cmath>
#include <limits>
#include <vector>

namespace cpattn {

namespace {

template <class T>
T weights_of(std::span<const T> lse_parts, std::span<T> weights) {
  CPATTN_CHECK(lse_parts.size() == weights.size(), "merge_weights: lse_parts has ",
               lse_parts.size(), " entries but weights has ", weights.size());
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  T mx = kNegInf;
  for (T l : lse_parts) {
    if (std::isnan(l)) {  // (fmax would skip it: a NaN part beside empty ones read as empty)
      for (T& w : weights) w = std::numeric_limits<T>::quiet_NaN();
      return l;
    }
    mx = std::fmax(mx, l);
  }
  if (mx == kNegInf) {  // every part empty: weight 0 everywhere, never exp(-inf - -inf)
    for (T& w : weights) w = T(0);
    return kNegInf;
  }
  // lse = mx + log sum exp(lse_a - mx): exact for any magnitude, and exp(-inf) = 0.
  double sum = 0.0;
  for (T l : lse_parts) sum += std::exp(static_cast<double>(l) - mx);
  const double lse = mx + std::log(sum);
  for (size_t a = 0; a < lse_parts.size(); ++a)
    weights[a] = static_cast<T>(std::exp(static_cast<double>(lse_parts[a]) - lse));
  return static_cast<T>(lse);
}

template <class T>
void merge(const MergeParamsT<T>& p) {
  CPATTN_CHECK(p.num_parts >= 1, "merge: num_parts must be >= 1, got ", p.num_parts);
  CPATTN_CHECK(p.rows >= 0, "merge: rows must be >= 0, got ", p.rows);
  CPATTN_CHECK(p.num_heads >= 1, "merge: num_heads must be >= 1, got ", p.num_heads);
  CPATTN_CHECK(p.head_dim >= 1, "merge: head_dim must be >= 1, got ", p.head_dim);
  CPATTN_CHECK(p.lse_parts && p.out_parts && p.lse && p.out,
               "merge: lse_parts, out_parts, lse and out must not be null");
  for (int a = 0; a < p.num_parts; ++a)
    CPATTN_CHECK(p.lse_parts[a] && p.out_parts[a], "merge: part ", a, " has a null pointer");
  const int n = p.num_parts;
  const int64_t d = p.head_dim;
  std::vector<T> lse_in(n), w(n), acc(d);
  for (int64_t rh = 0; rh < p.rows * p.num_heads; ++rh) {
    for (int a = 0; a < n; ++a) lse_in[a] = p.lse_parts[a][rh];
    const T lse = weights_of<T>(lse_in, w);
    // Read every part before writing: out may alias out_parts[0].
    for (int64_t i = 0; i < d; ++i) acc[i] = T(0);
    for (int a = 0; a < n; ++a) {
      if (w[a] == T(0)) continue;  // an empty part's out may hold anything, even NaN
      const T* o = p.out_parts[a] + rh * d;
      for (int64_t i = 0; i < d; ++i) acc[i] += w[a] * o[i];
    }
    for (int64_t i = 0; i < d; ++i) p.out[rh * d + i] = acc[i];
    p.lse[rh] = lse;
  }
}

}  // namespace

float merge_weights(std::span<const float> lse_parts, std::span<float> weights) {
  return weights_of<float>(lse_parts, weights);
}
double merge_weights(std::span<const double> lse_parts, std::span<double> weights) {
  return weights_of<double>(lse_parts, weights);
}
void merge_partial_softmax(const MergeParams& p) { merge(p); }
void merge_partial_softmax(const MergeParams64& p) { merge(p); }

}  // namespace cpattn
