// Public entry points: validation, then run-time dispatch to one kernel path.
#include "blocking.hpp"
#include "common.hpp"

#include <cpattn/attention.hpp>
#include <cpattn/error.hpp>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace cpattn {
namespace {

bool detect_avx2_fma_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool f16c = (c & bit_F16C) != 0;
  return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool detect_avx512() {
  return detect_avx2_fma_f16c() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}

// AVX512_BF16: CPUID leaf 7 sub-leaf 1, EAX bit 5 (the OS's zmm state is checked by avx512f).
bool detect_avx512_bf16() {
#if defined(__clang__)
  return false;  // kernel_avx512_bf16.cpp is built by GCC only
#else
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!detect_avx512() || !__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return (a & (1u << 5)) != 0;
#endif
}

// AMX: CPUID leaf 7 sub-leaf 0 EDX bits 24 (AMX-TILE) and 22 (AMX-BF16); the OS's tile state
// in XCR0 (bits 17 XTILECFG, 18 XTILEDATA, read by XGETBV once OSXSAVE says it may be); and
// Linux's permission for this process to use tile data, asked for once per process
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; Linux 5.16 and later grant it unless
// the process's signal stack limit forbids it). Without the permission the first tile
// instruction would fault, so the path is refused. The amx path's fp32 code is AVX-512's, and
// it rounds to bf16 with AVX512_BF16 (which every CPU with AMX-BF16 has), so it needs that too.
bool detect_amx() {
#if defined(__clang__)
  return false;  // kernel_amx.cpp is built by GCC only
#else
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!detect_avx512_bf16() || !__get_cpuid(1, &a, &b, &c, &d) || (c & bit_OSXSAVE) == 0) return false;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || (d & (1u << 24)) == 0 || (d & (1u << 22)) == 0) return false;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  asm volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#endif
}

// Each answer is read once per process: CPUID is serializing, and under a hypervisor it traps
// to it (perf put 0.8% of a CP = 2 training rank's samples at 1024 tokens in these checks,
// which every attention call's dispatch and validation ran before).
bool cpu_has_avx2_fma_f16c() {
  static const bool has = detect_avx2_fma_f16c();
  return has;
}
bool cpu_has_avx512() {
  static const bool has = detect_avx512();
  return has;
}
bool cpu_has_avx512_bf16() {
  static const bool has = detect_avx512_bf16();
  return has;
}
bool cpu_has_amx() {  // the permission is asked for once per process, here
  static const bool has = detect_amx();
  return has;
}

// An Intel CPU (CPUID leaf 0's vendor "GenuineIntel"): the bf16 preference order depends on it
// (kPreferBf16Intel, below).
bool cpu_is_intel() {
  static const bool intel = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    return b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;  // "Genu" "ineI" "ntel"
  }();
  return intel;
}

bool always() { return true; }

// The kernel paths, in KernelPath order: what each is called, whether this CPU runs it (and
// what it needs, in words), and its entry points (none for automatic, which resolves to
// another row).
struct PathInfo {
  KernelPath path;
  std::string_view name;
  bool (*supported)();
  std::string_view needs;
  const kernels::KernelTable* table;
};
constexpr PathInfo kPaths[] = {
    {KernelPath::automatic, "automatic", always, "", nullptr},
    {KernelPath::portable, "portable", always, "x86-64", &kernels::portable::table},
    {KernelPath::avx2, "avx2", cpu_has_avx2_fma_f16c, "AVX2, FMA and F16C", &kernels::avx2::table},
    {KernelPath::avx512, "avx512", cpu_has_avx512, "AVX-512F/BW/DQ/VL", &kernels::avx512::table},
    {KernelPath::avx512_bf16, "avx512_bf16", cpu_has_avx512_bf16, "AVX-512F/BW/DQ/VL and AVX512_BF16",
     &kernels::avx512_bf16::table},
    {KernelPath::bf16_emulated, "bf16_emulated", cpu_has_avx2_fma_f16c, "AVX2, FMA and F16C",
     &kernels::bf16_emulated::table},
    {KernelPath::amx, "amx", cpu_has_amx,
     "AVX-512F/BW/DQ/VL, AVX512_BF16, AMX-TILE and AMX-BF16, the OS's tile state (XCR0 XTILECFG and XTILEDATA) and "
     "Linux's permission to use tile data (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16 or later; refused when "
     "the OS denies it, since the first tile instruction would then fault)",
     &kernels::amx::table},
    {KernelPath::amx_emulated, "amx_emulated", cpu_has_avx2_fma_f16c, "AVX2, FMA and F16C",
     &kernels::amx_emulated::table},
};

