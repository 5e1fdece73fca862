// The mixture-of-experts layer on one process, and the pieces the expert-parallel layer
// shares with it (include/cpattn/moe.hpp).
#include <cpattn/error.hpp>
#include <cpattn/moe.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

namespace cpattn {

namespace {

using std::int64_t;

// The matrix products. Each output element is its own sequence of float operations, the same
// whatever m is and wherever the row sits: C[i, j] gets + A(i, 0) B[0, j], then + A(i, 1) B[1, j],
// ... in p order (gemm_kernel), or a sum s from 0 in p order added once (gemm_nt_acc). The
// blocked paths only choose which elements advance together (4 rows x 8 columns held in
// registers while p runs, so each B row is loaded once per 4 rows and each C block once per
// call), never the order of an element's additions: the blocks and the plain remainder loops
// (which alone serve a call of fewer than 4 rows) give the same bits (moe.hpp's determinism
// promise, which moe.ExpertRowsAreBitwiseTheSameInAnyBatch checks; src/moe/CMakeLists.txt
// turns off fused multiply-adds, which would differ between the paths).

// Four floats, element-wise IEEE arithmetic (GCC and Clang vector extensions): the same
// operations as four scalar ones.
using V4 = float __attribute__((vector_size(16)));

// C[m, n] += sum over p of A(i, p) * B[p, n], A(i, p) = a[i * ai + p * ap].
void gemm_kernel(const float* a, int64_t ai, int64_t ap, const float* b, float* c, int64_t m, int64_t n, int64_t k) {
  constexpr int64_t R = 4, J = 8;
  int64_t i = 0;
  for (; i + R <= m; i += R) {
    int64_t j = 0;
    for (; j + J <= n; j += J) {
      V4 acc[R][2];
      for (int64_t r = 0; r < R; ++r) {
        std::memcpy(&acc[r][0], c + (i + r) * n + j, sizeof(V4));
        std::memcpy(&acc[r][1], c + (i + r) * n + j + 4, sizeof(V4));
      }
      for (int64_t p = 0; p < k; ++p) {
        V4 b0, b1;
        std::memcpy(&b0, b + p * n + j, sizeof(V4));
        std::memcpy(&b1, b + p * n + j + 4, sizeof(V4));
        for (int64_t r = 0; r < R; ++r) {
          const float x = a[(i + r) * ai + p * ap];
          const V4 av = {x, x, x, x};
          acc[r][0] += av * b0;
          acc[r][1] += av * b1;
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        std::memcpy(c + (i + r) * n + j, &acc[r][0], sizeof(V4));
        std::memcpy(c + (i + r) * n + j + 4, &acc[r][1], sizeof(V4));
      }
    }
    for (int64_t r = 0; r < R; ++r)  // the columns past the last block of J
      for (int64_t p = 0; p < k; ++p) {
        const float av = a[(i + r) * ai + p * ap];
        for (int64_t q = j; q < n; ++q) c[(i + r) * n + q] += av * b[p * n + q];
      }
  }
  for (; i < m; ++i)  // the rows past the last block of R
    for (int64_t p = 0; p < k; ++p) {
      const float av = a[i * ai + p * ap];
      for (int64_t q = 0; q < n; ++q) c[i * n + q] += av * b[p * n + q];
    }
}

// C[m, n] += A[m, k] @ B[k, n].
void gemm_acc(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k) {
  gemm_kernel(a, k, 1, b, c, m, n, k);
}

// C[m, n] += A[k, m]^T @ B[k, n]: rows of A and B summed in order (weight gradients).
void gemm_tn_acc(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k) {
  gemm_kernel(a, 1, m, b, c, m, n, k);
}

// gemm_nt_acc's buffers, which its caller keeps across calls (one backward allocates them once,
// at their largest): B transposed [k, n] and the sums [m, n].
struct NtScratch {
  std::vector<float> bt, sums;
};

// C[m, n] += A[m, k] @ B[n, k]^T: each element's dot product s from 0 in p order, then c += s.
// From 4 rows on, B is transposed once into `scratch` and the sums run through gemm_kernel into
// zeros there.
void gemm_nt_acc(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k, NtScratch& scratch) {
  if (m < 4) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float s = 0;
        for (int64_t p = 0; p < k; ++p) s += a[i * k + p] * b[j * k + p];
        c[i * n + j] += s;
      }
    return;
  }
  std::vector<float>& bt = scratch.bt;
  std::vector<float>& sums = scratch.sums;
  bt.resize(static_cast<std::size_t>(k * n));
  sums.assign(static_cast<std::size_t>(m * n), 0.0f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t p = 0; p < k; ++p) bt[static_cast<std::size_t>(p * n + j)] = b[j * k + p];
  gemm_kernel(a, k, 1, bt.data(), sums.data(), m, n, k);
  for (std::size_t e = 0; e < sums.size(); ++e) c[e] += sums[e];
}

float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// Scores of one token from its logits [E], in place.
void score_row(MoeRouter router, float* row, int E) {
  if (router == MoeRouter::sigmoid_bias) {
    for (int e = 0; e < E; ++e) row[e] = sigmoid(row[e]);
    return;
  }
  const float mx = *std::max_element(row, row + E);
  float sum = 0;
  for (int e = 0; e < E; ++e) sum += (row[e] = std::exp(row[e] - mx));
  for (int e = 0; e < E; ++e) row[e] /= sum;
}

// The K experts of one token, best first by score (+ bias), ties to the lower expert; and
// their combine weights.
void select_row(const MoeConfig& cfg, const float* score, const float* bias, int32_t* expert,
                float* weight) {
  const int E = cfg.num_experts, K = cfg.top_k;
  std::vector<int32_t> idx(static_cast<std::size_t>(E));
  std::iota(idx.begin(), idx.end(), 0);
  const auto key = [&](int32_t e) { return bias ? score[e] + bias[e] : score[e]; };
  std::partial_sort(idx.begin(), idx.begin() + K, idx.end(), [&](int32_t l, int32_t r) {
    return key(l) > key(r) || (key(l) == key(r) && l < r);
  });
  float sum = 0;
  for (int k = 0; k < K; ++k) sum += score[idx[static_cast<std::size_t>(k)]];
  for (int k = 0; k < K; ++k) {
    expert[k] = idx[static_cast<std::size_t>(k)];
    // (sigmoid_bias: every chosen score 0, as sigmoid gives below a logit of about -104, weighs 0,
    // not 0 / 0 = NaN)
    weight[k] = cfg.router != MoeRouter::sigmoid_bias ? score[expert[k]] : sum > 0 ? score[expert[k]] / sum : 0.0f;
  }
}

// r.order and r.expert_counts from r.kept: a counting sort by expert, stable in (token, slot).
void build_order(const MoeConfig& cfg, MoeRouting& r) {
  const int E = cfg.num_experts;
  r.expert_counts.assign(static_cast<std::size_t>(E), 0);
  for (std::size_t s = 0; s < r.kept.size(); ++s)
    if (r.kept[s]) ++r.expert_counts[static_cast<std::size_t>(r.expert[s])];
  std::vector<int64_t> next(static_cast<std::size_t>(E), 0);
  std::exclusive_scan(r.expert_counts.begin(), r.expert_counts.end(), next.begin(), int64_t{0});
  r.order.assign(static_cast<std::size_t>(next.back() + r.expert_counts.back()), 0);
  for (std::size_t s = 0; s < r.kept.size(); ++s)
    if (r.kept[s]) r.order[static_cast<std::size_t>(next[static_cast<std::size_t>(r.expert[s])]++)] = static_cast<int64_t>(s);
}

float uniform(std::mt19937_64& rng, float bound) {
  const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;  // [0, 1)
  return static_cast<float>((2 * u - 1) * bound);
}

std::vector<float> random_vector(std::mt19937_64& rng, std::size_t n, int fan_in) {
  std::vector<float> v(n);
  const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
  for (float& x : v) x = uniform(rng, bound);
  return v;
}

std::size_t expert_matrix(const MoeConfig& cfg) {
  return static_cast<std::size_t>(cfg.hidden) * static_cast<std::size_t>(cfg.ffn);
}

template <class T>
std::vector<T> slice(const std::vector<T>& v, std::size_t first, std::size_t count, std::size_t each) {
  return {v.begin() + static_cast<std::ptrdiff_t>(first * each),
          v.begin() + static_cast<std::ptrdiff_t>((first + count) * each)};
}


}  // namespace

