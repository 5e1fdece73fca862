// A mixture-of-experts layer (docs/moe.md): a top-k router and SwiGLU experts, forward and
// backward, on one process. No MPI: this is the layer that the expert-parallel one
// (moe_ep.hpp) must equal, and the building blocks both share.
//
// Shapes: T tokens, D = hidden, F = ffn (per expert), E experts, K = top_k. Row-major,
// contiguous. An expert e computes o = (silu(x Wg_e) * (x Wu_e)) Wd_e for one token row x;
// the layer's output is y_t = sum over the kept slots k of token t of w_{t,k} * o_{e_{t,k}}(x_t)
// (no residual). Routing works per *group* of consecutive tokens (GShard's groups): capacity,
// drops and the auxiliary loss are decided inside a group; in the expert-parallel layer each
// rank's tokens are one group, or a group is spread over several ranks (a sequence split by
// context parallelism: MoeEpLayer's routing group), and a single-process run over the same
// groups, each holding its tokens in the group's order, equals it.
//
//   cpattn::MoeConfig cfg{.hidden = 16, .ffn = 32, .num_experts = 4, .top_k = 2,
//                         .capacity_factor = 1.25};
//   cpattn::MoeWeights w = cpattn::moe_init_weights(cfg, /*seed=*/1);
//   const int64_t groups[] = {5, 7};                         // two groups: tokens 0-4, 5-11
//   cpattn::MoeForward f = cpattn::moe_forward(cfg, w, x, groups);       // f.y: [12, D]
//   cpattn::MoeGrads g = cpattn::moe_backward(cfg, w, x, f, dy);         // dx, dW
//
// Deterministic: the same inputs give bitwise the same outputs. The matrix products are
// blocked loops whose arithmetic for each output element (its products added in a fixed order)
// does not depend on how many rows share a call or where a row sits, so an expert computes a
// token's row the same way whichever rank or batch holds it.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace cpattn {

enum class MoeRouter {
  // p = softmax(logits) over the E experts; the K largest p are chosen (ties: lower expert
  // first) and weigh their expert's output by p itself (Switch / GShard, not renormalized).
  softmax,
  // s = sigmoid(logits); the K largest s + bias are chosen (the bias only selects), weighted
  // by s / sum of the chosen s (DeepSeek-V3's auxiliary-loss-free balancing). The bias moves
  // with moe_update_bias() from the observed load, not by gradient.
  sigmoid_bias,
};

// Which assignments an expert keeps when more than its capacity reach it in one group.
enum class MoeDropPolicy {
  by_position,     // the first ones in (token, slot) order
  by_probability,  // the ones with the largest combine weight (ties: earlier token, slot)
};

struct MoeConfig {
  int hidden = 0;       // D >= 1
  int ffn = 0;          // F >= 1, per expert
  int num_experts = 0;  // E >= 1
  int top_k = 1;        // K, 1 .. E
  MoeRouter router = MoeRouter::softmax;
  // > 0. Unset: no capacity, nothing dropped. Set: an expert keeps at most
  // ceil(capacity_factor * T_g * K / E) assignments of a group of T_g tokens.
  std::optional<double> capacity_factor = std::nullopt;
  MoeDropPolicy drop_policy = MoeDropPolicy::by_position;
  // >= 0, softmax router only: weight of the Switch load-balancing loss (0: none), see
  // MoeForward::aux_loss.
  double aux_loss_coeff = 0;
  // > 0, sigmoid_bias only: the step of moe_update_bias().
  double bias_update_rate = 1e-3;
};

// Throws cpattn::Error naming the field and the rule when `cfg` is invalid.
void moe_validate(const MoeConfig& cfg);

// The layer's parameters. The experts held are first_expert .. first_expert + local_experts - 1
// (all E on one process; a contiguous block per rank in the expert-parallel layer).
struct MoeWeights {
  std::vector<float> router;  // [D, E]: logits = x @ router
  std::vector<float> bias;    // [E], sigmoid_bias only (zeros otherwise): selection bias
  int first_expert = 0;
  int local_experts = 0;
  std::vector<float> w_gate;  // [local_experts, D, F]
  std::vector<float> w_up;    // [local_experts, D, F]
  std::vector<float> w_down;  // [local_experts, F, D]
};

// Weights from a seed (uniform in +-1/sqrt(fan_in)), all E experts; the same on every process.
MoeWeights moe_init_weights(const MoeConfig& cfg, std::uint64_t seed);
// The router, bias and experts [first, first + count) of `all` (which holds every expert).
MoeWeights moe_slice_experts(const MoeWeights& all, int first, int count);
// Throws cpattn::Error naming the tensor and the size `cfg` gives it when `w` does not match:
// router [D, E], bias [E] (also with the softmax router: zeros), each expert matrix
// local_experts * D * F values, experts [first_expert, first_expert + local_experts) within E.
void moe_check_weights(const MoeConfig& cfg, const MoeWeights& w);

