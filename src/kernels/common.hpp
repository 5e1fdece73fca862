// Internal pieces shared by the reference, the fast paths and the dispatcher.
#pragma once

#include <cpattn/attention.hpp>
#include <cpattn/dtype.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <functional>
#include <exception>
#include <new>
#include <thread>
#include <vector>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <cstring>

namespace cpattn::kernels {

// ---- storage types ----------------------------------------------------------------------
// The conversions and dtype_size are cpattn's own (cpattn/dtype.hpp).

// Element i of a tensor of storage type t, as fp32.
inline float load_elem(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}
inline void store_elem(void* base, DType t, int64_t i, float x) {
  switch (t) {
    case DType::f32: static_cast<float*>(base)[i] = x; return;
    case DType::f16: static_cast<uint16_t*>(base)[i] = f32_to_f16(x); return;
    case DType::bf16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(x); return;
  }
}

// ---- dropout ----------------------------------------------------------------------------
// splitmix64's finalizer: a bijective mix with full avalanche. Chaining it over the key's
// fields gives a counter-based generator (no state, any order of evaluation).
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// Keep threshold: an entry is kept iff its 32-bit draw is >= p * 2^32.
inline uint32_t dropout_threshold(float p) {
  return static_cast<uint32_t>(std::fmin(static_cast<double>(p) * 4294967296.0, 4294967295.0));
}
inline uint64_t dropout_row_key(uint64_t seed, int64_t head, int64_t doc, int64_t q_pos) {
  return mix64(mix64(mix64(seed ^ static_cast<uint64_t>(head)) ^ static_cast<uint64_t>(doc)) ^
               static_cast<uint64_t>(q_pos));
}
inline bool dropout_keep_row(uint64_t row_key, int64_t k_pos, uint32_t threshold) {
  return static_cast<uint32_t>(mix64(row_key ^ static_cast<uint64_t>(k_pos)) >> 32) >= threshold;
}

// ---- masks (AttnOptions' window, softcap, alibi) ---------------------------------------
// Which key positions a query position sees: qp - lo <= kp <= qp + hi, a side unbounded when
// its flag is false. Causal is hi = 0 (FlashAttention: causal intersects the window).
struct Visibility {
  bool lo_bounded = false, hi_bounded = false;
  int64_t lo = 0, hi = 0;
  bool softcap = false, alibi = false;  // per-element score transforms
  bool extra() const { return lo_bounded || softcap || alibi || (hi_bounded && hi != 0); }
  bool sees(int64_t qp, int64_t kp) const {
    return (!lo_bounded || kp >= qp - lo) && (!hi_bounded || kp <= qp + hi);
  }
};
inline Visibility visibility(const AttnOptions& o) {
  Visibility v;
  v.lo_bounded = o.window_size_left >= 0;
  v.lo = o.window_size_left;
  if (o.mask == MaskType::causal) {
    v.hi_bounded = true;
    v.hi = 0;
  } else if (o.window_size_right >= 0) {
    v.hi_bounded = true;
    v.hi = o.window_size_right;
  }
  v.softcap = o.softcap > 0.0f;
  v.alibi = o.alibi_slopes != nullptr;
  return v;
}

// ---- validation (validate.cpp) ----------------------------------------------------------
void validate(const AttnFwdParams& p);
void validate(const AttnBwdParams& p);

// ---- work splitting ---------------------------------------------------------------------
// parallel_for(n, threads, fn): calls fn(i, thread) for i in [0, n), item i on thread
// i % threads (static, so the assignment never depends on timing). std::thread based. It runs
// threads_started(n, threads) threads: per-thread buffers are sized by that, never by what
// num_threads asks.
template <class Fn>
void parallel_for(int64_t n, int threads, Fn&& fn);
// parallel_for_dynamic(n, threads, fn): the same calls, items handed out in order to whichever
// thread is free (an atomic counter), so that a thread that runs slower takes fewer. Only for
// loops whose items write disjoint results, none of which depends on what an earlier item left
// in the thread's scratch: then no result depends on which thread ran an item, or when.
template <class Fn>
void parallel_for_dynamic(int64_t n, int threads, Fn&& fn);
constexpr int threads_started(int64_t n, int threads) {
  return static_cast<int>(std::min<int64_t>(std::max(threads, 1), std::max<int64_t>(n, 1)));
}

// ---- fast paths (kernel_*.cpp, one source compiled per ISA) -----------------------------
// A kernel path's entry points. Each kernel_<path>.cpp defines its `table`; attention.cpp
// picks one (kernel_table) after validation, so the kernels trust their arguments.
struct GradShareLayout;  // blocking.hpp

struct KernelTable {
  void (*forward)(const AttnFwdParams& p);
  void (*backward)(const AttnBwdParams& p);
  // The bf16 paths' dot-product step alone (kernel_impl.hpp, Bf16Dot), for its tests: acc[i] +=
  // the two products of the bf16 pairs a[i], b[i] (even element in the low half), `lanes` a
  // multiple of 16. nullptr on the other paths: not null exactly where bf16 storage's products
  // run as bf16 dot products (attention_backward_scratch_bytes reads it so).
  void (*bf16_dot)(float* acc, const uint32_t* a, const uint32_t* b, int lanes) = nullptr;
  // The bf16 paths' rounding of fp32 operands to pairs alone (Bf16Dot::words and rows), for
  // its tests: words[j] = the pair (x[2j], x[2j + 1]); rows[16 k + c] = the pair (x[32 k + c],
  // x[32 k + 16 + c]); n a multiple of 32. nullptr where bf16_dot is.
  void (*bf16_pack)(const float* x, int n, uint32_t* words, uint32_t* rows) = nullptr;
  // The amx paths' tile product alone (kernel_impl.hpp, Tiles), for its tests: one TDPBF16PS
  // (fp16 false) or TDPFP16PS (fp16 true) on tiles configured to the call's shapes, C[m x n]
  // += A[m x 2 k2] B: c row-major fp32 (n a row), a row-major 16-bit elements (2 k2 a row),
  // b in the VNNI layout [k2][n][2] (B(k, j) at b[(k / 2) * 2 n + 2 j + k % 2]); m, k2, n in
  // [1, 16]. nullptr on the other paths.
  void (*tile_dot)(float* c, const uint16_t* a, const uint16_t* b, int m, int k2, int n, bool fp16) = nullptr;
  // The amx paths' two ways to run one bf16 product on tiles (kernel_impl.hpp), for their
  // tests: C[m x n] (+ when !zero)= A B in one go (gemm_tiles16, job false) or step by step
  // (TileJob, job true), with gemm_tiles16's operand layout (A rows lda elements apart, columns
  // [k, k rounded up to 32) zero; B pairs b_ld words apart, 16-column panels b_panel words
  // apart). For the job: m <= 32, n a multiple of 16, k a multiple of 16, and C readable and
  // writable up to 16 rows (m <= 16) or 32. nullptr on the other paths.
  void (*tile_gemm)(bool job, bool zero, int m, int n, int k, const uint16_t* a, int64_t lda, const uint32_t* b,
                    int64_t b_ld, int64_t b_panel, float* c, int64_t ldc) = nullptr;
  // attention_grad_share_rows on this path's vectors (any path reads any path's layout: the
  // same operations, so the same bits).
  void (*grad_share_rows)(const GradShareLayout& layout, const std::byte* buffer, int64_t r0, int64_t n, float* dk,
                          float* dv) = nullptr;
  // The fp32 product alone (kernel_impl.hpp's gemm, the micro-kernel of the fp32 paths), for
  // its test and bench/fp32_tiles: C[M x N] (+ when !zero)= A B, A(r, k) at A[r * ars + k *
  // acs], B(k, n) at B[(n / PAD) * bps + k * ldb + n % PAD], C row-major (ldc); N a multiple
  // of PAD (16), which every path's vector divides. Every path.
  void (*gemm_f32)(bool zero, int M, int N, int K, const float* A, int64_t ars, int64_t acs, const float* B,
                   int64_t ldb, int64_t bps, float* C, int64_t ldc) = nullptr;
};
namespace portable {
extern const KernelTable table;
}  // namespace portable
namespace avx2 {
extern const KernelTable table;
}  // namespace avx2
namespace avx512 {
extern const KernelTable table;
}  // namespace avx512
namespace avx512_bf16 {
extern const KernelTable table;
}  // namespace avx512_bf16
namespace bf16_emulated {
extern const KernelTable table;
}  // namespace bf16_emulated
namespace amx {
extern const KernelTable table;
}  // namespace amx
namespace amx_emulated {
extern const KernelTable table;
}  // namespace amx_emulated

// Whether the amx path runs fp16 storage on tiles: AMX-FP16 (CPUID leaf 7 sub-leaf 1, EAX
// bit 21) on top of what the amx path needs (attention.cpp).
bool cpu_has_amx_fp16();

// The table of a path (nullptr for automatic): attention.cpp's path table.
const KernelTable* path_table(KernelPath path);


// The kernels' scratch (scratch.cpp): 64-byte aligned blocks. Blocks of 256 KiB and more are
// kept when freed and handed to the next request of their size class, up to the most scratch
// ever in use at once; release_kernel_scratch (cpattn/attention.hpp) gives them back.
void* scratch_allocate(size_t bytes);
void scratch_free(void* p, size_t bytes) noexcept;

// Throws cpattn::Error (an internal error) unless used <= bound: backward_impl's check that
// it allocates no more scratch than attention_backward_scratch_bytes reports (blocking.hpp).
void check_scratch_bound(size_t used_floats, size_t bound_floats);

}  // namespace cpattn::kernels

