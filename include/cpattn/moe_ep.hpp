// The expert-parallel mixture-of-experts layer (docs/moe.md): the layer of moe.hpp with its
// E experts spread over the ranks of an EP communicator in contiguous blocks (rank r holds
// experts [r * E/ep, (r + 1) * E/ep)), each rank's tokens one routing group. Tokens go to their
// experts' ranks and come back through Communicator::all_to_all_v, twice in the forward and
// twice in the backward. The result equals moe_forward / moe_backward on one process over the
// same groups (every rank's tokens in rank order): the same rows reach each expert in the same
// order, so the outputs and gradients are bitwise those of the single-process layer.
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
  double aux_loss = 0;   // the whole layer's (all ranks' groups), the same on every rank
  MoeRouting routing;    // this rank's group
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
  // Collective over `comm` (the EP group, ep = comm.size()): validates cfg and that ep divides
  // num_experts, then agrees on every field of cfg. Any rank's error, or ranks disagreeing,
  // throws the same cpattn::Error on every rank before any other communication.
  MoeEpLayer(Communicator& comm, const MoeConfig& cfg);

  int first_expert() const { return first_; }
  int local_experts() const { return local_; }
  const MoeConfig& config() const { return cfg_; }

  // Collective. x: this rank's tokens [T_r, D] (T_r may differ between ranks, 0 included);
  // w: the router and this rank's experts (moe_slice_experts).
  MoeEpForward forward(const MoeWeights& w, std::span<const float> x);
  // Collective. Gradients of sum over ranks of sum(dy * y) + aux_loss.
  MoeEpBackward backward(const MoeWeights& w, std::span<const float> x, const MoeEpForward& f,
                         std::span<const float> dy);
  // Collective: every rank's figures, gathered; the same report on every rank.
  MoeLoadReport report(const MoeEpForward& f, const MoeEpBackward& b);

 private:
  Communicator* comm_;
  MoeConfig cfg_;
  int first_ = 0, local_ = 0;
};

}  // namespace cpattn