void moe_validate(const MoeConfig& cfg) {
  CPATTN_CHECK(cfg.hidden >= 1, "moe: hidden must be >= 1, got ", cfg.hidden);
  CPATTN_CHECK(cfg.ffn >= 1, "moe: ffn must be >= 1, got ", cfg.ffn);
  CPATTN_CHECK(cfg.num_experts >= 1, "moe: num_experts must be >= 1, got ", cfg.num_experts);
  CPATTN_CHECK(cfg.top_k >= 1 && cfg.top_k <= cfg.num_experts, "moe: top_k must be in 1..num_experts = ",
               cfg.num_experts, ", got ", cfg.top_k);
  CPATTN_CHECK(!cfg.capacity_factor || (std::isfinite(*cfg.capacity_factor) && *cfg.capacity_factor > 0),
               "moe: capacity_factor must be finite and > 0, got ", cfg.capacity_factor.value_or(0));
  CPATTN_CHECK(std::isfinite(cfg.aux_loss_coeff) && cfg.aux_loss_coeff >= 0,
               "moe: aux_loss_coeff must be >= 0, got ", cfg.aux_loss_coeff);
  CPATTN_CHECK(cfg.aux_loss_coeff == 0 || cfg.router == MoeRouter::softmax,
               "moe: aux_loss_coeff needs the softmax router (sigmoid_bias balances by its bias)");
  CPATTN_CHECK(std::isfinite(cfg.bias_update_rate) && cfg.bias_update_rate > 0,
               "moe: bias_update_rate must be > 0, got ", cfg.bias_update_rate);
}