constexpr bool in_enum_order() {
  for (size_t i = 0; i < std::size(kPaths); ++i)
    if (kPaths[i].path != static_cast<KernelPath>(i)) return false;
  return true;
}
static_assert(in_enum_order() && std::size(kPaths) == static_cast<size_t>(KernelPath::amx_emulated) + 1);

const PathInfo* find_path(KernelPath path) {
  const auto i = static_cast<size_t>(path);
  return i < std::size(kPaths) ? &kPaths[i] : nullptr;
}

// What `automatic` prefers, fastest first, by what was measured (docs/kernels.md, "Paths and
// dispatch"): avx512 over avx2 from issue 14's Zen 4 runs (every kernel test passes, 2-4%
// faster); for bf16 storage, amx first (on an Intel Xeon with AMX-BF16, 2026-12-02: about 3x
// the avx512 path forward and backward), then avx512_bf16 over avx512 on AMD (Zen 4: 1.6-1.8x,
// vdpbf16ps doing two fp32 FMAs' work per instruction there) and avx512 over avx512_bf16 on
// Intel (Xeons of family 6 models 167 and 207: avx512_bf16 ran 0.57-0.76x avx512, vdpbf16ps at
// half the FMA rate there; it matters where AMX is absent or its tile state is not granted).
// fp16 storage keeps the vector order: the amx path runs fp16 on tiles only with AMX-FP16,
// which no machine here had (without it, amx's fp16 is avx512's code). portable runs everywhere.
constexpr KernelPath kPreferBf16[] = {KernelPath::amx, KernelPath::avx512_bf16, KernelPath::avx512,
                                      KernelPath::avx2, KernelPath::portable};
constexpr KernelPath kPreferBf16Intel[] = {KernelPath::amx, KernelPath::avx512, KernelPath::avx512_bf16,
                                           KernelPath::avx2, KernelPath::portable};
constexpr KernelPath kPreferF16[] = {KernelPath::avx512, KernelPath::avx2, KernelPath::portable};
constexpr KernelPath kPreferOther[] = {KernelPath::avx512, KernelPath::avx2, KernelPath::portable};

std::span<const KernelPath> preference(DType dtype) {
  if (dtype == DType::bf16) return cpu_is_intel() ? std::span<const KernelPath>(kPreferBf16Intel) : kPreferBf16;
  if (dtype == DType::f16) return kPreferF16;
  return kPreferOther;
}

std::string path_names() {
  std::string s;
  for (const PathInfo& p : kPaths) s += (s.empty() ? "" : ", ") + std::string(p.name);
  return s;
}

// CPATTN_KERNEL_PATH: automatic when unset, empty or "automatic".
KernelPath env_kernel_path() {
  const char* v = std::getenv("CPATTN_KERNEL_PATH");
  if (v == nullptr || *v == '\0') return KernelPath::automatic;
  for (const PathInfo& p : kPaths)
    if (p.name == v) {
      CPATTN_CHECK(p.supported(), "CPATTN_KERNEL_PATH=", v, " cannot run on this CPU (the ", v,
                   " path needs ", p.needs, "); unset it or name a path this CPU runs (automatic picks ",
                   to_string(best_kernel_path(DType::f32)), " for fp32, ", to_string(best_kernel_path(DType::bf16)),
                   " for bf16, ", to_string(best_kernel_path(DType::f16)), " for fp16)");
      return p.path;
    }
  throw Error("CPATTN_KERNEL_PATH must be one of " + path_names() + " (or unset), got '" + std::string(v) + "'");
}

