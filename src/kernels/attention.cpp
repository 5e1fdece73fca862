// Public entry points: validation, then run-time dispatch to one kernel path.
#include "common.hpp"

#include <cpattn/attention.hpp>
#include <cpattn/error.hpp>

#include <cpuid.h>

namespace cpattn {
namespace {

bool cpu_has_avx2_fma_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool f16c = (c & bit_F16C) != 0;
  return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_avx512() {
  return cpu_has_avx2_fma_f16c() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}

KernelPath resolve(KernelPath p) { return p == KernelPath::automatic ? best_kernel_path() : p; }

}  // namespace

KernelPath best_kernel_path() {
  // AVX-512 is not preferred automatically until it has been measured on a CPU that has it
  // (see docs/kernels.md); it is used only when forced.
  if (cpu_has_avx2_fma_f16c()) return KernelPath::avx2;
  return KernelPath::portable;
}

bool kernel_path_supported(KernelPath path) {
  switch (path) {
    case KernelPath::automatic:
    case KernelPath::portable: return true;
    case KernelPath::avx2: return cpu_has_avx2_fma_f16c();
    case KernelPath::avx512: return cpu_has_avx512();
    case KernelPath::amx: return false;
  }
  return false;
}

std::string_view to_string(KernelPath path) {
  switch (path) {
    case KernelPath::automatic: return "automatic";
    case KernelPath::portable: return "portable";
    case KernelPath::avx2: return "avx2";
    case KernelPath::avx512: return "avx512";
    case KernelPath::amx: return "amx";
  }
  return "?";
}

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "?";
}

bool dropout_keep(uint64_t seed, int64_t head, int64_t doc, int64_t q_pos, int64_t k_pos,
                  float p) {
  return kernels::dropout_keep_row(kernels::dropout_row_key(seed, head, doc, q_pos), k_pos,
                                   kernels::dropout_threshold(p));
}

void attention_forward(const AttnFwdParams& p) {
  kernels::validate(p);
  switch (resolve(p.path)) {
    case KernelPath::avx2: kernels::avx2::forward(p); return;
    case KernelPath::avx512: kernels::avx512::forward(p); return;
    default: kernels::portable::forward(p); return;
  }
}

void attention_backward(const AttnBwdParams& p) {
  kernels::validate(p);
  switch (resolve(p.path)) {
    case KernelPath::avx2: kernels::avx2::backward(p); return;
    case KernelPath::avx512: kernels::avx512::backward(p); return;
    default: kernels::portable::backward(p); return;
  }
}

WorkList varlen_worklist(std::span<const int64_t> cu_q, std::span<const int64_t> cu_k) {
  CPATTN_CHECK(cu_q.size() >= 2, "varlen_worklist: cu_seqlens_q needs >= 2 entries, got ",
               cu_q.size());
  CPATTN_CHECK(cu_q.size() == cu_k.size(), "varlen_worklist: cu_seqlens_q has ", cu_q.size(),
               " entries but cu_seqlens_k has ", cu_k.size());
  CPATTN_CHECK(cu_q[0] == 0 && cu_k[0] == 0,
               "varlen_worklist: cu_seqlens must start at 0, got cu_seqlens_q[0] = ", cu_q[0],
               ", cu_seqlens_k[0] = ", cu_k[0]);
  WorkList w;
  const size_t n = cu_q.size() - 1;
  w.tasks.reserve(n);
  w.runs.reserve(n);
  for (size_t d = 0; d < n; ++d) {
    const int64_t ql = cu_q[d + 1] - cu_q[d], kl = cu_k[d + 1] - cu_k[d];
    CPATTN_CHECK(ql >= 1 && kl >= 1, "varlen_worklist: cu_seqlens must be strictly increasing, "
                 "document ", d, " has q_len ", ql, " and kv_len ", kl);
    CPATTN_CHECK(ql <= kl, "varlen_worklist: document ", d, " has q_len ", ql,
                 " > kv_len ", kl, " (bottom-right alignment needs q_len <= kv_len)");
    w.runs.push_back({.row = cu_k[d], .len = kl, .pos = 0});
    w.tasks.push_back({.q_row = cu_q[d], .q_len = ql, .q_pos = kl - ql,
                       .doc = static_cast<int64_t>(d), .run_begin = static_cast<int64_t>(d),
                       .run_end = static_cast<int64_t>(d + 1)});
  }
  return w;
}

size_t attention_backward_scratch_bytes(const AttnBwdParams& p) {
  const size_t pad = 16, bk = 64;
  const size_t dp = (static_cast<size_t>(p.head_dim_qk) + pad - 1) / pad * pad;
  const size_t dvp = (static_cast<size_t>(p.head_dim_v) + pad - 1) / pad * pad;
  const size_t tk = (static_cast<size_t>(p.total_k) + bk - 1) / bk * bk;
  size_t max_q = 0;
  if (p.work)
    for (const AttnTask& t : p.work->tasks) max_q = std::max(max_q, static_cast<size_t>(t.q_len));
  const size_t packed_kv = static_cast<size_t>(p.num_heads_k) * tk * 2 * (dp + dvp);
  const size_t per_head_grads = static_cast<size_t>(p.num_heads_q) * p.total_k * (dp + dvp);
  // per thread: q, dq and q panels [max_q][dp]; dout and its panels [max_q][dvp]; lse, delta;
  // S, P, dP blocks [128][64] (kernel_impl.hpp's BQB x BK); the piece's dK, dV tiles
  // [64][dp + dvp]
  const size_t per_thread = max_q * (3 * dp + 2 * dvp + 2) + 3 * 128 * 64 + 64 * (dp + dvp);
  return 4 * (packed_kv + per_head_grads +
              per_thread * static_cast<size_t>(std::max(p.num_threads, 1)));
}

}  // namespace cpattn