void moe_check_weights(const MoeConfig& cfg, const MoeWeights& w) {
  const std::size_t D = static_cast<std::size_t>(cfg.hidden), E = static_cast<std::size_t>(cfg.num_experts);
  const std::size_t m = static_cast<std::size_t>(w.local_experts) * expert_matrix(cfg);
  CPATTN_CHECK(w.router.size() == D * E && w.bias.size() == E, "moe weights: router must be [D, E] = [",
               D, ", ", E, "] and bias [E], got ", w.router.size(), " and ", w.bias.size(), " values");
  CPATTN_CHECK(w.first_expert >= 0 && w.local_experts >= 0 &&
                   w.first_expert + w.local_experts <= cfg.num_experts,
               "moe weights: experts [", w.first_expert, ", ", w.first_expert + w.local_experts,
               ") are not within the ", E, " experts");
  CPATTN_CHECK(w.w_gate.size() == m && w.w_up.size() == m && w.w_down.size() == m,
               "moe weights: each expert matrix must hold local_experts * D * F = ", m, " values");
}

MoeWeights moe_init_weights(const MoeConfig& cfg, std::uint64_t seed) {
  moe_validate(cfg);
  std::mt19937_64 rng(seed);
  const std::size_t E = static_cast<std::size_t>(cfg.num_experts), m = E * expert_matrix(cfg);
  MoeWeights w;
  w.router = random_vector(rng, static_cast<std::size_t>(cfg.hidden) * E, cfg.hidden);
  w.bias.assign(E, 0.0f);
  w.local_experts = cfg.num_experts;
  w.w_gate = random_vector(rng, m, cfg.hidden);
  w.w_up = random_vector(rng, m, cfg.hidden);
  w.w_down = random_vector(rng, m, cfg.ffn);
  return w;
}

MoeWeights moe_slice_experts(const MoeWeights& all, int first, int count) {
  CPATTN_CHECK(first >= 0 && count >= 0 && first + count <= all.local_experts,
               "moe_slice_experts: experts [", first, ", ", first + count, ") are not within the ",
               all.local_experts, " held");
  const std::size_t each = all.w_gate.size() / static_cast<std::size_t>(std::max(all.local_experts, 1));
  const auto f = static_cast<std::size_t>(first), c = static_cast<std::size_t>(count);
  return {.router = all.router,
          .bias = all.bias,
          .first_expert = all.first_expert + first,
          .local_experts = count,
          .w_gate = slice(all.w_gate, f, c, each),
          .w_up = slice(all.w_up, f, c, each),
          .w_down = slice(all.w_down, f, c, each)};
}

MoeRouting moe_route_tokens(const MoeConfig& cfg, const MoeWeights& w, std::span<const float> x, int64_t tokens) {
  const int D = cfg.hidden, E = cfg.num_experts, K = cfg.top_k;
  CPATTN_CHECK(tokens >= 0 && x.size() == static_cast<std::size_t>(tokens * D),
               "moe: x must be [tokens, hidden] = [", tokens, ", ", D, "], got ", x.size(), " values");
  MoeRouting r;
  r.tokens = tokens;
  r.scores.assign(static_cast<std::size_t>(tokens * E), 0.0f);
  gemm_acc(x.data(), w.router.data(), r.scores.data(), tokens, E, D);
  r.expert.resize(static_cast<std::size_t>(tokens * K));
  r.weight.resize(static_cast<std::size_t>(tokens * K));
  r.routed.assign(static_cast<std::size_t>(E), 0);
  const float* bias = cfg.router == MoeRouter::sigmoid_bias ? w.bias.data() : nullptr;
  for (int64_t t = 0; t < tokens; ++t) {
    score_row(cfg.router, &r.scores[static_cast<std::size_t>(t * E)], E);
    select_row(cfg, &r.scores[static_cast<std::size_t>(t * E)], bias, &r.expert[static_cast<std::size_t>(t * K)],
               &r.weight[static_cast<std::size_t>(t * K)]);
    for (int k = 0; k < K; ++k) ++r.routed[static_cast<std::size_t>(r.expert[static_cast<std::size_t>(t * K + k)])];
  }
  r.group.tokens = tokens;
  r.group.routed = r.routed;
  r.group.score_sum.assign(static_cast<std::size_t>(E), 0.0);
  for (int e = 0; e < E; ++e)  // each expert's sum over the tokens in order
    for (int64_t t = 0; t < tokens; ++t)
      r.group.score_sum[static_cast<std::size_t>(e)] += r.scores[static_cast<std::size_t>(t * E + e)];
  r.kept.assign(static_cast<std::size_t>(tokens * K), 1);
  build_order(cfg, r);
  return r;
}

