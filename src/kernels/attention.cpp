// Public entry points: validation, then run-time dispatch to one kernel path.
#include "blocking.hpp"
#include "common.hpp"

#include <cpattn/attention.hpp>
#include <cpattn/error.hpp>

#include <cpuid.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <vector>

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

bool always() { return true; }
bool never() { return false; }

// The kernel paths, in KernelPath order: what each is called, whether this CPU runs it and
// its entry points (none for automatic, which resolves to another row, and for amx).
struct PathInfo {
  KernelPath path;
  std::string_view name;
  bool (*supported)();
  const kernels::KernelTable* table;
};
constexpr PathInfo kPaths[] = {
    {KernelPath::automatic, "automatic", always, nullptr},
    {KernelPath::portable, "portable", always, &kernels::portable::table},
    {KernelPath::avx2, "avx2", cpu_has_avx2_fma_f16c, &kernels::avx2::table},
    {KernelPath::avx512, "avx512", cpu_has_avx512, &kernels::avx512::table},
    {KernelPath::amx, "amx", never, nullptr},
};

constexpr bool in_enum_order() {
  for (size_t i = 0; i < std::size(kPaths); ++i)
    if (kPaths[i].path != static_cast<KernelPath>(i)) return false;
  return true;
}
static_assert(in_enum_order() && std::size(kPaths) == static_cast<size_t>(KernelPath::amx) + 1);

const PathInfo* find_path(KernelPath path) {
  const auto i = static_cast<size_t>(path);
  return i < std::size(kPaths) ? &kPaths[i] : nullptr;
}

// The one place a path is picked: the table of `path` (automatic: best_kernel_path()), which
// validation has checked this CPU supports.
const kernels::KernelTable& kernel_table(KernelPath path) {
  const PathInfo* info = find_path(path == KernelPath::automatic ? best_kernel_path() : path);
  CPATTN_CHECK(info != nullptr && info->table != nullptr, "kernel path ",
               static_cast<int>(path), " has no kernels");
  return *info->table;
}

template <class Int>
WorkList varlen_worklist_impl(std::span<const Int> cu_q, std::span<const Int> cu_k,
                              MaskType mask) {
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
    const int64_t ql = int64_t{cu_q[d + 1]} - cu_q[d], kl = int64_t{cu_k[d + 1]} - cu_k[d];
    CPATTN_CHECK(ql >= 1 && kl >= 1, "varlen_worklist: cu_seqlens must be strictly increasing, "
                 "document ", d, " has q_len ", ql, " and kv_len ", kl);
    CPATTN_CHECK(mask != MaskType::causal || ql <= kl, "varlen_worklist: document ", d,
                 " has q_len ", ql, " > kv_len ", kl,
                 " (a causal mask with bottom-right alignment needs q_len <= kv_len)");
    w.runs.push_back({.row = cu_k[d], .len = kl, .pos = 0});
    // Bottom-right alignment; a cross-attention document with more queries than keys (no
    // mask: positions do not matter but dropout's) starts its queries at 0.
    w.tasks.push_back({.q_row = cu_q[d], .q_len = ql, .q_pos = ql <= kl ? kl - ql : 0,
                       .doc = static_cast<int64_t>(d), .run_begin = static_cast<int64_t>(d),
                       .run_end = static_cast<int64_t>(d + 1)});
  }
  return w;
}

}  // namespace

namespace kernels {
void check_scratch_bound(size_t used_floats, size_t bound_floats) {
  CPATTN_CHECK(used_floats <= bound_floats, "internal: attention_backward allocated ",
               used_floats, " floats of scratch, more than the ", bound_floats,
               " of attention_backward_scratch_bytes (src/kernels/blocking.hpp)");
}
}  // namespace kernels

std::vector<float> alibi_slopes(int num_heads) {
  CPATTN_CHECK(num_heads >= 1, "alibi_slopes: num_heads must be >= 1, got ", num_heads);
  std::vector<float> s(static_cast<std::size_t>(num_heads));
  for (int h = 0; h < num_heads; ++h)
    s[static_cast<std::size_t>(h)] = std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(num_heads));
  return s;
}

float AttnInputs::softmax_scale() const {
  return options.softmax_scale ? *options.softmax_scale
                               : 1.0f / std::sqrt(static_cast<float>(q.dim));
}

KernelPath best_kernel_path() {
  // AVX-512 is not preferred automatically until it has been measured on a CPU that has it
  // (see docs/kernels.md); it is used only when forced.
  if (cpu_has_avx2_fma_f16c()) return KernelPath::avx2;
  return KernelPath::portable;
}

bool kernel_path_supported(KernelPath path) {
  const PathInfo* info = find_path(path);
  return info != nullptr && info->supported();
}

std::string_view to_string(KernelPath path) {
  const PathInfo* info = find_path(path);
  return info != nullptr ? info->name : "?";
}

bool dropout_keep(uint64_t seed, int64_t head, int64_t doc, int64_t q_pos, int64_t k_pos,
                  float p) {
  return kernels::dropout_keep_row(kernels::dropout_row_key(seed, head, doc, q_pos), k_pos,
                                   kernels::dropout_threshold(p));
}

void attention_forward(const AttnFwdParams& p) {
  kernels::validate(p);
  kernel_table(p.in.options.path).forward(p);
}

void attention_backward(const AttnBwdParams& p) {
  kernels::validate(p);
  kernel_table(p.in.options.path).backward(p);
}

WorkList varlen_worklist(std::span<const int64_t> cu_q, std::span<const int64_t> cu_k,
                         MaskType mask) {
  return varlen_worklist_impl(cu_q, cu_k, mask);
}

WorkList varlen_worklist(std::span<const int32_t> cu_q, std::span<const int32_t> cu_k,
                         MaskType mask) {
  return varlen_worklist_impl(cu_q, cu_k, mask);
}

size_t attention_backward_scratch_bytes(const AttnBwdParams& p) {
  int64_t max_q = 0;
  if (p.in.work)
    for (const AttnTask& t : p.in.work->tasks) max_q = std::max(max_q, t.q_len);
  const kernels::BwdScratchFloats f = kernels::backward_scratch_floats(
      p.in.k.rows, p.in.q.heads, p.in.k.heads, p.in.q.dim, p.in.v.dim, max_q);
  return sizeof(float) * f.total(p.in.options.num_threads);
}

}  // namespace cpattn