// What a routing group's capacity and auxiliary loss read of the whole group. On one process
// the group's own; for a group spread over several ranks, the sums over its ranks' parts.
struct MoeGroupStats {
  std::int64_t tokens = 0;            // T_g
  std::vector<std::int64_t> routed;   // [E] assignments chosen per expert, before drops
  std::vector<double> score_sum;      // [E] sum over the group's tokens of each expert's score
};

// Routing of one group of tokens (or of this rank's part of a group spread over ranks).
struct MoeRouting {
  std::int64_t tokens = 0;
  std::vector<float> scores;         // [T, E]: softmax probabilities or sigmoid scores
  std::vector<std::int32_t> expert;  // [T, K]: chosen experts, best first
  std::vector<float> weight;         // [T, K]: combine weights
  std::vector<std::uint8_t> kept;    // [T, K]: 1 when within its expert's capacity
  std::vector<std::int64_t> routed;  // [E]: assignments chosen per expert, before drops
  std::int64_t capacity = -1;        // per expert; -1: none
  std::int64_t dropped = 0;          // assignments over capacity
  // The kept assignments (t * K + k) ordered by expert, then token, then slot: the order the
  // token rows are dispatched in. expert_counts[e]: how many of them go to expert e.
  std::vector<std::int64_t> order;
  std::vector<std::int64_t> expert_counts;  // [E]
  MoeGroupStats group;  // the whole group's (= tokens, routed and the scores' sums on one process)
};

// Routes tokens x [T, D] of one group: moe_route_tokens, then (with a capacity factor) the
// capacity decision of moe_keep over the group's assignments in (token, slot) order.
MoeRouting moe_route(const MoeConfig& cfg, const MoeWeights& w, std::span<const float> x,
                     std::int64_t tokens);

// ---- Routing a group spread over several processes (what moe_route does in one call) -------
// 1. moe_route_tokens on each part; 2. sum the parts' r.group into every part's; 3. gather the
// parts' moe_assignments (positions: each token's place in the group); 4. moe_keep on the
// gathered list, on every part alike; 5. moe_set_kept with the part's own slice of the result.

// Scores, top-k and weights of each token; nothing dropped yet (capacity -1, every slot kept,
// the order built); r.group = these tokens' own figures.
MoeRouting moe_route_tokens(const MoeConfig& cfg, const MoeWeights& w, std::span<const float> x,
                            std::int64_t tokens);

// ceil(capacity_factor * group_tokens * K / E), a value within 1e-9 (relative) of an integer
// taken as that integer (1.1 * 100 * 2 / 4 is 55, not the 56 its doubles' rounding gives), and at
// most group_tokens * K; -1 without a capacity factor.
std::int64_t moe_capacity(const MoeConfig& cfg, std::int64_t group_tokens);

// One assignment of a token to an expert, as the capacity decision sees it.
struct MoeAssignment {
  std::int64_t key = 0;     // position * K + slot; position: the token's place in its group
  std::int32_t expert = 0;
  float weight = 0;         // the combine weight
};

// The largest position moe_assignments takes with `top_k` slots: its keys, position * top_k +
// slot, stay within int64.
constexpr std::int64_t moe_max_position(int top_k) {
  return (INT64_MAX - (top_k - 1)) / (top_k < 1 ? 1 : top_k);
}
// r's assignments in (token, slot) order; positions [r.tokens] (on one process 0 .. T-1), each
// in 0..moe_max_position(top_k) (else cpattn::Error).
std::vector<MoeAssignment> moe_assignments(const MoeRouting& r, std::span<const std::int64_t> positions);

// Which of a group's assignments its experts keep, 1 per kept entry in the order of `group`:
// each expert keeps its first `capacity` assignments in the drop policy's order (by_position:
// key; by_probability: weight, larger first, then key); equal keys go to the earlier entry.
std::vector<std::uint8_t> moe_keep(const MoeConfig& cfg, std::span<const MoeAssignment> group,
                                   std::int64_t capacity);

// Sets r's kept slots ([T, K]) and capacity, then its dropped count and dispatch order.
void moe_set_kept(const MoeConfig& cfg, MoeRouting& r, std::int64_t capacity,
                  std::span<const std::uint8_t> kept);