int64_t moe_capacity(const MoeConfig& cfg, int64_t group_tokens) {
  if (!cfg.capacity_factor) return -1;
  const int64_t assignments = group_tokens * cfg.top_k;
  const double c = *cfg.capacity_factor * static_cast<double>(assignments) / cfg.num_experts;
  // No expert can keep more than every assignment (and a huge factor's ceil overflowed int64).
  if (!(c < static_cast<double>(assignments))) return assignments;
  // A product that is an integer in exact arithmetic can land a rounding error above it in
  // doubles (1.1 * 100 * 2 / 4 = 55.000000000000007, whose ceil is 56): within 1e-9 of an
  // integer, relative, the value is that integer.
  const double whole = std::round(c);
  return static_cast<int64_t>(std::abs(c - whole) <= 1e-9 * std::max(1.0, whole) ? whole : std::ceil(c));
}

std::vector<MoeAssignment> moe_assignments(const MoeRouting& r, std::span<const int64_t> positions) {
  CPATTN_CHECK(positions.size() == static_cast<std::size_t>(r.tokens), "moe_assignments: positions must have the ",
               r.tokens, " tokens' values, got ", positions.size());
  const std::size_t K = r.tokens ? r.expert.size() / static_cast<std::size_t>(r.tokens) : 0;
  for (const int64_t p : positions)
    CPATTN_CHECK(p >= 0 && p <= moe_max_position(static_cast<int>(K)), "moe_assignments: positions must be in 0..",
                 moe_max_position(static_cast<int>(K)), " (each key is position * top_k + slot), got ", p);
  std::vector<MoeAssignment> a(r.expert.size());
  for (std::size_t s = 0; s < a.size(); ++s)
    a[s] = {.key = positions[s / K] * static_cast<int64_t>(K) + static_cast<int64_t>(s % K),
            .expert = r.expert[s], .weight = r.weight[s]};
  return a;
}

std::vector<std::uint8_t> moe_keep(const MoeConfig& cfg, std::span<const MoeAssignment> group, int64_t capacity) {
  std::vector<std::uint8_t> kept(group.size(), 1);
  if (capacity < 0) return kept;
  std::vector<std::size_t> prio(group.size());
  std::iota(prio.begin(), prio.end(), std::size_t{0});
  const auto by_key = [&](std::size_t l, std::size_t r) {
    return group[l].key < group[r].key || (group[l].key == group[r].key && l < r);
  };
  if (cfg.drop_policy == MoeDropPolicy::by_probability)
    std::sort(prio.begin(), prio.end(), [&](std::size_t l, std::size_t r) {
      return group[l].weight > group[r].weight || (group[l].weight == group[r].weight && by_key(l, r));
    });
  else
    std::sort(prio.begin(), prio.end(), by_key);
  std::vector<int64_t> taken(static_cast<std::size_t>(cfg.num_experts), 0);
  for (const std::size_t i : prio) {
    int64_t& t = taken[static_cast<std::size_t>(group[i].expert)];
    if (t < capacity)
      ++t;
    else
      kept[i] = 0;
  }
  return kept;
}

void moe_set_kept(const MoeConfig& cfg, MoeRouting& r, int64_t capacity, std::span<const std::uint8_t> kept) {
  CPATTN_CHECK(kept.size() == r.expert.size(), "moe_set_kept: kept must be [tokens, top_k] = ", r.expert.size(),
               " values, got ", kept.size());
  r.capacity = capacity;
  r.kept.assign(kept.begin(), kept.end());
  r.dropped = std::count(r.kept.begin(), r.kept.end(), std::uint8_t{0});
  build_order(cfg, r);
}

MoeRouting moe_route(const MoeConfig& cfg, const MoeWeights& w, std::span<const float> x, int64_t tokens) {
  MoeRouting r = moe_route_tokens(cfg, w, x, tokens);
  if (!cfg.capacity_factor) return r;
  std::vector<int64_t> positions(static_cast<std::size_t>(tokens));  // the group in token order
  std::iota(positions.begin(), positions.end(), int64_t{0});
  const int64_t capacity = moe_capacity(cfg, tokens);
  moe_set_kept(cfg, r, capacity, moe_keep(cfg, moe_assignments(r, positions), capacity));
  return r;
}