// The one place a path is picked: the table that resolve_kernel_path gives (validation has
// checked that this CPU supports it).
const kernels::KernelTable& kernel_table(KernelPath path, DType dtype) {
  const KernelPath chosen = resolve_kernel_path(path, dtype).path;
  const PathInfo* info = find_path(chosen);
  CPATTN_CHECK(info != nullptr && info->table != nullptr, "kernel path ", to_string(chosen),
               " has no kernels");
  return *info->table;
}

// (The list is the same under every mask: the kernels read the mask from the options.)
template <class Int>
WorkList varlen_worklist_impl(std::span<const Int> cu_q, std::span<const Int> cu_k) {
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
    CPATTN_CHECK(ql >= 0 && kl >= 0, "varlen_worklist: cu_seqlens must not decrease, document ", d, " has q_len ",
                 ql, " and kv_len ", kl);
    // A document empty on both sides (a padded batch's, as FlashAttention takes them): no task,
    // no rows. Empty on one side only would leave rows unwritten (out of queries that see no
    // key; dk/dv of keys no query reads): refused.
    if (ql == 0 && kl == 0) continue;
    CPATTN_CHECK(ql >= 1 && kl >= 1, "varlen_worklist: document ", d, " has q_len ", ql, " and kv_len ", kl,
                 ": a document is empty on both sides or on neither");
    // Bottom-right alignment (FlashAttention's): query i sits at key position i + kl - ql.
    // With more queries than keys that is negative for the first ones, so there the keys start
    // at position ql - kl and the queries at 0: the same differences, which are all that the
    // masks, windows and ALiBi read (dropout reads the positions). Under a causal mask the first
    // ql - kl queries then see no key (out 0, lse -inf), as in FlashAttention 2.1 and later.
    const auto run = static_cast<int64_t>(w.runs.size());
    w.runs.push_back({.row = cu_k[d], .len = kl, .pos = ql <= kl ? 0 : ql - kl});
    w.tasks.push_back({.q_row = cu_q[d], .q_len = ql, .q_pos = ql <= kl ? kl - ql : 0,
                       .doc = static_cast<int64_t>(d), .run_begin = run, .run_end = run + 1});
  }
  return w;
}

}  // namespace

namespace kernels {
bool cpu_has_amx_fp16() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return cpu_has_amx() && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 21)) != 0;
  }();
  return has;
}

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

KernelPath best_kernel_path(DType dtype) {
  for (const KernelPath p : preference(dtype))
    if (find_path(p)->supported()) return p;
  return KernelPath::portable;
}

KernelChoice resolve_kernel_path(KernelPath requested, DType dtype) {
  if (requested != KernelPath::automatic)
    return {.path = requested, .reason = "forced by AttnOptions::path", .forced_by_env = false};
  const KernelPath env = env_kernel_path();
  if (env != KernelPath::automatic)
    return {.path = env, .reason = "forced by the environment (CPATTN_KERNEL_PATH=" + std::string(to_string(env)) + ")",
            .forced_by_env = true};
  const KernelPath best = best_kernel_path(dtype);
  std::string order, skipped;
  bool before = true;  // p comes before best in the order
  for (const KernelPath p : preference(dtype)) {
    order += (order.empty() ? "" : " > ") + std::string(to_string(p));
    if (p == best) before = false;
    if (before)
      skipped += (skipped.empty() ? "; skipped " : ", ") + std::string(to_string(p)) + " (needs " +
                 std::string(find_path(p)->needs) + ")";
  }
  const std::string reason = "chosen automatically: " + std::string(to_string(best)) +
                             " is the first path this CPU runs in the measured preference order for " +
                             std::string(to_string(dtype)) + " storage" +
                             (dtype == DType::bf16 ? cpu_is_intel() ? " on Intel CPUs" : " on non-Intel CPUs" : "") +
                             ", " + order + " (docs/kernels.md)" + skipped;
  return {.path = best, .reason = reason, .forced_by_env = false};
}