namespace cpattn::kernels {
// Runs loop(id) on threads 0..t-1 (0 the caller's), joins them, then rethrows the error of the
// lowest-numbered thread that threw; t <= 1: loop(0) on the caller's thread alone.
template <class Loop>
void run_threads(int t, Loop&& loop) {
  if (t <= 1) {
    loop(0);
    return;
  }
  std::vector<std::exception_ptr> errors(t);
  auto body = [&](int id) {
    try {
      loop(id);
    } catch (...) {
      errors[id] = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  for (int id = 1; id < t; ++id) pool.emplace_back(body, id);
  body(0);
  for (auto& th : pool) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// AttnInputs::progress on the calling thread (th == 0: run_threads' thread 0 is the caller),
// at most once per kProgressInterval: one clock read per call point, and none without a
// callback.
class Progress {
 public:
  explicit Progress(const std::function<void()>* fn) : fn_(fn), last_(std::chrono::steady_clock::now()) {}
  void operator()(int th) {
    if (fn_ == nullptr || th != 0) return;
    const auto now = std::chrono::steady_clock::now();
    if (std::chrono::duration<double>(now - last_).count() < kProgressInterval) return;
    (*fn_)();
    last_ = std::chrono::steady_clock::now();
  }

 private:
  const std::function<void()>* fn_;
  std::chrono::steady_clock::time_point last_;
};

// Item i on thread i % t; a throw stops the others at their next item (and is rethrown).
template <class Fn>
void parallel_for(int64_t n, int threads, Fn&& fn) {
  const int t = threads_started(n, threads);
  std::atomic<bool> stop{false};
  run_threads(t, [&](int id) {
    try {
      for (int64_t i = id; i < n && !stop.load(std::memory_order_relaxed); i += t) fn(i, id);
    } catch (...) {
      stop.store(true, std::memory_order_relaxed);
      throw;
    }
  });
}

template <class Fn>
void parallel_for_dynamic(int64_t n, int threads, Fn&& fn) {
  const int t = threads_started(n, threads);
  std::atomic<int64_t> next{0};
  run_threads(t, [&](int id) {
    try {
      for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
           i = next.fetch_add(1, std::memory_order_relaxed))
        fn(i, id);
    } catch (...) {
      next.store(n, std::memory_order_relaxed);  // the others stop at their next item
      throw;
    }
  });
}
}  // namespace cpattn::kernels