double moe_aux_term(const MoeConfig& cfg, const MoeRouting& r) {
  const MoeGroupStats& g = r.group;
  if (g.tokens == 0) return 0;
  const int E = cfg.num_experts;
  double sum = 0;
  for (int e = 0; e < E; ++e)
    sum += static_cast<double>(g.routed[static_cast<std::size_t>(e)]) / static_cast<double>(g.tokens * cfg.top_k) *
           (g.score_sum[static_cast<std::size_t>(e)] / static_cast<double>(g.tokens));
  return E * sum;
}

void moe_update_bias(const MoeConfig& cfg, std::span<float> bias, std::span<const int64_t> load) {
  CPATTN_CHECK(bias.size() == static_cast<std::size_t>(cfg.num_experts) && load.size() == bias.size(),
               "moe_update_bias: bias and load must have num_experts = ", cfg.num_experts, " values");
  const double mean = static_cast<double>(std::accumulate(load.begin(), load.end(), int64_t{0})) /
                      static_cast<double>(load.size());
  for (std::size_t e = 0; e < bias.size(); ++e) {
    const double gap = mean - static_cast<double>(load[e]);
    bias[e] += static_cast<float>(cfg.bias_update_rate * ((gap > 0) - (gap < 0)));
  }
}

std::vector<float> moe_dispatch_rows(const MoeRouting& r, std::span<const float> x, int hidden) {
  const std::size_t D = static_cast<std::size_t>(hidden), K = r.expert.size() / std::max<std::size_t>(r.tokens, 1);
  std::vector<float> rows(r.order.size() * D);
  for (std::size_t i = 0; i < r.order.size(); ++i) {
    const std::size_t t = static_cast<std::size_t>(r.order[i]) / K;
    std::copy_n(x.begin() + static_cast<std::ptrdiff_t>(t * D), D, rows.begin() + static_cast<std::ptrdiff_t>(i * D));
  }
  return rows;
}

void moe_add_dispatched(const MoeRouting& r, std::span<const float> d_rows, int hidden, std::span<float> dx) {
  const std::size_t D = static_cast<std::size_t>(hidden);
  const std::size_t K = r.tokens ? r.kept.size() / static_cast<std::size_t>(r.tokens) : 0;
  for (std::size_t i = 0; i < r.order.size(); ++i) {
    const std::size_t t = static_cast<std::size_t>(r.order[i]) / K;
    for (std::size_t j = 0; j < D; ++j) dx[t * D + j] += d_rows[i * D + j];
  }
}

namespace {

// Row indices (into the state's layout) of each local expert's rows, in source order.
std::vector<std::vector<int64_t>> rows_of_experts(const MoeExpertState& s, int local_experts) {
  std::vector<std::vector<int64_t>> rows(static_cast<std::size_t>(local_experts));
  int64_t at = 0;
  for (std::size_t i = 0; i < s.counts.size(); ++i)
    for (int64_t n = 0; n < s.counts[i]; ++n) rows[i % static_cast<std::size_t>(local_experts)].push_back(at++);
  return rows;
}

void gather(const float* src, std::span<const int64_t> idx, int64_t width, float* dst) {
  for (std::size_t i = 0; i < idx.size(); ++i)
    std::copy_n(src + idx[i] * width, width, dst + static_cast<int64_t>(i) * width);
}

void scatter(const float* src, std::span<const int64_t> idx, int64_t width, float* dst) {
  for (std::size_t i = 0; i < idx.size(); ++i)
    std::copy_n(src + static_cast<int64_t>(i) * width, width, dst + idx[i] * width);
}

}  // namespace

std::vector<float> moe_experts_forward(const MoeConfig& cfg, const MoeWeights& w, MoeExpertState& s) {
  const int64_t D = cfg.hidden, F = cfg.ffn, n = static_cast<int64_t>(s.rows.size()) / D;
  const std::size_t m = expert_matrix(cfg);
  s.a.assign(static_cast<std::size_t>(n * F), 0.0f);
  s.b.assign(static_cast<std::size_t>(n * F), 0.0f);
  std::vector<float> out(static_cast<std::size_t>(n * D), 0.0f);
  const auto rows = rows_of_experts(s, w.local_experts);
  for (std::size_t e = 0; e < rows.size(); ++e) {
    const auto ne = static_cast<int64_t>(rows[e].size());
    std::vector<float> x(static_cast<std::size_t>(ne * D)), a(static_cast<std::size_t>(ne * F), 0.0f),
        b(a), h(a), o(static_cast<std::size_t>(ne * D), 0.0f);
    gather(s.rows.data(), rows[e], D, x.data());
    gemm_acc(x.data(), &w.w_gate[e * m], a.data(), ne, F, D);   // a = x Wg  [ne, F]
    gemm_acc(x.data(), &w.w_up[e * m], b.data(), ne, F, D);     // b = x Wu  [ne, F]
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = a[i] * sigmoid(a[i]) * b[i];  // silu(a) * b
    gemm_acc(h.data(), &w.w_down[e * m], o.data(), ne, D, F);   // o = h Wd  [ne, D]
    scatter(a.data(), rows[e], F, s.a.data());
    scatter(b.data(), rows[e], F, s.b.data());
    scatter(o.data(), rows[e], D, out.data());
  }
  return out;
}