KernelPath parse_kernel_path(std::string_view name) {
  for (const PathInfo& p : kPaths)
    if (p.name == name) return p.path;
  throw Error("kernel path must be one of " + path_names() + ", got '" + std::string(name) + "'");
}

bool kernel_path_supported(KernelPath path) {
  const PathInfo* info = find_path(path);
  return info != nullptr && info->supported();
}

std::string_view to_string(KernelPath path) {
  const PathInfo* info = find_path(path);
  return info != nullptr ? info->name : "?";
}

namespace kernels {
const KernelTable* path_table(KernelPath path) {
  const PathInfo* info = find_path(path);
  return info != nullptr ? info->table : nullptr;
}
}  // namespace kernels

bool dropout_keep(uint64_t seed, int64_t head, int64_t doc, int64_t q_pos, int64_t k_pos,
                  float p) {
  return kernels::dropout_keep_row(kernels::dropout_row_key(seed, head, doc, q_pos), k_pos,
                                   kernels::dropout_threshold(p));
}

std::size_t attention_kv_pack_bytes(int64_t total_k, int num_heads_k, int head_dim_qk, int head_dim_v,
                                    KvPackLayout layout) {
  // pack_kv's float panels or pack_kv_tiles' pairs (kernel_impl.hpp): K^T, then V (forward) or
  // K and V^T (backward), each [Hkv][key rows rounded up to BK][dims padded] elements.
  CPATTN_CHECK(total_k >= 0 && num_heads_k >= 0 && head_dim_qk >= 0 && head_dim_v >= 0,
               "attention_kv_pack_bytes: total_k, num_heads_k, head_dim_qk and head_dim_v must be >= 0, got ", total_k,
               ", ", num_heads_k, ", ", head_dim_qk, ", ", head_dim_v);
  if (layout == KvPackLayout::alone) return 0;
  const std::size_t element = layout == KvPackLayout::fp32 ? sizeof(float) : sizeof(uint16_t);
  const auto blocks = static_cast<std::size_t>(total_k / kernels::BK + (total_k % kernels::BK != 0));
  const auto pad = [](int d) { return (static_cast<std::size_t>(d) + kernels::PAD - 1) / kernels::PAD * kernels::PAD; };
  const std::size_t row_elems = 2 * pad(head_dim_qk) + pad(head_dim_v);  // (each < 2^32: no wrap)
  std::size_t bytes = 0;
  const bool wraps = __builtin_mul_overflow(blocks, std::size_t{kernels::BK} * element, &bytes) ||
                     __builtin_mul_overflow(bytes, static_cast<std::size_t>(num_heads_k), &bytes) ||
                     __builtin_mul_overflow(bytes, row_elems, &bytes);
  CPATTN_CHECK(!wraps, "attention_kv_pack_bytes: total_k = ", total_k, " keys of ", num_heads_k, " KV heads (head dims ",
               head_dim_qk, ", ", head_dim_v, ") need more bytes than size_t holds");
  return bytes;
}

namespace {
// How the kernels of the table a call runs take its products (dot_for, kernel_impl.hpp, which
// tests CPATTN_BF16_DOT before CPATTN_AMX, as the tables' fields are set: kernel_isa.inc):
// bf16 storage as bf16 dot products (avx512_bf16, bf16_emulated: K/V packed in floats and
// pairs) or on tiles (the amx paths: pairs alone, bf16 copies of the query side); everything
// else on floats. Only bf16 storage resolves the path, so that a bad CPATTN_KERNEL_PATH is
// found by the kernel call itself, as for every other dtype.
struct CallProducts {
  bool bf16_pairs = false, bf16_tiles = false;
};
CallProducts call_products(KernelPath path, DType dtype) {
  if (dtype != DType::bf16) return {};
  const kernels::KernelTable& table = kernel_table(path, DType::bf16);
  const bool pairs = table.bf16_dot != nullptr;
  return {.bf16_pairs = pairs, .bf16_tiles = !pairs && table.tile_dot != nullptr};
}

// The layout backward_impl gives a KvGradShare for these params (bf16 tiles, as
// attention_backward_scratch_bytes decides them: the table the call runs).
// With no work list: the layout of the most head sets any work list gives (the longest tasks).
kernels::GradShareLayout grad_share_layout_of(const AttnBwdParams& p) {
  int64_t max_q = p.in.work ? p.longest_task : std::numeric_limits<int64_t>::max();
  if (p.in.work)
    for (const AttnTask& t : p.in.work->tasks) max_q = std::max(max_q, t.q_len);
  const bool tiles = call_products(p.in.options.path, p.in.dtype()).bf16_tiles;
  return kernels::grad_share_layout(p.in.k.rows, p.in.q.heads, p.in.k.heads, p.in.q.dim, p.in.v.dim, max_q, tiles,
                                    p.in.softmax_scale());
}

}  // namespace

