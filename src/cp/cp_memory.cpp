// cp_memory_estimate: what cp_attention.cpp's forward and backward allocate, buffer by buffer
// (keep the two in step: CpStats::peak_buffer_bytes measures what the estimate predicts, and
// tests/cp compares them).
#include <cpattn/attention.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/error.hpp>
#include <cpattn/memory.hpp>

#include "a2a.hpp"
#include "cp_internal.hpp"

#include <algorithm>
#include <limits>
#include <string>

namespace cpattn {
namespace {

// a * b * c * d, saturating (absurd requests must give a huge number, not a wrapped one).
uint64_t product(uint64_t a, uint64_t b, uint64_t c = 1, uint64_t d = 1) {
  return saturating_mul(saturating_mul(a, b), saturating_mul(c, d));
}

// The capacity of a vector resized to `first` bytes, then to `second`: libstdc++ grows to
// max(2 x the old size, the new size).
uint64_t grown(uint64_t first, uint64_t second) {
  return second <= first ? first : std::max(saturating_mul(first, 2), second);
}

// attention_backward's scratch for `q_rows` queries over `k_rows` keys (clamped so that the
// kernel's sum stays finite for absurd requests).
uint64_t kernel_scratch(const CpAttnConfig& c, int64_t q_rows, uint64_t k_rows, int heads_q, int heads_k,
                        const WorkList* work) {
  const auto rows = static_cast<int64_t>(std::min<uint64_t>(k_rows, uint64_t{1} << 50));
  const AttnBwdParams p{
      .in = {.q = {nullptr, std::min<int64_t>(q_rows, int64_t{1} << 50), heads_q, c.head_dim_qk, c.dtype},
             .k = {nullptr, rows, heads_k, c.head_dim_qk, c.dtype},
             .v = {nullptr, rows, heads_k, c.head_dim_v, c.dtype},
             .work = work,
             .options = c.options}};
  return attention_backward_scratch_bytes(p);
}

// The all-gather and the ring. `gathered`: the rows an all-gather collects (cp blocks of the
// padded split's equal size, or the padding-free split's global tokens).
CpMemoryEstimate gather_or_ring(const CpAttnConfig& c, int cp, int64_t local_tokens, uint64_t gathered,
                                const WorkList* work) {
  const auto t = static_cast<uint64_t>(local_tokens);
  const uint64_t es = dtype_size(c.dtype), f = sizeof(float);
  const auto hq = static_cast<uint64_t>(c.num_heads_q);
  const auto kv_row = static_cast<uint64_t>(c.num_heads_k) * static_cast<uint64_t>(c.head_dim_qk + c.head_dim_v);
  const uint64_t lse = product(t, hq, f);
  const bool ring = c.scheme == CpScheme::ring;
  const uint64_t kv_rows = ring ? t : gathered;  // the gathered keys
  // Index mode copies each task's keys: a document's front and back chunks both read its
  // first chunks, so the copy holds up to twice the gathered rows.
  const bool index = !ring && c.kv_mode == KvMode::index;
  const uint64_t read_rows = index ? saturating_mul(kv_rows, 2) : kv_rows;  // the keys a kernel call reads
  CpMemoryEstimate e;
  e.context = saturating_add(product(read_rows, kv_row, es), lse);
  if (ring) {
    // Double-buffered visiting [K | V] blocks; fp32 partial dK/dV, two going home and two
    // coming back, and this rank's dK/dV sums; the running fp32 out and lse, and dQ
    // (cp_attention.cpp's ring, acc_out ... dkv_home).
    e.buffers = saturating_add(saturating_add(product(2, t, kv_row, es), product(5, t, kv_row, f)),
                               product(t, hq, static_cast<uint64_t>(c.head_dim_qk + c.head_dim_v + 1), f));
  } else if (const int groups = cp_overlap_groups(c, cp);
             groups > 1 || (c.overlap && cp > 1 && !index && c.scheme == CpScheme::allgather)) {
    // The overlapped all-gather (cp_attention.cpp's grouped_forward and grouped_backward; with
    // one KV-head group, where the plan cuts its documents in two groups: counted whether it does):
    // fp32 dK/dV of every gathered row (rank-major, all groups, written there by the kernel),
    // one group's sums, the receive blocks of the reduce-scatter (cp of this rank's fp32 dK/dV
    // rows, all groups) and one group's lse. The forward receives and packs straight into the
    // context's K/V. All are kept between calls, so a forward's peak, and the first
    // backward's, is all of them at once. The consumed contexts' K/V that the layer keeps
    // for the next forwards are contexts' bytes: `contexts` x context bounds them with the
    // live contexts (an entry per backward, one taken per forward).
    const auto g = static_cast<uint64_t>(groups);
    const uint64_t kv_row_g = kv_row / g;  // cp_overlap_groups divides num_heads_k
    e.buffers = saturating_add(saturating_add(product(kv_rows, kv_row, f), product(t, kv_row_g, f)),
                               saturating_add(product(static_cast<uint64_t>(cp), t, kv_row, f), product(t, hq / g, f)));
  } else {
    // dK/dV of every gathered row and this rank's share, fp32; index mode adds the copy's
    // dK/dV and, during forward, the gathered buffer beside its copy (runs mode reads the
    // gathered buffer in place, in document order through the plan's key_rows).
    e.buffers = saturating_add(product(kv_rows, kv_row, f), product(t, kv_row, f));
    if (index)
      e.buffers = saturating_add(e.buffers, saturating_add(product(read_rows, kv_row, f), product(kv_rows, kv_row, es)));
    // The padding-free split's reduce-scatter receives cp blocks of this rank's dK/dV rows
    // (reduce_scatter_rows' scratch, added in rank order).
    if (c.split == CpSplit::padding_free) e.buffers = saturating_add(e.buffers, product(static_cast<uint64_t>(cp), t, kv_row, f));
  }
  if (!ring && c.shared_memory && cp > 1 && !index) {
    const uint64_t dkv_all = product(kv_rows, kv_row, f);  // (both all-gather forms hold it)
    // Over one host's shared memory (cp_attention.cpp's shared_backward): this rank's slot of
    // the kernel's partial sums (KvGradShare: attention_grad_share_bytes with no work list,
    // the most any rank's needs; they leave the kernel's scratch, counted there still for the
    // message path) in place of dK/dV of every gathered row, and cp + 1 blocks of the rows it
    // finishes at a time (store_shared_sums) and its rows' sources.
    const auto at_once = static_cast<uint64_t>(cp_detail::shared_sum_rows(
        int64_t{c.num_heads_k} * c.head_dim_qk, int64_t{c.num_heads_k} * c.head_dim_v,
        static_cast<int64_t>(std::min<uint64_t>(t, uint64_t{1} << 50))));
    const auto k_rows = static_cast<int64_t>(std::min<uint64_t>(kv_rows, uint64_t{1} << 50));
    const AttnBwdParams p{.in = {.q = {nullptr, 1, c.num_heads_q, c.head_dim_qk, c.dtype},
                                 .k = {nullptr, k_rows, c.num_heads_k, c.head_dim_qk, c.dtype},
                                 .v = {nullptr, k_rows, c.num_heads_k, c.head_dim_v, c.dtype},
                                 .options = c.options}};
    uint64_t slot = std::numeric_limits<uint64_t>::max();  // absurd sizes: saturated, as everything here
    try {
      const uint64_t bytes = attention_grad_share_bytes(p);
      slot = bytes > slot - 63 ? slot : (bytes + 63) / 64 * 64;
    } catch (const Error&) {
    }
    // And its 1/cp of the kernels' K/V packed once per host (KvPackShare, where the path and
    // dtype have a layout; counted whole in the kernel's scratch, which packs alone on the
    // message path).
    uint64_t pack = std::numeric_limits<uint64_t>::max();
    try {
      pack = attention_kv_pack_bytes(k_rows, c.num_heads_k, c.head_dim_qk, c.head_dim_v,
                                     attention_kv_pack_layout(c.options.path, c.dtype));
      pack = pack / static_cast<uint64_t>(cp) + (pack % static_cast<uint64_t>(cp) != 0);
    } catch (const Error&) {
    }
    const uint64_t shared = saturating_add(
        saturating_add(saturating_add(slot, pack), product(static_cast<uint64_t>(cp) + 1, at_once, kv_row, f)),
        product(t, sizeof(int64_t)));
    e.buffers = std::max(e.buffers, saturating_add(e.buffers - dkv_all, shared));
  }
  e.kernel_scratch = kernel_scratch(c, local_tokens, read_rows, c.num_heads_q, c.num_heads_k, work);
  return e;
}

// Pass-Q (pass_q.cpp): the context keeps this rank's K/V and lse; the buffers are the
// double-buffered visiting block (backward's [lse | q | out | dout] the larger), the partials
// sent and coming back (double-buffered), the owner's running result, and the dK/dV sums of
// PassQBuffers (the steps read q, out and dout in the storage dtype from the visiting block).
CpMemoryEstimate pass_q(const CpAttnConfig& c, int64_t local_tokens, const WorkList* work) {
  const auto t = static_cast<uint64_t>(local_tokens);
  const uint64_t es = dtype_size(c.dtype), f = sizeof(float);
  const auto hq = static_cast<uint64_t>(c.num_heads_q);
  const auto dqk = static_cast<uint64_t>(c.head_dim_qk), dv = static_cast<uint64_t>(c.head_dim_v);
  const auto kv_row = static_cast<uint64_t>(c.num_heads_k) * (dqk + dv);
  CpMemoryEstimate e;
  e.context = saturating_add(product(t, kv_row, es), product(t, hq, f));
  // The visiting block and the partials: forward's size, then backward's (a vector resized up
  // keeps max(2 x its old size, the new one): std::vector's growth).
  const uint64_t visit = grown(product(t, hq, dqk, es),
                               saturating_add(product(t, hq, f), product(t, hq, (dqk + 2 * dv), es)));
  const uint64_t part = grown(product(t, hq, 1 + dv, f), product(t, hq, dqk, f));  // [lse | out], then dQ
  const uint64_t acc = product(t, hq, std::max(1 + dv, dqk), f);                    // assigned: exact
  e.buffers = saturating_add(saturating_add(saturating_mul(visit, 2), saturating_add(saturating_mul(part, 4), acc)),
                             product(t, kv_row, f));
  e.kernel_scratch = kernel_scratch(c, local_tokens, t, c.num_heads_q, c.num_heads_k, work);
  return e;
}

CpMemoryEstimate estimate(const CpAttnConfig& c, int cp, int64_t local_tokens, uint64_t gathered,
                          const WorkList* work, const WorkList* outer_work);

// The a2a and hybrid schemes (a2a.cpp): the group layout of `inner` ranks' tokens holds this
// member's heads (q, out kept for backward; k, v, dout, dq, dk, dv and lse as scratch), the
// all-to-all's send and receive blocks and the fp32 sum of replicated dK/dV; the outer layer,
// an all-gather or ring over cp / inner ranks on inner x local_tokens rows of those heads,
// comes on top (its context in ours, its buffers and kernel scratch too; `outer_work`: the
// outer plan's tasks, for the kernel's per-thread blocks, a2a_outer_plan's work).
CpMemoryEstimate a2a(const CpAttnConfig& c, int cp, int64_t local_tokens, const WorkList* outer_work) {
  const auto hq = static_cast<uint64_t>(c.num_heads_q), hkv = static_cast<uint64_t>(c.num_heads_k);
  const int inner = detail::a2a_group_size(c, cp);
  const int outer = std::max(1, cp / inner);
  const int group = std::max(1, c.num_heads_q / std::max(1, c.num_heads_k));  // query heads per KV head
  const int hq_loc = std::max(1, c.num_heads_q / inner);
  const int kv_loc = (hq_loc - 1) / group + 1;  // a2a.hpp's HeadSplit::kv_loc
  const auto t = static_cast<uint64_t>(local_tokens);
  const uint64_t g = saturating_mul(t, static_cast<uint64_t>(inner));
  const uint64_t es = dtype_size(c.dtype), f = sizeof(float);
  const auto dqk = static_cast<uint64_t>(c.head_dim_qk), dv = static_cast<uint64_t>(c.head_dim_v);
  const uint64_t dmax = std::max(dqk, dv);
  CpAttnConfig o = c;
  o.num_heads_q = hq_loc;
  o.num_heads_k = kv_loc;
  o.scheme = c.scheme == CpScheme::hybrid ? c.hybrid_outer : CpScheme::allgather;
  o.cp_inner = 0;
  o.split = CpSplit::padded;
  const auto g_rows = static_cast<int64_t>(std::min<uint64_t>(g, uint64_t{1} << 50));
  const CpMemoryEstimate in = estimate(o, outer, g_rows, saturating_mul(g, static_cast<uint64_t>(outer)), outer_work, nullptr);
  const auto hql = static_cast<uint64_t>(hq_loc), kvl = static_cast<uint64_t>(kv_loc);
  CpMemoryEstimate e;
  e.context = saturating_add(saturating_add(product(g, hql, dqk + dv, es), product(t, hq, f)), in.context);
  const uint64_t block = std::max({product(t, hq, dmax, es), product(g, kvl, dmax, es),
                                   product(t, hq, f)});  // the largest all-to-all, each way
  // The group layout's scratch: k, v, dk, dv (this member's KV heads), dout, dq (its query heads).
  const uint64_t group_layout = saturating_add(product(2, g, kvl, dqk + dv), product(g, hql, dqk + dv));
  e.buffers = saturating_add(saturating_add(saturating_mul(block, 2), saturating_mul(group_layout, es)),
                             saturating_add(saturating_add(product(g, hql, f), product(t, hkv, dmax, f)),
                                            saturating_add(saturating_mul(dmax, f), in.buffers)));
  e.kernel_scratch = in.kernel_scratch;
  return e;
}

// `work`: the plan's tasks; `outer_work`: the a2a level's outer plan's (a2a_outer_plan).
CpMemoryEstimate estimate(const CpAttnConfig& c, int cp, int64_t local_tokens, uint64_t gathered,
                          const WorkList* work, const WorkList* outer_work) {
  switch (c.scheme) {
    case CpScheme::pass_q:
      return pass_q(c, local_tokens, work);
    case CpScheme::a2a:
    case CpScheme::hybrid:
      return a2a(c, cp, local_tokens, outer_work);
    default:
      return gather_or_ring(c, cp, local_tokens, gathered, work);
  }
}

}  // namespace

uint64_t CpMemoryEstimate::total(int64_t contexts) const {
  return saturating_add(saturating_mul(context, static_cast<uint64_t>(contexts < 1 ? 1 : contexts)),
                        saturating_add(buffers, kernel_scratch));
}

std::string CpMemoryEstimate::describe() const {
  return "context " + format_bytes(context) + ", buffers " + format_bytes(buffers) + ", kernel scratch " +
         format_bytes(kernel_scratch);
}

CpMemoryEstimate cp_memory_estimate(const CpAttnConfig& cfg, int cp, int64_t local_tokens) {
  return estimate(cfg, cp, local_tokens, product(static_cast<uint64_t>(local_tokens), static_cast<uint64_t>(cp)),
                  nullptr, nullptr);
}

CpMemoryEstimate cp_memory_estimate(const CpAttnConfig& cfg, const RankPlan& plan) {
  if (cfg.scheme == CpScheme::a2a || cfg.scheme == CpScheme::hybrid)
    return cp_detail::a2a_memory_estimate(cfg, plan,
                                          detail::a2a_outer_plan(plan, detail::a2a_group_size(cfg, plan.cp)));
  const auto gathered = static_cast<uint64_t>(plan.split == CpSplit::padded ? plan.local_tokens * plan.cp
                                                                             : plan.layout.rank_begin.back());
  return estimate(cfg, plan.cp, plan.local_tokens, gathered, &plan.work, nullptr);
}

CpMemoryEstimate cp_detail::a2a_memory_estimate(const CpAttnConfig& cfg, const RankPlan& plan,
                                                const RankPlan& outer_plan) {
  return a2a(cfg, plan.cp, plan.local_tokens, &outer_plan.work);
}

}  // namespace cpattn