MoeGrads moe_zero_grads(const MoeConfig& cfg, const MoeWeights& w, int64_t tokens) {
  const std::size_t m = static_cast<std::size_t>(w.local_experts) * expert_matrix(cfg);
  return {.dx = std::vector<float>(static_cast<std::size_t>(tokens * cfg.hidden), 0.0f),
          .router = std::vector<float>(w.router.size(), 0.0f),
          .w_gate = std::vector<float>(m, 0.0f),
          .w_up = std::vector<float>(m, 0.0f),
          .w_down = std::vector<float>(m, 0.0f)};
}

std::vector<float> moe_experts_backward(const MoeConfig& cfg, const MoeWeights& w, const MoeExpertState& s,
                                        std::span<const float> d_out, MoeGrads& g) {
  const int64_t D = cfg.hidden, F = cfg.ffn, n = static_cast<int64_t>(s.rows.size()) / D;
  const std::size_t m = expert_matrix(cfg);
  CPATTN_CHECK(d_out.size() == static_cast<std::size_t>(n * D), "moe: d_out must be [", n, ", ", D, "]");
  std::vector<float> d_rows(static_cast<std::size_t>(n * D), 0.0f);
  const auto rows = rows_of_experts(s, w.local_experts);
  NtScratch scratch;
  for (std::size_t e = 0; e < rows.size(); ++e) {
    const auto ne = static_cast<int64_t>(rows[e].size());
    const auto nf = static_cast<std::size_t>(ne * F);
    std::vector<float> x(static_cast<std::size_t>(ne * D)), dout(x), a(nf), b(nf), h(nf), dh(nf, 0.0f),
        da(nf), db(nf), dx(x.size(), 0.0f);
    gather(s.rows.data(), rows[e], D, x.data());
    gather(d_out.data(), rows[e], D, dout.data());
    gather(s.a.data(), rows[e], F, a.data());
    gather(s.b.data(), rows[e], F, b.data());
    for (std::size_t i = 0; i < nf; ++i) h[i] = a[i] * sigmoid(a[i]) * b[i];
    gemm_tn_acc(h.data(), dout.data(), &g.w_down[e * m], F, D, ne);  // dWd += h^T dout
    gemm_nt_acc(dout.data(), &w.w_down[e * m], dh.data(), ne, F, D, scratch);  // dh = dout Wd^T
    for (std::size_t i = 0; i < nf; ++i) {
      const float sg = sigmoid(a[i]);
      db[i] = dh[i] * a[i] * sg;
      da[i] = dh[i] * b[i] * sg * (1.0f + a[i] * (1.0f - sg));
    }
    gemm_tn_acc(x.data(), da.data(), &g.w_gate[e * m], D, F, ne);    // dWg += x^T da
    gemm_tn_acc(x.data(), db.data(), &g.w_up[e * m], D, F, ne);      // dWu += x^T db
    gemm_nt_acc(da.data(), &w.w_gate[e * m], dx.data(), ne, D, F, scratch);  // dx = da Wg^T + db Wu^T
    gemm_nt_acc(db.data(), &w.w_up[e * m], dx.data(), ne, D, F, scratch);
    scatter(dx.data(), rows[e], D, d_rows.data());
  }
  return d_rows;
}

std::vector<float> moe_combine(const MoeRouting& r, std::span<const float> out, int hidden) {
  const std::size_t D = static_cast<std::size_t>(hidden);
  std::vector<int64_t> row_of(r.kept.size(), -1);  // (t, k) -> its row in out
  for (std::size_t i = 0; i < r.order.size(); ++i) row_of[static_cast<std::size_t>(r.order[i])] = static_cast<int64_t>(i);
  std::vector<float> y(static_cast<std::size_t>(r.tokens) * D, 0.0f);
  const std::size_t K = r.tokens ? r.kept.size() / static_cast<std::size_t>(r.tokens) : 0;
  for (std::size_t s = 0; s < r.kept.size(); ++s) {
    if (!r.kept[s]) continue;
    const float* o = &out[static_cast<std::size_t>(row_of[s]) * D];
    float* yt = &y[s / K * D];
    for (std::size_t j = 0; j < D; ++j) yt[j] += r.weight[s] * o[j];
  }
  return y;
}

