// What the CP schemes share inside the cp layer (not installed): timing, the fp32 conversions
// of the blocks they compute on, the point-to-point shift of a storage-dtype block, and the
// work lists of one rank's queries over one rank's block of K/V.
#pragma once

#include <cpattn/attention.hpp>
#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/tensor.hpp>
#include <cpattn/worklist.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <initializer_list>
#include <cstdint>
#include <cstddef>
#include <vector>

namespace cpattn::cp_detail {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// What a scheme's step functions run with: the layer's communicator, configuration and the
// statistics they add their seconds to.
struct SchemeEnv {
  Communicator& comm;
  const CpAttnConfig& cfg;
  CpStats& stats;
  // While compute_moving runs a step: the kernels' progress callback (AttnInputs::progress),
  // which the step's calls pass on; null otherwise.
  const std::function<void()>* progress = nullptr;
  // Waits for `r` (a default-constructed request returns at once), counted as communication.
  void wait(CommRequest& r);
  // Runs compute() (a step's kernel calls) with `progress` moving the step's transfers along
  // (test_first_active over `in_flight`). Its time is counted as communication; the rest of
  // compute()'s as compute.
  void compute_moving(std::initializer_list<CommRequest*> in_flight, const std::function<void()>& compute);
};

// One step of MPI's progress for the kernels' progress callback: tests the first of `reqs`
// (CommRequests, or pointers to them) still active (a test drives Open MPI's progress engine
// for every request), and the next only once that one completed; never waits. Returns whether
// any completed.
inline CommRequest& request_of(CommRequest& r) { return r; }
inline CommRequest& request_of(CommRequest* r) { return *r; }
template <class Range>
bool test_first_active(Communicator& comm, Range& reqs) {
  bool any = false;
  for (auto&& x : reqs) {
    CommRequest& r = request_of(x);
    if (!r.active()) continue;
    if (!comm.test(r)) return any;
    any = true;
  }
  return any;
}

// Runs call(progress) with `progress` (for AttnInputs::progress) running step() while the
// kernels compute. Returns the seconds of the whole call and, in `polled`, those inside step().
template <class Step, class Call>
double run_with_progress(Step&& step, double& polled, Call&& call) {
  polled = 0;
  const std::function<void()> progress = [&] {
    const auto t0 = Clock::now();
    step();
    polled += seconds_since(t0);
  };
  const auto t0 = Clock::now();
  call(&progress);
  return seconds_since(t0);
}

// The keys each task of `plan` reads, as runs of the rank-major gathered buffer
// [cp * local_tokens] (rank q's block at rows [q * local_tokens, (q + 1) * local_tokens)).
// Causal: chunks 0..j of the document, the plan's runs. No mask: every chunk of it. A sliding
// window reads the same runs: the kernels skip the key blocks outside the window.
WorkList keys_for_mask(const RankPlan& plan, MaskType mask);

// The part of `keys` (plan's tasks over the rank-major buffer, without padding) that lies in
// rank `block`'s K/V: for each task the pieces of its runs inside that block, as rows of the
// block, cut to the positions some query of the task can see (under a causal mask at or
// before its last query; with a sliding window within [first query - left, last query +
// right]). Tasks left without keys are dropped: an empty list means no visible pair, so the
// schemes skip the blocks that the mask or the window hides entirely.
WorkList work_on_block(const RankPlan& plan, const WorkList& keys, const AttnOptions& o, int block);

// sees[q] for q = 0 .. cp-1: whether rank q's queries see some key of rank `block`'s K/V
// under `o`'s mask and window, padding excluded, i.e. whether work_on_block of q's plan over
// `block` has a task. From plan.layout and plan.docs alone (the same on every rank), without
// q's plan: O(documents x chunks), for the ring's backward, whose partial dK/dV is full or
// empty by it.
std::vector<char> ranks_seeing_block(const RankPlan& plan, const AttnOptions& o, int block);


// The overlapped all-gather's cut of the batch's documents into two groups
// (overlap_document_cut, docs/cp.md "Overlap"), each document's work its pairs under `o`'s
// mask and window (document_pairs of its real length, from plan.docs: the same on every rank).
// Part of the ranks' agreement.
int64_t overlap_doc_cut(const RankPlan& plan, const AttnOptions& o, bool small_first);

// cp_memory_estimate of the a2a and hybrid schemes for `plan`, whose a2a_outer_plan (a2a.hpp)
// is `outer_plan`: its work counts the outer layer's kernel blocks (CpAttention's check, which
// holds the outer plan already).
CpMemoryEstimate a2a_memory_estimate(const CpAttnConfig& cfg, const RankPlan& plan, const RankPlan& outer_plan);

// fp32 contiguous [rows, heads, dim] into a (possibly strided) view of any dtype.
void store_f32(const float* src, TensorView t);

// A view's rows in its storage dtype, contiguous, at `dst` (t.rows * t.heads * t.dim elements).
void pack_rows(ConstTensorView t, std::byte* dst);

// A block in storage dtype `t` travels as bits (fp32 as floats, fp16/bf16 as 16-bit words).
CommRequest start_block_shift(Communicator& comm, DType t, const std::vector<std::byte>& send, int dest,
                              std::vector<std::byte>& recv, int source);

// `len` rows of the all-gather's rank-major buffer (from row `gathered`) that are rows
// `ordered`.. of the document-ordered key set the kernel reads.
struct RowMove {
  int64_t gathered = 0, ordered = 0, len = 0;
};

// Where every chunk's rows go when the rank-major gathered buffer is put in document order:
// document d's rows at docs[d].padded_begin (its padded rows under the padded split, its real
// ones under the padding-free split), each chunk at its position. Chunks adjacent in both
// buffers are one move. Empty when the gathered buffer already is in document order (cp = 1).
// The moves cover every gathered row and every ordered row exactly once: their row map
// (PreparedWork::key_rows) is the permutation AttnInputs::key_rows must be
// (tests/cp/test_cp_worklists.cpp).
std::vector<RowMove> document_order_moves(const RankPlan& plan);

// The local rows the shared backward finishes at a time (store_shared_sums), for dK and dV rows
// of kr and vr floats: about 64 KiB of either, a multiple of 16 rows (the kernels' partial
// sums go 16 rows at a time), at most the local rows (at least one).
inline int64_t shared_sum_rows(int64_t kr, int64_t vr, int64_t local_rows) {
  const int64_t widest = std::max<int64_t>({kr, vr, 1});
  return std::min<int64_t>(std::max<int64_t>(16, 16384 / widest / 16 * 16), std::max<int64_t>(local_rows, 1));
}

}  // namespace cpattn::cp_detail
