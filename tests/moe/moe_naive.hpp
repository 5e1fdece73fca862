// A naive float64 mixture-of-experts forward, written per token from the definitions of
// docs/moe.md, independent of src/moe: the reference the layer is checked against, and the
// function that finite differences run on.
#pragma once

#include <cpattn/moe.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>
#include <vector>

namespace cpattn::moe_test {

struct NaiveResult {
  std::vector<double> y;  // [T, D]
  double aux = 0;         // aux_loss_coeff * mean over groups of the Switch term
  std::vector<int> kept;  // [T, K] 1 when kept
};

inline NaiveResult naive_moe(const MoeConfig& c, const MoeWeights& w, std::span<const float> x,
                             std::span<const std::int64_t> groups) {
  const int D = c.hidden, F = c.ffn, E = c.num_experts, K = c.top_k;
  const auto T = static_cast<std::int64_t>(x.size()) / D;
  NaiveResult res{std::vector<double>(static_cast<std::size_t>(T * D), 0.0), 0.0,
                  std::vector<int>(static_cast<std::size_t>(T * K), 1)};
  const auto at = [](const std::vector<float>& v, std::size_t i) { return static_cast<double>(v[i]); };
  std::int64_t begin = 0;
  for (const std::int64_t n : groups) {
    std::vector<std::vector<double>> score(static_cast<std::size_t>(n), std::vector<double>(E));
    std::vector<std::vector<int>> chosen(static_cast<std::size_t>(n));
    std::vector<std::vector<double>> weight(static_cast<std::size_t>(n));
    std::vector<double> load(static_cast<std::size_t>(E), 0), mean_p(static_cast<std::size_t>(E), 0);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t t = begin + i;
      auto& s = score[static_cast<std::size_t>(i)];
      for (int e = 0; e < E; ++e) {
        double l = 0;
        for (int d = 0; d < D; ++d) l += x[static_cast<std::size_t>(t * D + d)] * at(w.router, static_cast<std::size_t>(d * E + e));
        s[static_cast<std::size_t>(e)] = l;
      }
      if (c.router == MoeRouter::softmax) {
        const double mx = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (double& v : s) z += (v = std::exp(v - mx));
        for (double& v : s) v /= z;
      } else {
        for (double& v : s) v = 1 / (1 + std::exp(-v));
      }
      std::vector<int> idx(static_cast<std::size_t>(E));
      std::iota(idx.begin(), idx.end(), 0);
      const auto key = [&](int e) {
        return s[static_cast<std::size_t>(e)] + (c.router == MoeRouter::sigmoid_bias ? at(w.bias, static_cast<std::size_t>(e)) : 0.0);
      };
      std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return key(a) > key(b); });
      idx.resize(static_cast<std::size_t>(K));
      double sum = 0;
      for (const int e : idx) sum += s[static_cast<std::size_t>(e)];
      for (const int e : idx) {
        weight[static_cast<std::size_t>(i)].push_back(c.router == MoeRouter::softmax ? s[static_cast<std::size_t>(e)]
                                                                                     : s[static_cast<std::size_t>(e)] / sum);
        load[static_cast<std::size_t>(e)] += 1;
      }
      chosen[static_cast<std::size_t>(i)] = idx;
      for (int e = 0; e < E; ++e) mean_p[static_cast<std::size_t>(e)] += s[static_cast<std::size_t>(e)] / static_cast<double>(n);
    }
    // Capacity: walk the assignments in priority order, each expert keeps its first `cap`.
    if (c.capacity_factor) {
      const auto cap = static_cast<std::int64_t>(std::ceil(*c.capacity_factor * static_cast<double>(n * K) / E));
      std::vector<std::int64_t> slots(static_cast<std::size_t>(n * K));
      std::iota(slots.begin(), slots.end(), 0);
      if (c.drop_policy == MoeDropPolicy::by_probability)
        std::stable_sort(slots.begin(), slots.end(), [&](std::int64_t a, std::int64_t b) {
          return weight[static_cast<std::size_t>(a / K)][static_cast<std::size_t>(a % K)] >
                 weight[static_cast<std::size_t>(b / K)][static_cast<std::size_t>(b % K)];
        });
      std::vector<std::int64_t> taken(static_cast<std::size_t>(E), 0);
      for (const std::int64_t s : slots) {
        const int e = chosen[static_cast<std::size_t>(s / K)][static_cast<std::size_t>(s % K)];
        if (taken[static_cast<std::size_t>(e)]++ >= cap) res.kept[static_cast<std::size_t>((begin + s / K) * K + s % K)] = 0;
      }
    }
    if (n > 0 && c.aux_loss_coeff > 0)
      for (int e = 0; e < E; ++e)
        res.aux += E * load[static_cast<std::size_t>(e)] / static_cast<double>(n * K) * mean_p[static_cast<std::size_t>(e)];
    // Experts, one token at a time: o = (silu(x Wg) * (x Wu)) Wd.
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t t = begin + i;
      for (int k = 0; k < K; ++k) {
        if (!res.kept[static_cast<std::size_t>(t * K + k)]) continue;
        const auto e = static_cast<std::size_t>(chosen[static_cast<std::size_t>(i)][static_cast<std::size_t>(k)]);
        const std::size_t base = e * static_cast<std::size_t>(D * F);
        std::vector<double> h(static_cast<std::size_t>(F));
        for (int f = 0; f < F; ++f) {
          double a = 0, b = 0;
          for (int d = 0; d < D; ++d) {
            a += x[static_cast<std::size_t>(t * D + d)] * at(w.w_gate, base + static_cast<std::size_t>(d * F + f));
            b += x[static_cast<std::size_t>(t * D + d)] * at(w.w_up, base + static_cast<std::size_t>(d * F + f));
          }
          h[static_cast<std::size_t>(f)] = a / (1 + std::exp(-a)) * b;
        }
        for (int d = 0; d < D; ++d) {
          double o = 0;
          for (int f = 0; f < F; ++f) o += h[static_cast<std::size_t>(f)] * at(w.w_down, base + static_cast<std::size_t>(f * D + d));
          res.y[static_cast<std::size_t>(t * D + d)] += weight[static_cast<std::size_t>(i)][static_cast<std::size_t>(k)] * o;
        }
      }
    }
    begin += n;
  }
  res.aux *= c.aux_loss_coeff / static_cast<double>(groups.size());
  return res;
}

// Seeded values in [-1, 1).
inline std::vector<float> random_values(std::size_t n, std::uint64_t seed) {
  std::vector<float> v(n);
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& x : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    x = static_cast<float>(static_cast<double>(s >> 11) * 0x1.0p-52 - 1.0);
  }
  return v;
}

}  // namespace cpattn::moe_test