std::vector<float> moe_combine_backward(const MoeRouting& r, std::span<const float> out,
                                        std::span<const float> dy, int hidden, std::vector<float>& d_weight) {
  const std::size_t D = static_cast<std::size_t>(hidden);
  const std::size_t K = r.tokens ? r.kept.size() / static_cast<std::size_t>(r.tokens) : 0;
  CPATTN_CHECK(dy.size() == static_cast<std::size_t>(r.tokens) * D, "moe: dy must be [tokens, hidden] = [",
               r.tokens, ", ", D, "], got ", dy.size(), " values");
  d_weight.assign(r.kept.size(), 0.0f);
  std::vector<float> d_out(r.order.size() * D);
  for (std::size_t i = 0; i < r.order.size(); ++i) {
    const auto s = static_cast<std::size_t>(r.order[i]);
    const float* g = &dy[s / K * D];
    const float* o = &out[i * D];
    float dot = 0;
    for (std::size_t j = 0; j < D; ++j) {
      d_out[i * D + j] = r.weight[s] * g[j];
      dot += g[j] * o[j];
    }
    d_weight[s] = dot;
  }
  return d_out;
}

void moe_router_backward(const MoeConfig& cfg, const MoeWeights& w, const MoeRouting& r, std::span<const float> x,
                         std::span<const float> d_weight, double aux_scale, std::span<float> dx, MoeGrads& g) {
  const int64_t E = cfg.num_experts, K = cfg.top_k, D = cfg.hidden, T = r.tokens;
  std::vector<float> dlogits(static_cast<std::size_t>(T * E), 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    const float* p = &r.scores[static_cast<std::size_t>(t * E)];
    const float* dw = &d_weight[static_cast<std::size_t>(t * K)];
    const float* wt = &r.weight[static_cast<std::size_t>(t * K)];
    const int32_t* ex = &r.expert[static_cast<std::size_t>(t * K)];
    float* dl = &dlogits[static_cast<std::size_t>(t * E)];
    std::vector<float> dscore(static_cast<std::size_t>(E), 0.0f);
    if (cfg.router == MoeRouter::softmax) {
      // w_k = p_{e_k}; the aux loss adds aux_scale * E * f_e / T_g to every dp_e (the group's f_e, T_g).
      for (int64_t k = 0; k < K; ++k) dscore[static_cast<std::size_t>(ex[k])] += dw[k];
      if (aux_scale != 0) {
        const auto Tg = static_cast<double>(r.group.tokens);
        for (int64_t e = 0; e < E; ++e)
          dscore[static_cast<std::size_t>(e)] += static_cast<float>(
              aux_scale * static_cast<double>(E) * static_cast<double>(r.group.routed[static_cast<std::size_t>(e)]) /
              (Tg * static_cast<double>(K)) / Tg);
      }
      float dot = 0;  // softmax backward: dl = p * (dp - <p, dp>)
      for (int64_t e = 0; e < E; ++e) dot += p[e] * dscore[static_cast<std::size_t>(e)];
      for (int64_t e = 0; e < E; ++e) dl[e] = p[e] * (dscore[static_cast<std::size_t>(e)] - dot);
    } else {
      // w_k = s_k / S, S = sum of the chosen s: ds_k = (dw_k - <dw, w>) / S; ds/dl = s (1 - s).
      float sum = 0, dot = 0;
      for (int64_t k = 0; k < K; ++k) {
        sum += p[ex[k]];
        dot += dw[k] * wt[k];
      }
      if (sum > 0)  // (else every weight is the constant 0: no gradient)
        for (int64_t k = 0; k < K; ++k) {
          const float s = p[ex[k]];
          dl[ex[k]] = (dw[k] - dot) / sum * s * (1.0f - s);
        }
    }
  }
  gemm_tn_acc(x.data(), dlogits.data(), g.router.data(), D, E, T);   // dWr += x^T dlogits
  NtScratch scratch;  // this function makes one call
  gemm_nt_acc(dlogits.data(), w.router.data(), dx.data(), T, D, E, scratch);  // dx += dlogits Wr^T
}

