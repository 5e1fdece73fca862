// The expert-parallel mixture-of-experts layer (docs/moe.md): the layer of moe.hpp with its
// E experts spread over the ranks of an EP communicator in contiguous blocks (rank r holds
// experts [r * E/ep, (r + 1) * E/ep)), each rank's tokens one routing group. Tokens go to their
// experts' ranks and come back through Communicator::all_to_all_v, twice in the forward and
// twice in the backward. The result equals moe_forward / moe_backward on one process over the
// same groups (every rank's tokens in rank order): the same rows reach each expert in the same
// order, so the outputs and gradients are bitwise those of the single-process layer.
//
// A routing group may instead span several ranks (a `group` communicator: the CP ranks that
// share one sequence): each rank passes its tokens' positions in the group, the capacity and the
// aux loss are decided over the whole group, and the result equals moe_forward on one process
// over one group holding the group's tokens in position order (y and dx to float rounding of
// the aux statistics' sums; the experts see their rows in another order, so their gradients
// equal up to the order of additions). The group's ranks need not be in one EP group.
//
//   cpattn::Communicator ep(MPI_COMM_WORLD);
//   cpattn::MoeEpLayer layer(ep, cfg);                 // collective: agrees on cfg
//   cpattn::MoeWeights mine = cpattn::moe_slice_experts(all, layer.first_expert(),
//                                                       layer.local_experts());
//   cpattn::MoeEpForward f = layer.forward(mine, x_local);   // x_local [T_r, D]
//   cpattn::MoeEpBackward b = layer.backward(mine, x_local, f, dy_local);   // b.grads
//   cpattn::MoeLoadReport rep = layer.report(f, b);           // collective
#pragma once

#include <cpattn/comm.hpp>
#include <cpattn/moe.hpp>

#include <cstdint>
#include <span>
#include <vector>

namespace cpattn {

// Seconds one rank spent in each phase of a pass.
struct MoePhaseTimes {
  double routing = 0;   // router, top-k, capacity (forward); router backward (backward)
  double dispatch = 0;  // the all-to-all that carries rows to the experts
  double experts = 0;   // the SwiGLU experts
  double combine = 0;   // the all-to-all back, and the weighted sum (or its backward)
};

// What the forward keeps for the backward, and its figures.
struct MoeEpForward {
  std::vector<float> y;  // [T_r, D]
  // aux_loss_coeff / ep * the sum over the EP ranks of their groups' moe_aux_term (the mean
  // over groups when each rank is its group), the same on every rank of the EP group.
  double aux_loss = 0;
  MoeRouting routing;    // this rank's tokens (routing.group: its whole routing group's figures)
  std::vector<std::int64_t> send_counts, recv_counts;  // [ep] rows to / from each rank
  MoeExpertState experts;                              // the rows this rank's experts received
  std::vector<float> out;                              // [T_r's dispatched rows, D], back home
  MoePhaseTimes times;
  std::int64_t bytes_sent = 0, bytes_received = 0;  // of its all-to-alls (counters' deltas)
};

struct MoeEpBackward {
  MoeGrads grads;  // dx of this rank's tokens; router gradient of this rank's tokens only
  MoePhaseTimes times;
  std::int64_t bytes_sent = 0, bytes_received = 0;  // of its all-to-alls (counters' deltas)
};

// The load report of one forward (and backward), over the whole EP group.
struct MoeLoadReport {
  std::vector<std::int64_t> routed_per_expert;    // [E] assignments chosen, before drops
  std::vector<std::int64_t> kept_per_expert;      // [E] assignments computed
  std::vector<std::int64_t> tokens_per_rank;      // [ep] rows each rank's experts computed
  double imbalance = 1;         // max / mean of routed_per_expert (1: perfectly even)
  double rank_imbalance = 1;    // max / mean of tokens_per_rank
  std::int64_t dropped = 0;     // assignments over capacity, all ranks
  // [ep] bytes each rank sent to / received from other ranks in the forward's and the
  // backward's all-to-alls (the communicator's counters; agreement checks not included)
  std::vector<std::int64_t> bytes_sent, bytes_received;
  std::vector<MoePhaseTimes> forward, backward;          // [ep]
};

class MoeEpLayer {
 public:
  // Collective over `comm` (the EP group, ep = comm.size()) and `group` (this rank's routing
  // group, borrowed; nullptr or one rank: the rank's tokens are their own group): validates cfg
  // and that ep divides num_experts, then agrees on every field of cfg over the group, then
  // over the EP group, a group's failure passed into the EP group's agreement. Any rank's error,
  // or ranks disagreeing, throws the same cpattn::Error on every rank of its group and of the EP
  // groups its group's ranks are in (every rank when EP spans the groups, as training lays them
  // out) before any other communication. forward() agrees on its arguments the same way.
  MoeEpLayer(Communicator& comm, const MoeConfig& cfg, Communicator* group = nullptr);

  int first_expert() const { return first_; }
  int local_experts() const { return local_; }
  const MoeConfig& config() const { return cfg_; }
  int group_size() const { return group_ ? group_->size() : 1; }

  // Collective over the EP group (and the routing group, with a capacity factor or the aux
  // loss). x: this rank's tokens [T_r, D] (T_r may differ between ranks, 0 included); w: the
  // router and this rank's experts (moe_slice_experts). positions [T_r] (with a routing group
  // and a capacity factor or the aux loss; else ignored, and the group exchanges nothing):
  // each token's place in the group's order, >= 0, distinct over the group (equal ones rank by
  // group rank, then local order); the by_position drops and every tie go by them.
  MoeEpForward forward(const MoeWeights& w, std::span<const float> x,
                       std::span<const std::int64_t> positions = {});
  // Collective over the EP group. The gradients of sum(dy * y) + aux_loss_coeff / ep * (this
  // rank's group's moe_aux_term), summed over every rank that runs the layer: without routing
  // groups, sum over ranks of sum(dy * y), plus aux_loss; with them, each group's term counts
  // once per rank it spans (so aux_loss_coeff = the wanted coefficient * ep / the number of
  // ranks running the layer makes the aux part that coefficient * the mean over the groups).
  MoeEpBackward backward(const MoeWeights& w, std::span<const float> x, const MoeEpForward& f,
                         std::span<const float> dy);
  // Collective: every rank's figures, gathered; the same report on every rank.
  MoeLoadReport report(const MoeEpForward& f, const MoeEpBackward& b);

 private:
  // The routing of a group spread over group_'s ranks (moe.hpp's five steps).
  MoeRouting route_in_group(const MoeWeights& w, std::span<const float> x, std::span<const std::int64_t> positions);

  Communicator* comm_;
  Communicator* group_ = nullptr;  // nullptr: the rank's tokens are their own group
  MoeConfig cfg_;
  int first_ = 0, local_ = 0;
};

}  // namespace cpattn
