// The all-to-all (Ulysses) level of the a2a and hybrid CP schemes (docs/cp.md). Internal to
// src/cp: CpAttention drives it after the ranks' agreement.
//
// A group of `inner` consecutive ranks {o*inner .. o*inner+inner-1} holds, together, exactly
// the symmetric split at cp_outer = cp / inner with coarse chunks of `inner` fine chunks:
// group o's fine chunks o*inner .. o*inner+inner-1 form coarse chunk o of every document, and
// its fine chunks 2cp-inner(o+1) .. 2cp-1-o*inner coarse chunk 2*cp_outer-1-o. So after an
// all-to-all that scatters heads and gathers the group's tokens in that order (the "group
// layout"), each member runs an ordinary CP layer (all-gather or ring) over the cp_outer ranks
// with the same member index, on a plan for cp_outer of the cp-padded documents whose padding
// is cut again. At inner = cp (the a2a scheme) cp_outer = 1: the group layout is the padded
// global order and the outer layer is one process's whole-document attention.
#pragma once

#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/plan.hpp>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace cpattn::detail {

// The ranks of one all-to-all group of `cfg` over `cp` ranks: all of them for a2a, cp_inner for
// hybrid (1 while a hybrid config's cp_inner is not yet checked).
inline int a2a_group_size(const CpAttnConfig& cfg, int cp) {
  return cfg.scheme == CpScheme::a2a ? cp : (cfg.cp_inner >= 1 ? cfg.cp_inner : 1);
}

// What an a2a forward keeps for its backward.
struct A2aContext {
  CpContext outer;                // the outer layer's context
  std::vector<std::byte> q, out;  // this member's heads of the group's tokens, group layout
  std::size_t bytes() const { return q.capacity() + out.capacity(); }  // the outer's: its own peak
};

// The outer layer's plan of this rank's group (rank / inner of cp / inner groups), for member
// rank % inner: the cp-padded documents split at cp_outer = plan.cp / inner (no further
// padding: their lengths are multiples of 2 cp), each document's real length restored, so that
// the outer layer cuts the padding out of its tasks and zeroes the padding rows as usual. The
// same for every member of a group. Not collective.
RankPlan a2a_outer_plan(const RankPlan& plan, int inner);

class A2aLevel {
 public:
  // Not collective (the sub-groups are split at the first forward, after the agreement).
  // cfg.options.alibi_slopes must outlive this object.
  A2aLevel(Communicator& comm, const CpAttnConfig& cfg, int inner);
  ~A2aLevel();
  A2aLevel(const A2aLevel&) = delete;
  A2aLevel& operator=(const A2aLevel&) = delete;

  // Collective over comm, once: splits the sub-groups and makes the outer layer, which checks
  // no memory of its own (CpAttention counts it in its estimate, agreed over comm: the outer
  // layer's check, agreed over its group alone, could fail there and leave the other members
  // waiting in the all-to-all for their deadline).
  void connect(const std::function<void(CpAttention&)>& made);
  // Not collective: the group layout's rows and the outer layer's plan for `plan` (kept for
  // the forwards of the same plan), before the agreement, so that a failure here is agreed.
  const RankPlan& prepare(const std::shared_ptr<const RankPlan>& plan);
  // Whether a timeout (throw mode) poisoned its inner or outer group: its buffers then went to
  // that group's communicator (which keeps them while its requests are pending), and every
  // later call must fail on every rank at its agreement, before any group is used.
  bool poisoned() const;
  // Collective over comm: out and lse ([local_tokens, Hq], fp32) of this rank's tokens. Both
  // add their times and counts to `stats` and return the outer layer's transfer time hidden
  // under its compute (the caller's comm_total_s - comm_s).
  double forward(const CpForwardArgs& a, const std::shared_ptr<const RankPlan>& plan, uint64_t seed,
                 std::vector<float>& lse, A2aContext& ctx, CpStats& stats);
  // Collective over comm; consumes ctx.outer.
  double backward(A2aContext& ctx, const std::shared_ptr<const RankPlan>& plan, const CpBackwardArgs& a,
                  CpStats& stats);

  std::size_t buffer_bytes() const;  // its scratch plus the outer layer's peak
  int64_t bytes_sent() const;        // over its sub-groups
  int64_t bytes_received() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> m_;
};

}  // namespace cpattn::detail