MoeForward moe_forward(const MoeConfig& cfg, const MoeWeights& w, std::span<const float> x,
                       std::span<const int64_t> group_sizes) {
  moe_validate(cfg);
  moe_check_weights(cfg, w);
  CPATTN_CHECK(w.first_expert == 0 && w.local_experts == cfg.num_experts,
               "moe_forward: the single-process layer needs all ", cfg.num_experts, " experts");
  const int64_t D = cfg.hidden, T = static_cast<int64_t>(x.size()) / D;
  MoeForward f;
  f.group_sizes.assign(group_sizes.begin(), group_sizes.end());
  if (f.group_sizes.empty()) f.group_sizes.push_back(T);
  CPATTN_CHECK(std::all_of(f.group_sizes.begin(), f.group_sizes.end(), [](int64_t n) { return n >= 0; }) &&
                   std::accumulate(f.group_sizes.begin(), f.group_sizes.end(), int64_t{0}) * D ==
                       static_cast<int64_t>(x.size()),
               "moe_forward: group_sizes must be >= 0 and sum to the tokens of x (", x.size(), " values / hidden ",
               D, ")");
  int64_t at = 0;
  for (const int64_t n : f.group_sizes) {
    const auto xg = x.subspan(static_cast<std::size_t>(at * D), static_cast<std::size_t>(n * D));
    f.routing.push_back(moe_route(cfg, w, xg, n));
    const MoeRouting& r = f.routing.back();
    const std::vector<float> rows = moe_dispatch_rows(r, xg, cfg.hidden);
    f.experts.rows.insert(f.experts.rows.end(), rows.begin(), rows.end());
    f.experts.counts.insert(f.experts.counts.end(), r.expert_counts.begin(), r.expert_counts.end());
    if (cfg.aux_loss_coeff > 0) f.aux_loss += moe_aux_term(cfg, r);
    at += n;
  }
  f.aux_loss *= cfg.aux_loss_coeff / static_cast<double>(f.group_sizes.size());
  f.out = moe_experts_forward(cfg, w, f.experts);
  int64_t row = 0;
  for (const MoeRouting& r : f.routing) {
    const auto n = static_cast<std::size_t>(r.order.size() * static_cast<std::size_t>(D));
    const std::vector<float> y = moe_combine(r, std::span(f.out).subspan(static_cast<std::size_t>(row * D), n), cfg.hidden);
    f.y.insert(f.y.end(), y.begin(), y.end());
    row += static_cast<int64_t>(r.order.size());
  }
  return f;
}

MoeGrads moe_backward(const MoeConfig& cfg, const MoeWeights& w, std::span<const float> x, const MoeForward& f,
                      std::span<const float> dy) {
  const int64_t D = cfg.hidden;
  moe_validate(cfg);
  moe_check_weights(cfg, w);
  CPATTN_CHECK(x.size() == f.y.size() && dy.size() == f.y.size(),
               "moe_backward: x and dy must be [tokens, hidden] like y (", f.y.size(), " values), got ", x.size(),
               " and ", dy.size());
  MoeGrads g = moe_zero_grads(cfg, w, static_cast<int64_t>(f.y.size()) / D);
  std::vector<float> d_out;
  std::vector<std::vector<float>> d_weight(f.routing.size());
  int64_t at = 0, row = 0;
  for (std::size_t i = 0; i < f.routing.size(); ++i) {
    const MoeRouting& r = f.routing[i];
    const auto n = r.order.size() * static_cast<std::size_t>(D);
    const std::vector<float> d = moe_combine_backward(
        r, std::span(f.out).subspan(static_cast<std::size_t>(row * D), n),
        dy.subspan(static_cast<std::size_t>(at * D), static_cast<std::size_t>(r.tokens * D)), cfg.hidden, d_weight[i]);
    d_out.insert(d_out.end(), d.begin(), d.end());
    at += r.tokens;
    row += static_cast<int64_t>(r.order.size());
  }
  const std::vector<float> d_rows = moe_experts_backward(cfg, w, f.experts, d_out, g);
  const double aux_scale = cfg.aux_loss_coeff / static_cast<double>(f.routing.size());
  at = row = 0;
  for (std::size_t i = 0; i < f.routing.size(); ++i) {
    const MoeRouting& r = f.routing[i];
    const auto span_x = static_cast<std::size_t>(r.tokens * D);
    const std::span<float> dx = std::span(g.dx).subspan(static_cast<std::size_t>(at * D), span_x);
    moe_add_dispatched(r, std::span(d_rows).subspan(static_cast<std::size_t>(row * D), r.order.size() * static_cast<std::size_t>(D)),
                       cfg.hidden, dx);
    moe_router_backward(cfg, w, r, x.subspan(static_cast<std::size_t>(at * D), span_x), d_weight[i], aux_scale, dx, g);
    at += r.tokens;
    row += static_cast<int64_t>(r.order.size());
  }
  return g;
}

}  // namespace cpattn
