// cp_memory_estimate: what cp_attention.cpp's forward and backward allocate, buffer by buffer
// (keep the two in step: CpStats::peak_buffer_bytes measures what the estimate predicts, and
// tests/cp compares them).
#include <cpattn/attention.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/memory.hpp>

#include <algorithm>
#include <string>

namespace cpattn {
namespace {

// a * b * c * d, saturating (absurd requests must give a huge number, not a wrapped one).
uint64_t product(uint64_t a, uint64_t b, uint64_t c = 1, uint64_t d = 1) {
  return saturating_mul(saturating_mul(a, b), saturating_mul(c, d));
}

CpMemoryEstimate estimate(const CpAttnConfig& c, int cp, int64_t local_tokens, const WorkList* work) {
  const auto t = static_cast<uint64_t>(local_tokens);
  const uint64_t es = dtype_size(c.dtype), f = sizeof(float);
  const auto hq = static_cast<uint64_t>(c.num_heads_q);
  const auto kv_row = static_cast<uint64_t>(c.num_heads_k) * static_cast<uint64_t>(c.head_dim_qk + c.head_dim_v);
  const uint64_t lse = product(t, hq, f);
  const bool ring = c.scheme == CpScheme::ring;
  const uint64_t kv_rows = ring ? t : product(t, static_cast<uint64_t>(cp));  // the gathered keys
  // Index mode copies each task's keys: a document's front and back chunks both read its
  // first chunks, so the copy holds up to twice the gathered rows.
  const bool index = !ring && c.kv_mode == KvMode::index;
  const uint64_t read_rows = index ? saturating_mul(kv_rows, 2) : kv_rows;  // the keys a kernel call reads
  CpMemoryEstimate e;
  e.context = saturating_add(product(read_rows, kv_row, es), lse);
  if (ring) {
    // Double-buffered visiting blocks and their fp32 dK/dV; fp32 copies of q, the block, out,
    // dout, the running merge and dq (cp_attention.cpp's qf ... dq_part).
    const uint64_t copies = saturating_add(
        product(t, hq, static_cast<uint64_t>(3 * c.head_dim_qk + 4 * c.head_dim_v + 2)), product(t, kv_row));
    e.buffers = saturating_add(saturating_add(product(2, t, kv_row, es), product(2, t, kv_row, f)),
                               saturating_mul(copies, f));
  } else {
    // dK/dV of every gathered row and this rank's share, fp32; index mode adds the copy's
    // dK/dV and, during forward, the gathered buffer beside its copy.
    e.buffers = saturating_add(product(kv_rows, kv_row, f), product(t, kv_row, f));
    if (index)
      e.buffers = saturating_add(e.buffers, saturating_add(product(read_rows, kv_row, f), product(kv_rows, kv_row, es)));
  }
  const auto rows = static_cast<int64_t>(std::min<uint64_t>(read_rows, uint64_t{1} << 50));  // keeps the kernel's sum finite
  const AttnBwdParams p{
      .in = {.q = {nullptr, std::min<int64_t>(local_tokens, int64_t{1} << 50), c.num_heads_q, c.head_dim_qk, c.dtype},
             .k = {nullptr, rows, c.num_heads_k, c.head_dim_qk, c.dtype},
             .v = {nullptr, rows, c.num_heads_k, c.head_dim_v, c.dtype},
             .work = work,
             .options = c.options}};
  e.kernel_scratch = attention_backward_scratch_bytes(p);
  return e;
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
  return estimate(cfg, cp, local_tokens, nullptr);
}

CpMemoryEstimate cp_memory_estimate(const CpAttnConfig& cfg, const RankPlan& plan) {
  return estimate(cfg, plan.cp, plan.local_tokens, &plan.work);
}

}  // namespace cpattn