// The group's Switch loss term E * sum_e f_e * P_e, f_e = routed[e] / (T_g K),
// P_e = score_sum[e] / T_g, from r.group (0 for an empty group). The layer's loss is
// aux_loss_coeff * the mean over groups.
double moe_aux_term(const MoeConfig& cfg, const MoeRouting& r);

// The bias rule of the sigmoid_bias router: b_e += rate * sign(mean(load) - load[e]), load =
// the assignments routed to each expert over the whole batch (every group, every rank).
void moe_update_bias(const MoeConfig& cfg, std::span<float> bias, std::span<const std::int64_t> load);

// ---- Building blocks shared with the expert-parallel layer -----------------------------------

// rows [order.size(), D] = x[t] of each dispatched assignment, in r.order.
std::vector<float> moe_dispatch_rows(const MoeRouting& r, std::span<const float> x, int hidden);

// The backward of moe_dispatch_rows: dx[t] += d_rows of t's dispatched rows (r.order).
void moe_add_dispatched(const MoeRouting& r, std::span<const float> d_rows, int hidden, std::span<float> dx);

// What the experts keep from their forward for their backward.
struct MoeExpertState {
  std::vector<std::int64_t> counts;  // [S, local_experts]: rows per (source block, expert)
  std::vector<float> rows;           // [n, D] the received rows, source-major, expert-major inside
  std::vector<float> a, b;           // [n, F] x Wg and x Wu, in rows' order
};

// The experts of `w` on rows laid out as S source blocks, each holding its rows for expert
// w.first_expert, then the next, ... (counts [S, local_experts]). Returns o [n, D] in the
// same layout. Each expert's rows are taken in source order.
std::vector<float> moe_experts_forward(const MoeConfig& cfg, const MoeWeights& w,
                                       MoeExpertState& state);

// Gradients of the layer. dx is [T, D] of the tokens given (this rank's in the EP layer); the
// expert gradients are those of the experts held.
struct MoeGrads {
  std::vector<float> dx;       // [T, D]
  std::vector<float> router;   // [D, E]
  std::vector<float> w_gate;   // like MoeWeights
  std::vector<float> w_up;
  std::vector<float> w_down;
};
MoeGrads moe_zero_grads(const MoeConfig& cfg, const MoeWeights& w, std::int64_t tokens);

// d_out [n, D] (the gradient at the experts' outputs, in state's layout) -> d_rows [n, D],
// and += into g's expert gradients.
std::vector<float> moe_experts_backward(const MoeConfig& cfg, const MoeWeights& w,
                                        const MoeExpertState& state, std::span<const float> d_out,
                                        MoeGrads& g);

// y [T, D] = sum over kept slots of weight * out row (out in r.order), slots in order.
std::vector<float> moe_combine(const MoeRouting& r, std::span<const float> out, int hidden);

// The backward of moe_combine: returns d_out [order.size(), D] = weight * dy[t], and writes
// d_weight [T, K] = <dy[t], out row> (0 for dropped slots).
std::vector<float> moe_combine_backward(const MoeRouting& r, std::span<const float> out,
                                        std::span<const float> dy, int hidden,
                                        std::vector<float>& d_weight);

// The router's backward: from d_weight [T, K] (and the aux loss, with aux_scale = coeff / groups
// for a softmax router: each token's dp_e gets aux_scale * E * f_e / T_g of r.group) to
// += g.router and += g.dx (x: this group's rows, dx: its rows of g.dx).
void moe_router_backward(const MoeConfig& cfg, const MoeWeights& w, const MoeRouting& r,
                         std::span<const float> x, std::span<const float> d_weight, double aux_scale,
                         std::span<float> dx, MoeGrads& g);

// ---- The single-process layer -----------------------------------------------------------------

struct MoeForward {
  std::vector<float> y;                  // [T, D]
  double aux_loss = 0;                   // aux_loss_coeff * mean over groups of moe_aux_term
  std::vector<std::int64_t> group_sizes; // [G]
  std::vector<MoeRouting> routing;       // [G]
  MoeExpertState experts;                // S = G source blocks
  std::vector<float> out;                // [n, D] expert outputs, in experts' layout
};

// x [T, D] in groups of group_sizes (sum = T; empty: one group); w holds every expert.
// Throws cpattn::Error on an invalid config or shapes.
MoeForward moe_forward(const MoeConfig& cfg, const MoeWeights& w, std::span<const float> x,
                       std::span<const std::int64_t> group_sizes);

// Gradients of sum(dy * y) + aux_loss with respect to x and every weight (not the bias).
MoeGrads moe_backward(const MoeConfig& cfg, const MoeWeights& w, std::span<const float> x,
                      const MoeForward& f, std::span<const float> dy);

}  // namespace cpattn