std::size_t attention_grad_share_bytes(const AttnBwdParams& p) {
  const kernels::GradShareLayout L = grad_share_layout_of(p);
  CPATTN_CHECK(L.total_k >= 0 && L.hkv >= 0 && L.dqk >= 0 && L.dv >= 0, "attention_grad_share_bytes: k.rows = ",
               L.total_k, ", k.heads = ", L.hkv, " and the head dims must be >= 0");
  const auto bytes = L.checked_bytes();
  CPATTN_CHECK(bytes.has_value(), "attention_grad_share_bytes: total_k = ", L.total_k, " keys of ", L.hkv,
               " KV heads (", L.sets, " head sets, head dims ", L.dqk, ", ", L.dv, ") need more bytes than size_t holds");
  return *bytes;
}

void attention_grad_share_rows(const std::byte* buffer, std::size_t bytes, const AttnShape& shape, int64_t r0,
                               int64_t n, float* dk, float* dv) {
  const char* fn = "attention_grad_share_rows";
  CPATTN_CHECK(buffer != nullptr && bytes >= sizeof(kernels::GradShareLayout) &&
                   reinterpret_cast<uintptr_t>(buffer) % alignof(float) == 0,
               fn, ": buffer must be a float-aligned pointer to at least the header's ",
               sizeof(kernels::GradShareLayout), " bytes");
  kernels::GradShareLayout L;
  std::memcpy(&L, buffer, sizeof L);
  // A header that no backward wrote, or that a stray write changed: refused, not followed
  // (total_k first: every key row takes bytes, so nothing below overflows).
  const bool sane = L.magic == kernels::GradShareLayout::kMagic && L.total_k >= 0 &&
                    static_cast<uint64_t>(L.total_k) <= bytes && L.hkv >= 1 && L.sets >= 1 &&
                    static_cast<uint64_t>(L.sets) <= bytes && L.dqk >= 1 && L.dqk <= 256 && L.dv >= 1 &&
                    L.dv <= 256 && L.dp == kernels::pad_up(L.dqk) &&
                    L.dvp == kernels::pad_up(L.dv) && (L.transposed == 0 || L.transposed == 1) &&
                    L.nbb == (L.total_k + kernels::BBK - 1) / kernels::BBK &&
                    L.g_rows == (L.transposed ? L.nbb * kernels::BBK : L.total_k);
  CPATTN_CHECK(sane, fn, ": the buffer holds no backward's partial sums (a KvGradShare's buffer after "
               "attention_backward returned), or its header was overwritten");
  const auto need = L.checked_bytes();
  CPATTN_CHECK(need.has_value() && *need <= bytes, fn, ": the buffer has ", bytes,
               " bytes, the layout in its header needs ",
               need ? std::to_string(*need) : std::string("more than size_t holds"));
  // The rows written are the caller's: its shape must be the header's.
  CPATTN_CHECK(shape.num_heads_k == L.hkv && shape.head_dim_qk == L.dqk && shape.head_dim_v == L.dv, fn,
               ": the caller's num_heads_k, head_dim_qk, head_dim_v are ", shape.num_heads_k, ", ", shape.head_dim_qk,
               ", ", shape.head_dim_v, "; the buffer's backward had ", L.hkv, ", ", L.dqk, ", ", L.dv);
  CPATTN_CHECK(r0 >= 0 && n >= 0 && r0 <= L.total_k - n, fn, ": rows [", r0, ", ", r0 + n,
               ") are not within the call's ", L.total_k, " key rows");
  CPATTN_CHECK(n == 0 || (dk != nullptr && dv != nullptr), fn, ": dk and dv must not be null");
  if (n == 0) return;
  // The path automatic picks, without resolve_kernel_path's reasons (a CP rank calls this
  // cp times per few rows).
  const KernelPath env = env_kernel_path();
  find_path(env != KernelPath::automatic ? env : best_kernel_path(DType::f32))->table->grad_share_rows(L, buffer, r0,
                                                                                                       n, dk, dv);
}

