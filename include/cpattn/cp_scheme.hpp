// The CP schemes' names, without MPI: what the command line and other front ends parse
// (cpattn/cp.hpp runs them).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cpattn {

// How K/V reach the queries (docs/cp.md). allgather: every rank gathers every rank's K/V
// once, one kernel call (overlap: one per KV-head group; one host: every rank's K/V read from
// shared memory, no gather); backward reduce-scatters dK/dV. ring (pass-KV): each rank's K/V block
// travels around the ring of CP ranks by point-to-point shifts (the next block in flight while
// the current one is computed); at step s rank r holds rank (r - s) mod cp's block and computes
// only the pairs the plan makes visible (steps with none are skipped), carrying the running
// (out, lse) from step to step in the kernel's accumulate mode, in the fixed order 0..cp-1; backward sends dK/dV around the ring with
// the blocks back to their owners. pass-q: the queries travel around the ring instead
// (the choice when K/V are larger than Q: many KV heads, MLA); each step computes the visiting
// queries' visible pairs with the local K/V, the partial (out, lse) goes back to the queries'
// owner and is merged there in step order; backward: the visiting (lse, q, out, dout) give
// dK/dV locally and partial dQ that go back to the owner. The ring and pass-q hold two blocks
// instead of cp and compute in fp32.
// a2a (all-to-all, Ulysses): an all-to-all scatters the heads and gathers the sequence, so
// each rank runs Hq/cp query heads (and the KV heads they read) over whole documents; the
// inverse all-to-all restores the token layout. hybrid: a2a over groups of cp_inner
// consecutive ranks, then `hybrid_outer` (allgather or ring) over the cp / cp_inner groups.
// All are exact and deterministic.
enum class CpScheme { allgather, ring, pass_q, a2a, hybrid };
// Every scheme, one line each: what `cpattn run --scheme all` runs, in this order.
inline constexpr CpScheme kCpSchemes[] = {CpScheme::allgather, CpScheme::ring, CpScheme::pass_q, CpScheme::a2a,
                                          CpScheme::hybrid};

// "allgather", "ring", "pass-q", "a2a", "hybrid".
constexpr std::string_view to_string(CpScheme s) {
  switch (s) {
    case CpScheme::allgather: return "allgather";
    case CpScheme::ring: return "ring";
    case CpScheme::pass_q: return "pass-q";
    case CpScheme::a2a: return "a2a";
    case CpScheme::hybrid: return "hybrid";
  }
  return "unknown";
}

// The heads each member i of an all-to-all group of `inner` ranks runs (the a2a and hybrid
// schemes): query heads [i*hq_loc, (i+1)*hq_loc) and the KV heads [kv_lo(i), kv_hi(i)) those
// read (query head h reads KV head h / (Hq/Hkv)). Hkv % inner == 0: the KV heads are split;
// inner % Hkv == 0: inner / Hkv members replicate one KV head (their dK/dV summed back in
// member order).
struct HeadSplit {
  int inner = 1, hq = 1, hkv = 1;
  int hq_loc() const { return hq / inner; }
  int group() const { return hq / hkv; }  // query heads per KV head
  int kv_lo(int i) const { return i * hq_loc() / group(); }
  int kv_hi(int i) const { return ((i + 1) * hq_loc() - 1) / group() + 1; }
  int kv_loc() const { return kv_hi(0) - kv_lo(0); }
};

// The rule num_heads_q query heads and num_heads_k KV heads (num_heads_k dividing
// num_heads_q, inner >= 1) break when split over an all-to-all group of `inner` ranks, as a
// sentence naming num_heads_q or num_heads_k; empty when they split. Pure: what CpAttention
// checks (check_cp_attn_config) and what the simulator reports as a scheme's reason.
std::string head_split_error(int num_heads_q, int num_heads_k, int inner);
// The split; throws cpattn::Error "<what>: <head_split_error>" when the heads cannot be split.
HeadSplit head_split(int num_heads_q, int num_heads_k, int inner, std::string_view what);

// The KV-head groups the overlapped all-gather runs its kernels in (CpAttnConfig::overlap,
// docs/cp.md "Overlap"): the largest divisor of num_heads_k that is at most 4 (1: no overlap).
// Pure: what cp_overlap_groups and the simulator use.
int overlap_kv_groups(int num_heads_k);

// The (query, key) pairs of a document of `len` tokens that a mask leaves visible: causal or
// not, within FlashAttention's window (key - query in [-window_left, window_right], -1: no
// bound); len (len + 1) / 2 causal without a window, len^2 without a mask. What the overlapped
// all-gather cuts its documents by, CpAttention and the simulator alike.
double document_pairs(int64_t len, bool causal, int64_t window_left, int64_t window_right);

// Where the overlapped all-gather cuts a batch's documents in two groups (docs/cp.md
// "Overlap"): documents [0, cut) and [cut, documents), `work` per document (document_pairs).
// The small group (the first with small_first: the forward's, whose transfer is the first
// wait; else the last: the backward's, whose dK/dV transfer is the last) holds the share of
// the work nearest a quarter within [1/16, 1/2]; cut 0 (no groups) where no cut gives one
// (one document; a first, or last, document with most of the work).
struct OverlapDocumentCut {
  int64_t cut = 0;
  double share = 0;  // the small group's share of the work (0 without a cut)
};
OverlapDocumentCut overlap_document_cut(std::span<const double> work, bool small_first);

// The overlapped all-gather's units in their order (CpAttention's transfers and kernel calls,
// the simulator's timeline): KV-head group `group` over every document (part -1) or over one
// of the two groups of documents, [0, cut) (part 0) and [cut, documents) (part 1), which the
// forward's first group and the backward's last run as where the batch has a cut.
struct OverlapUnit {
  int group = 0;
  int part = -1;
};
std::vector<OverlapUnit> overlap_units(int groups, bool cut, bool backward);

}  // namespace cpattn
