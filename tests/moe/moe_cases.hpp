// The MoE case table shared by the single-process tests, the expert-parallel tests and the
// benchmark: shapes small and awkward (1-token groups, 3 and 6 experts, top-k = E).
#pragma once

#include <cpattn/moe.hpp>

#include <cstdint>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

namespace cpattn::moe_test {

struct MoeCase {
  std::string name;
  MoeConfig cfg;
  std::vector<std::int64_t> groups;  // tokens per routing group (per rank in the EP layer)
  bool drops = false;                // the capacity drops some assignment
  std::int64_t tokens() const { return std::accumulate(groups.begin(), groups.end(), std::int64_t{0}); }
};

// GoogleTest prints a case by its name.
inline void PrintTo(const MoeCase& c, std::ostream* os) { *os << c.name; }

inline MoeConfig moe_config(int experts, int top_k, MoeRouter router = MoeRouter::softmax) {
  return {.hidden = 8, .ffn = 6, .num_experts = experts, .top_k = top_k, .router = router};
}

// hidden 13, ffn 19, 3 experts, top-2: every path of the blocked expert products.
inline MoeConfig wide_config() { return {.hidden = 13, .ffn = 19, .num_experts = 3, .top_k = 2}; }

inline MoeConfig with_capacity(MoeConfig c, double factor, MoeDropPolicy policy) {
  c.capacity_factor = factor;
  c.drop_policy = policy;
  return c;
}

inline std::vector<MoeCase> single_process_cases() {
  using enum MoeDropPolicy;
  MoeConfig aux = moe_config(3, 2);
  aux.aux_loss_coeff = 0.01;
  return {
      {"softmax_k1", moe_config(4, 1), {5, 1, 7}, false},
      {"softmax_k2_drop_position", with_capacity(moe_config(4, 2), 0.5, by_position), {6, 1, 9}, true},
      {"softmax_k2_drop_probability", with_capacity(moe_config(4, 2), 0.5, by_probability), {6, 1, 9}, true},
      {"softmax_k2_capacity_no_drop", with_capacity(moe_config(4, 2), 4.0, by_position), {6, 3}, false},
      {"sigmoid_k2_drop", with_capacity(moe_config(6, 2, MoeRouter::sigmoid_bias), 0.5, by_probability), {7, 4}, true},
      {"softmax_k2_aux_e3", aux, {1, 8}, false},
      {"softmax_k_equals_e", moe_config(3, 3), {4}, false},
      // Wider odd sizes: the expert products' 4 x 8 blocks with rows and columns left over.
      {"wide_d13_f19", wide_config(), {9, 1, 14}, false},
  };
}

// Tokens of rank r in the EP tests: a 1-token rank among others of different sizes.
inline std::vector<std::int64_t> rank_groups(int ep) {
  std::vector<std::int64_t> g;
  for (int r = 0; r < ep; ++r) g.push_back(r % 3 == 1 ? 1 : 5 + r);
  return g;
}

// The EP cases for `ep` ranks: E = ep and 2 ep, top-k 1 and 2 (when <= E), no capacity and a
// capacity that drops by position and by probability, and the sigmoid-bias router.
inline std::vector<MoeCase> ep_cases(int ep) {
  std::vector<MoeCase> cases;
  for (const int e : {ep, 2 * ep})
    for (const int k : {1, 2}) {
      if (k > e) continue;
      std::string base = "e";  // appended piecewise: GCC 12's -Wrestrict misfires on "e" + ...
      base.append(std::to_string(e)).append("_k").append(std::to_string(k));
      cases.push_back({base, moe_config(e, k), rank_groups(ep), false});
      cases.push_back({base + "_drop_position", with_capacity(moe_config(e, k), 0.5, MoeDropPolicy::by_position),
                       rank_groups(ep), true});
      cases.push_back({base + "_drop_probability",
                       with_capacity(moe_config(e, k), 0.5, MoeDropPolicy::by_probability), rank_groups(ep), true});
    }
  MoeConfig aux = moe_config(2 * ep, std::min(2, 2 * ep));
  aux.aux_loss_coeff = 0.01;
  cases.push_back({"aux", aux, rank_groups(ep), false});
  cases.push_back({"sigmoid_bias", moe_config(2 * ep, std::min(2, 2 * ep), MoeRouter::sigmoid_bias), rank_groups(ep),
                   false});
  return cases;
}

}  // namespace cpattn::moe_test