KvPackLayout attention_kv_pack_layout(KernelPath path, DType dtype) {
  try {
    const CallProducts c = call_products(path, dtype);
    return c.bf16_tiles ? KvPackLayout::bf16_tiles : c.bf16_pairs ? KvPackLayout::alone : KvPackLayout::fp32;
  } catch (const Error&) {
    return KvPackLayout::alone;
  }
}

void attention_forward(const AttnFwdParams& p) {
  kernels::validate(p);
  kernel_table(p.in.options.path, p.in.dtype()).forward(p);
}

void attention_backward(const AttnBwdParams& p) {
  kernels::validate(p);
  kernel_table(p.in.options.path, p.in.dtype()).backward(p);
}

WorkList varlen_worklist(std::span<const int64_t> cu_q, std::span<const int64_t> cu_k, MaskType) {
  return varlen_worklist_impl(cu_q, cu_k);
}

WorkList varlen_worklist(std::span<const int32_t> cu_q, std::span<const int32_t> cu_k, MaskType) {
  return varlen_worklist_impl(cu_q, cu_k);
}

size_t attention_backward_scratch_bytes(const AttnBwdParams& p) {
  int64_t max_q = p.longest_task;  // (as backward_impl takes it)
  if (p.in.work)
    for (const AttnTask& t : p.in.work->tasks) max_q = std::max(max_q, t.q_len);
  return attention_backward_scratch_bytes(p, max_q);
}

size_t attention_backward_scratch_bytes(const AttnBwdParams& p, int64_t longest_task) {
  const int64_t max_q = std::clamp<int64_t>(longest_task, 0, std::max<int64_t>(p.in.q.rows, 0));
  // (blocking.hpp: bf16 products pack K/V in pairs too, tiles keep bf16 copies of the query side)
  const CallProducts c = call_products(p.in.options.path, p.in.dtype());
  kernels::BwdScratchFloats f = kernels::backward_scratch_floats(
      p.in.k.rows, p.in.q.heads, p.in.k.heads, p.in.q.dim, p.in.v.dim, max_q, c.bf16_pairs, c.bf16_tiles);
  // backward_impl starts at most one thread per unit (kv head and head set) and per item of its
  // final sum, whatever num_threads asks (every thread asked for counted a thread's buffers:
  // 64 threads over 8 units were 8 times the scratch).
  const int threads = p.in.options.num_threads;
  const int64_t units =
      int64_t{p.in.k.heads} * kernels::bwd_sets(p.in.q.heads, p.in.k.heads, max_q, c.bf16_tiles);
  const int64_t unit_threads = kernels::threads_started(units, threads),
                fin_threads = kernels::threads_started(kernels::bwd_final_items(p.in.k.rows, c.bf16_tiles), threads);
  // A shape-only request (a memory estimate) of absurd sizes would wrap size_t: the same sum in
  // double says so, and the bytes saturate (every real call's sizes are far inside).
  const double approx = kernels::backward_scratch_floats<double>(p.in.k.rows, p.in.q.heads, p.in.k.heads, p.in.q.dim,
                                                                 p.in.v.dim, max_q, c.bf16_pairs, c.bf16_tiles)
                            .total(unit_threads, fin_threads);
  if (approx * sizeof(float) > 0x1p62) return std::numeric_limits<size_t>::max();
  if (p.grad_share) f.per_set_grads = 0;  // the share's buffer holds them
  return sizeof(float) * f.total(unit_threads, fin_threads);
}

}  // namespace cpattn
