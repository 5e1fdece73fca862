// The fast attention kernels, written once and compiled once per ISA by kernel_<isa>.cpp
// through kernel_isa.inc, which defines CPATTN_KNS (the path's namespace) and CPATTN_VW
// (floats per vector), switches the target with `#pragma GCC target` *after* including every
// header (standard ones, common.hpp, blocking.hpp, cpattn/dtype.hpp), so that no out-of-line
// function of them is compiled for a wider ISA than the baseline, restores it with
// `#pragma GCC pop_options` after this file, and defines the path's KernelTable. Everything
// here has internal linkage for the same reason (no ODR merging across ISAs). The blocking
// constants (PAD, BQ, BQB, BQB_TILES, BK, BBK, FBK, FBK_TILES, FSB, GH, MR, BWD_SETS) are
// blocking.hpp's.
//
// Algorithm (FlashAttention-2 on a CPU core):
//  * K and V are packed once per call into fp32, converting the storage dtype on the way and
//    zero padding head dims to PAD columns: K^T, K and V^T in blocks of BK physical rows per
//    kv head, V per kv head over all its rows, all in PAD-column panels (see Packed). A task's
//    key run is cut at block boundaries into "pieces"; a piece is columns [c0, c1) of a block,
//    and only the PAD-aligned columns [a0, a1) around it are computed.
//  * Every product is one register-blocked micro-kernel, C[M x N] (+)= A[M x K] B[K x N], with
//    A read by broadcasts through (row, column) strides (so A can be transposed for free) and
//    B, C row-major and vectorized along N: MR x F32_NV vectors of accumulators (6 x 4 on
//    AVX-512, 6 x 2 on AVX2; bf16 dot products 6 x BF16_NV).
//  * Forward: a unit is (task, block of BQ query rows, kv head, up to GH of its query heads)
//    and runs those heads piece by piece (each K^T/V piece is read from L3 once per unit);
//    online softmax in the log2 domain over pieces of up to FBK = 2 BK keys; columns no row
//    of the unit can see are not computed, pieces wholly left of the sliding window are
//    skipped, and the first piece past the right limit (causal or window) ends the loop.
//    Soft cap and ALiBi (AttnOptions) transform the scores of a row element by element in a
//    branch taken once per call; without them the rows run the vector code as before. The
//    packed K^T/V are contiguous per kv head and left to the hardware prefetchers (a software
//    prefetch of the next piece cost bf16's forward 8-9% on a mix of documents, where a unit's
//    next block is mostly another document's, and gained nothing on a long one or in fp32:
//    Intel Xeon with AMX, docs/benchmarks.md; Zen not re-measured).
//    Within a unit, each head's rows go through S = Q K^T, the softmax and O += P V in
//    sub-blocks of FSB rows (32 on tiles; each trimmed to its own last row's right limit,
//    skipped when none of its rows sees the piece). The softmax uses vexp2_softmax and leaves
//    O alone where the row max did not move. How the sub-blocks' products run depends on the
//    path: with fp32 products on AVX-512 the heads' sub-blocks of the same rows run each
//    product as one (gemm_groups: they share the piece's K^T and V, so a B column tile stays in
//    L1 while the heads' A and C rows stream); on tiles one sub-block's softmax runs beside
//    the next one's S and the last one's P V (TileJob); elsewhere sub-block by sub-block, its
//    operands in L1.
//  * Backward: a unit is (kv head, set of its query heads: bwd_set_heads), all tasks in order,
//    the set's heads side by side. For each BBK = 128-key piece it runs each head's task queries
//    in steps of BQB rows: recomputes P from lse, accumulates dV, dK of the piece for all the
//    set's heads in one local tile and dQ of each head's task rows in a local fp32 buffer. The
//    tile goes into the set's fp32 dK/dV buffer once per piece; the kv head's sets are summed
//    in set order at the end. The sets
//    depend on the shape alone, so each gradient element is a fixed-order sum, whatever
//    num_threads is and however many tasks share key rows: the results are bitwise
//    reproducible and independent of the thread count. The price is scratch of
//    Hkv * sets * total_k * (Dqk + Dv) floats and parallelism limited to Hkv * sets units.
#ifndef CPATTN_KNS
#error "define CPATTN_KNS and CPATTN_VW before including kernel_impl.hpp"
#endif

namespace cpattn::kernels::CPATTN_KNS {
namespace {

constexpr int W = CPATTN_VW;  // floats per vector
static_assert(PAD % W == 0);

// Scratch and packed operands start on a cache line (rows are padded to PAD floats, 64
// bytes), so no vector load of the micro-kernel splits a line: malloc's 16-byte alignment
// (page + 16 for large blocks) splits every other 32-byte load. They come from the scratch
// cache (common.hpp), so that a call reuses the pages of the call before.
template <class T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(scratch_allocate(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { scratch_free(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const LineAligned<U>&) const { return true; }
};
using fvec = std::vector<float, LineAligned<float>>;
// LineAligned whose resize leaves new elements as they are (default-initialized) instead of
// zeroing them: for vectors whose every element is written before it is read (Packed's).
template <class T>
struct LineAlignedRaw : LineAligned<T> {
  template <class U>
  struct rebind {
    using other = LineAlignedRaw<U>;
  };
  LineAlignedRaw() = default;
  template <class U>
  LineAlignedRaw(const LineAlignedRaw<U>&) {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
using raw_fvec = std::vector<float, LineAlignedRaw<float>>;

// Floats from the scratch cache left as they are (a vector would zero them): for buffers of
// which every element that is read is written first.
class RawFloats {
 public:
  explicit RawFloats(size_t n) : p_(static_cast<float*>(scratch_allocate(n * sizeof(float)))), n_(n) {}
  ~RawFloats() { scratch_free(p_, n_ * sizeof(float)); }
  RawFloats(const RawFloats&) = delete;
  RawFloats& operator=(const RawFloats&) = delete;
  float* data() { return p_; }
  const float* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  float* p_;
  size_t n_;
};

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf vset(float x) { return x - vf{}; }  // a broadcast (vf{} + x would add 0.0f first)
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
// The lanes of v reduced by halves: the low and high halves combined lane-wise, then the
// halves of that, down to two lanes (log2 W steps, against W - 1 dependent scalar steps, which
// were a tenth of the bf16 forward's vector work: per softmax row, a sum and a max). The sum's
// order is fixed by W: (lane i + lane i + W/2) first.
template <int N>
struct FloatVec {
  typedef float type __attribute__((vector_size(N * 4)));
};
template <int N, class Op>
inline float reduce_halves(typename FloatVec<N>::type v, Op op) {
  if constexpr (N == 2) {
    return op(v[0], v[1]);
  } else {
    // The halves by shuffles of v's value, not copies out of its bytes: a copy takes v's
    // address, and once inlined into the amx forward's exp pass that kept the pass's running
    // sum in memory (a store and a reload every 32 columns).
    return [v, &op]<int... I>(std::integer_sequence<int, I...>) {
      const typename FloatVec<N / 2>::type lo = __builtin_shufflevector(v, v, I...);
      const typename FloatVec<N / 2>::type hi = __builtin_shufflevector(v, v, (I + N / 2)...);
      return reduce_halves<N / 2>(op(lo, hi), op);
    }(std::make_integer_sequence<int, N / 2>{});
  }
}
inline float hsum(vf v) {
  return reduce_halves<W>(v, [](auto a, auto b) { return a + b; });
}
inline float hmax(vf v) {  // (the max of the lanes whatever the order when none is NaN)
  return reduce_halves<W>(v, [](auto a, auto b) { return a > b ? a : b; });
}

// The lane-wise max of s[c] * mul over the columns [a0, a1) (a multiple of W apart), in four
// independent chains, since the row's exp pass waits on it (without NaN scores any order
// gives the same maximum, so the results are bitwise those of one chain; with NaN scores the
// chains may keep another lane: NaN inputs have no defined output; CpAttention refuses them
// when CpAttnConfig::check_finite is set, which `cpattn run` does unless --no-check-finite).
// mul = 1 leaves s as it is.
inline vf row_max(const float* s, int a0, int a1, vf mul) {
  vf m0 = vset(kNegInf), m1 = m0, m2 = m0, m3 = m0;
  int c = a0;
  for (; c + 4 * W <= a1; c += 4 * W) {
    m0 = vmax(m0, vload(s + c) * mul);
    m1 = vmax(m1, vload(s + c + W) * mul);
    m2 = vmax(m2, vload(s + c + 2 * W) * mul);
    m3 = vmax(m3, vload(s + c + 3 * W) * mul);
  }
  for (; c < a1; c += W) m0 = vmax(m0, vload(s + c) * mul);
  return vmax(vmax(m0, m1), vmax(m2, m3));
}

// 2^xc for xc in [-127, 127]: xc = n + f rounded to nearest (|f| <= 1/2), p(f) by Horner's
// rule from c[0], the highest coefficient, and 2^n added to p's exponent bits.
template <size_t N>
inline vf exp2_split(vf xc, const float (&c)[N]) {
  const vf magic = vset(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf t = xc + magic;
  const vf n = t - magic;
  const vf f = xc - n;
  vf p = vset(c[0]);
#pragma GCC unroll 8
  for (size_t i = 1; i < N; ++i) p = p * f + vset(c[i]);
  const vi ni = (vi)t - (vi)magic;
  return (vf)((vi)p + (ni << 23));
}

// The backward's P = 2^x, x a recomputed score minus its row's lse (log2 domain): at most 1
// (x > 0 gives exactly 1: x <= 0 exactly, but the backward's products round in another order
// than the forward's, and at huge logits, ~1e9 from fp16 inputs near its range, S - lse came
// out hundreds above 0 and P, dV with it, inf), exactly 0 for x < -126 (so masked entries,
// -inf, give 0). Degree-7 Taylor of 2^f (error < 1e-8; p(0) = 1 exactly).
inline vf vexp2(vf x) {
  static constexpr float taylor7[] = {1.525273380405984e-05f, 1.5403530393381606e-04f,
                                      1.3333558146428443e-03f, 9.618129107628477e-03f,
                                      5.550410866482158e-02f, 2.402265069591007e-01f,
                                      6.931471805599453e-01f, 1.0f};
  const vf lo = vset(-126.0f);
  const vi keep = x >= lo;
  vf xc = x < lo ? lo : x;
  xc = xc > vf{} ? vf{} : xc;
  return (vf)((vi)exp2_split(xc, taylor7) & keep);
}

// 2^x for the forward's softmax, whose arguments are a score minus its row's running max
// (x <= 0 up to the rounding of the fused s * scale - max, or -inf for a masked entry): no
// upper clamp, and the lower one is a max, since x = -127 gives exactly 0 through the
// exponent arithmetic (n = -127, p(0) = 1: bits 0); -inf and every x <= -127 give 0, x in
// (-127, -126) a number below 2^-126 (vexp2 gives 0 there; both are far under any row sum,
// which is >= 1). p is the degree-6 minimax polynomial of 2^f on [-1/2, 1/2] for relative
// error (1.9e-9, Remez exchange; 7.9e-8 worst case evaluated in fp32, against 6.5e-8 for
// vexp2's degree 7), p(0) = 1 exactly, so the row's maximum gives exactly 1. Six FMAs and a
// max against vexp2's seven FMAs, two clamps, a compare and a mask.
inline vf vexp2_softmax(vf x) {
  static constexpr float minimax6[] = {1.534581243e-04f, 1.339993090e-03f, 9.618489072e-03f,
                                       5.550328642e-02f, 2.402264625e-01f, 6.931471825e-01f,
                                       1.0f};
  return exp2_split(vmax(x, vset(-127.0f)), minimax6);
}

// ---- the micro-kernel -----------------------------------------------------------------
// The accumulators of a micro-kernel tile: C's R x NV vectors (zero when Zero), and back.
template <int R, int NV, bool Zero>
inline void load_acc(vf (&acc)[R][NV], const float* C, int64_t ldc) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = Zero ? vf{} : vload(C + r * ldc + c * W);
}
template <int R, int NV>
inline void store_acc(const vf (&acc)[R][NV], float* C, int64_t ldc) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) vstore(C + r * ldc + c * W, acc[r][c]);
}

// C[R x NV*W] (+)= sum_k A(r, k) B[k, :], A(r, k) = A[r * ars + k * acs]; B's column vector c
// at Bv[c] + k * ldb.
template <int R, int NV, bool Zero>
inline void tile(int K, const float* A, int64_t ars, int64_t acs, const float* const* Bv, int64_t ldb, float* C,
                 int64_t ldc) {
  // Adding no products leaves C as it is. Returning first also spares the accumulators a trip
  // through the stack: with a path that skips the loop joining the loop's exit, GCC kept the
  // C-loading tile's 24 accumulators in memory around the loop (32 zmm stores a call).
  if (!Zero && K <= 0) return;
  vf acc[R][NV];
  load_acc<R, NV, Zero>(acc, C, ldc);
  for (int k = 0; k < K; ++k) {
    vf b[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) b[c] = vload(Bv[c] + k * ldb);
    const float* a = A + k * acs;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf av = vset(a[r * ars]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] = av * b[c] + acc[r][c];
    }
  }
  store_acc<R, NV>(acc, C, ldc);
}

template <int R, int NV, bool Zero>
inline void col_panel(int M, int K, const float* A, int64_t ars, int64_t acs, const float* const* Bv, int64_t ldb,
                      float* C, int64_t ldc) {
  int m = 0;
  for (; m + R <= M; m += R) tile<R, NV, Zero>(K, A + m * ars, ars, acs, Bv, ldb, C + m * ldc, ldc);
  const float* a = A + m * ars;
  float* c = C + m * ldc;
  switch (M - m) {
    case 1: tile<1, NV, Zero>(K, a, ars, acs, Bv, ldb, c, ldc); break;
    case 2: tile<2, NV, Zero>(K, a, ars, acs, Bv, ldb, c, ldc); break;
    case 3: tile<3, NV, Zero>(K, a, ars, acs, Bv, ldb, c, ldc); break;
    case 4: tile<4, NV, Zero>(K, a, ars, acs, Bv, ldb, c, ldc); break;
    case 5: tile<5, NV, Zero>(K, a, ars, acs, Bv, ldb, c, ldc); break;
    default: break;
  }
}

// Visits N's columns (a multiple of W) in micro-kernel tiles of NV column vectors, the widest
// first: Widest where nv_max allows it, then 2, then 1 (panel(std::integral_constant<int, NV>{},
// n) for the tile at column n). The one column loop of gemm, gemm_groups and gemm_bf16.
template <int Widest, class Panel>
inline void column_tiles(int N, int nv_max, Panel&& panel) {
  int n = 0;
  auto run = [&](auto nv) {
    for (; n + decltype(nv)::value * W <= N; n += decltype(nv)::value * W) panel(nv, n);
  };
  if constexpr (Widest > 2)
    if (nv_max >= Widest) run(std::integral_constant<int, Widest>{});
  run(std::integral_constant<int, 2>{});
  run(std::integral_constant<int, 1>{});
}

// Column vectors per fp32 micro-kernel tile: MR x 4 on AVX-512's 32 registers (24
// accumulators, 4 B vectors, the broadcast: a tile's loads per FMA fall from 8/12 to 10/24),
// MR x 2 on AVX2's 16. An L1-resident MR x 4 tile ran 117 against 95 GFLOP/s (medians of 40;
// FMA peak 183) on the Ice Lake Xeon, whose two loads per cycle the MR x 2 tile's broadcasts
// and B loads kept busy beside its FMAs. The order of each element's sum is the same.
constexpr int F32_NV = W == 16 ? 4 : 2;

// C[M x N] (+)= A[M x K] B[K x N]; N a multiple of W. Zero: C = A B instead of C += A B.
// B is stored in panels of PAD columns: B(k, n) = B[(n / PAD) * bps + k * ldb + n % PAD]; a
// row-major B is bps = PAD. Packed operands use ldb = PAD, so that a panel is one contiguous
// block (a strided panel maps to few L1 sets and thrashes). Column panels outside, rows
// inside: the panel stays in L1 while A streams.
// The column loop of gemm and gemm_groups: G products with the same B, product j's A at A +
// j * a_gs and C at C + j * c_gs, each column tile of B multiplied by all G products' rows
// before the next. Each C element is the same sum in the same order for any G.
template <bool Zero>
__attribute__((always_inline)) inline void gemm_panels(int G, int64_t a_gs, int64_t c_gs, int M, int N, int K,
                                                       const float* A, int64_t ars, int64_t acs, const float* B,
                                                       int64_t ldb, int64_t bps, float* C, int64_t ldc) {
  auto col = [&](int n) { return B + (n / PAD) * bps + n % PAD; };
  column_tiles<F32_NV>(N, F32_NV, [&](auto nv, int n) {
    constexpr int NV = decltype(nv)::value;
    const float* bv[NV];
    for (int c = 0; c < NV; ++c) bv[c] = col(n + c * W);
    for (int j = 0; j < G; ++j) col_panel<MR, NV, Zero>(M, K, A + j * a_gs, ars, acs, bv, ldb, C + j * c_gs + n, ldc);
  });
}
// Never inlined: inlined into a caller with constant strides, GCC has been seen to spill the
// accumulators of the micro-kernel to the stack (30% slower forward).
template <bool Zero>
__attribute__((noinline)) void gemm(int M, int N, int K, const float* A, int64_t ars, int64_t acs, const float* B,
                                    int64_t ldb, int64_t bps, float* C, int64_t ldc) {
  gemm_panels<Zero>(1, 0, 0, M, N, K, A, ars, acs, B, ldb, bps, C, ldc);
}
// G products of gemm's contract sharing B (gemm_panels): the fp32 forward's heads of one KV
// head, which share the piece's K^T and V, so that a column tile read from L2 serves every
// head's rows. gemm alone (bench/fp32_tiles, Intel Xeon with AMX) ran 79-83% of the FMA peak
// with B in L1, 73-81% with B from L2 at 24 or 96 rows a call, 50-52% from beyond L2.
template <bool Zero>
__attribute__((noinline)) void gemm_groups(int G, int64_t a_gs, int64_t c_gs, int M, int N, int K, const float* A,
                                           int64_t ars, int64_t acs, const float* B, int64_t ldb, int64_t bps,
                                           float* C, int64_t ldc) {
  gemm_panels<Zero>(G, a_gs, c_gs, M, N, K, A, ars, acs, B, ldb, bps, C, ldc);
}
// gemm alone, for its test and bench/fp32_tiles: the KernelTable's gemm_f32.
void gemm_f32_one(bool zero, int M, int N, int K, const float* A, int64_t ars, int64_t acs, const float* B,
                  int64_t ldb, int64_t bps, float* C, int64_t ldc) {
  if (zero) gemm<true>(M, N, K, A, ars, acs, B, ldb, bps, C, ldc);
  else gemm<false>(M, N, K, A, ars, acs, B, ldb, bps, C, ldc);
}

// Column vectors per bf16 micro-kernel tile: MR x 4 on 32 zmm registers (24 accumulators,
// 4 B vectors, the broadcast), which issues a vdpbf16ps per cycle more often than MR x 2 (a
// tile's loads per dot product fall from 8/12 to 10/24: L1-resident tiles ran 189 against 181
// GFLOP/s on Zen 4); the emulation's 16 ymm registers keep MR x 2.
#if defined(CPATTN_BF16_DOT) && CPATTN_BF16_DOT == 1
constexpr int BF16_NV = 4;
#else
constexpr int BF16_NV = 2;
#endif

// ---- bf16 dot products (the bf16 paths) ----------------------------------------------------
// A kernel_<isa>.cpp that defines CPATTN_BF16_DOT runs the products of bf16-storage calls as
// bf16 dot products with fp32 accumulation, vdpbf16ps's semantics: both operands rounded to
// bf16 (bf16_dot_bits: round to nearest even, VCVTNE2PS2BF16's rounding) and stored as pairs along the
// reduction dimension k, one 32-bit word per pair, the even k in the low half; each lane of a
// step computes acc += a[2i+1] b[2i+1], then acc += a[2i] b[2i], each accumulation rounded once
// to fp32 (the bf16 products are exact in fp32), denormal inputs read as zero and denormal
// results flushed to zero. Q, K, V and dO hold bf16 values already (exact); P and dS are
// rounded to bf16 here, as GPU flash kernels do before their P.V, dS.K and dS^T.Q products
// (the softmax's row sums stay fp32). The step itself is the policy Bf16Dot:
//   CPATTN_BF16_DOT == 1: the instruction (_mm512_dpbf16_ps; W == 16, avx512bf16 target),
//   CPATTN_BF16_DOT == 2: its emulation in plain vector arithmetic (any W), which the kernel
//                         case table runs on every x86-64 CPU with AVX2 (the bf16_emulated path).
// Everything else (packing, blocking, softmax) is shared, so the emulated path tests the
// algorithm the avx512_bf16 path runs.
// The rounding to pairs (bf16_dot_bits, Bf16Dot::words / rows) serves the AMX paths too: their
// B operands are the same pairs (the VNNI layout), so CPATTN_BF16_ROUND is 1 where the target
// has VCVTNE2PS2BF16 (avx512_bf16, amx) and 2 where it is emulated (bf16_emulated, amx_emulated).
#if defined(CPATTN_BF16_DOT)
#define CPATTN_BF16_ROUND CPATTN_BF16_DOT
#elif defined(CPATTN_AMX)
#define CPATTN_BF16_ROUND CPATTN_AMX
#endif
#ifdef CPATTN_BF16_ROUND
inline vu vload_u(const uint32_t* p) {
  vu v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore_u(uint32_t* p, vu v) { std::memcpy(p, &v, sizeof v); }
// The rounding of an operand to bf16 for the dot products: VCVTNE2PS2BF16's semantics (round
// to nearest even, NaN kept NaN and made quiet, denormal inputs to a zero of their sign), which
// the native path runs as the instruction and every other path in integer arithmetic
// (bf16_dot_bits). It differs from the storage conversion (cpattn/dtype.hpp's f32_to_bf16)
// only on fp32 denormals, which the dot products would read as zero anyway unless they round up
// to bf16's smallest normal: one definition for both paths keeps them bitwise alike there too.
inline uint16_t bf16_dot_bits(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return f32_to_bf16((u & 0x7f800000u) == 0 ? std::bit_cast<float>(u & 0x80000000u) : x);
}
inline uint32_t bf16_pair(float even, float odd) {
  return uint32_t{bf16_dot_bits(even)} | uint32_t{bf16_dot_bits(odd)} << 16;
}
// bf16_dot_bits on W lanes, the bits in each lane's low half.
inline vu bf16_bits(vu u) {
  const vu denormal = (u & 0x7f800000u) == 0u;
  u &= ~denormal | 0x80000000u;
  const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
  return (((u >> 16) | 0x40u) & nan) | (((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & ~nan);
}

struct Bf16Dot {
#if CPATTN_BF16_ROUND == 1
  static_assert(W == 16, "vdpbf16ps on zmm registers: 16 lanes");
  static vf dot(vf acc, vu a, vu b) {
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
  }
  // The pair words of 2W consecutive floats lo, hi: word j = bits(x[2j]) | bits(x[2j + 1]) <<
  // 16 (x = lo then hi), the order of a bf16 array in memory. One vcvtne2ps2bf16.
  static vu words(vf lo, vf hi) { return (vu)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo); }
  // The pair words of two rows a, b of W floats: word c = bits(a[c]) | bits(b[c]) << 16. The
  // conversion gives a's 16 results, then b's; vpermw interleaves them.
  static vu rows(vf a, vf b) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return (vu)_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a));
  }
#elif CPATTN_BF16_ROUND == 2
  // Denormals (exponent bits 0) to a zero of the same sign.
  static vu flush(vu x) {
    const vu denormal = (x & 0x7f800000u) == 0u;
    return (x & ~denormal) | (x & denormal & 0x80000000u);
  }
  static vf dot(vf acc, vu a, vu b) {
    const vf a_lo = (vf)flush(a << 16), b_lo = (vf)flush(b << 16);  // bf16[2i]
    const vf a_hi = (vf)flush(a & 0xffff0000u), b_hi = (vf)flush(b & 0xffff0000u);  // bf16[2i+1]
    acc = (vf)flush((vu)acc);
    acc = (vf)flush((vu)(acc + a_hi * b_hi));  // exact product: one rounding, fused or not
    return (vf)flush((vu)(acc + a_lo * b_lo));
  }
  template <size_t... I>
  static vu words(vf lo, vf hi, std::index_sequence<I...>) {
    const vu a = bf16_bits((vu)lo), b = bf16_bits((vu)hi);
    return __builtin_shufflevector(a, b, (2 * I)...) | __builtin_shufflevector(a, b, (2 * I + 1)...) << 16;
  }
  static vu words(vf lo, vf hi) { return words(lo, hi, std::make_index_sequence<W>{}); }
  static vu rows(vf a, vf b) { return bf16_bits((vu)a) | bf16_bits((vu)b) << 16; }
#else
#error "CPATTN_BF16_DOT / CPATTN_AMX must be 1 (native) or 2 (emulated)"
#endif
};
#endif  // CPATTN_BF16_ROUND

#ifdef CPATTN_BF16_DOT

// C[R x NV*W] (+)= sum over pairs kp of A2(r, kp) . B2(kp, :): A2(r, kp) at A[r * ra + kp *
// ka], B2 column vector c at Bv[c] + kp * PAD words.
template <int R, int NV, bool Zero>
inline void tile_bf16(int K2, const uint32_t* A, int64_t ra, int64_t ka, const uint32_t* const* Bv, float* C,
                      int64_t ldc) {
  if (!Zero && K2 <= 0) return;  // C as it is, and no stack trip for acc (tile's comment)
  vf acc[R][NV];
  load_acc<R, NV, Zero>(acc, C, ldc);
  for (int kp = 0; kp < K2; ++kp) {
    vu b[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) b[c] = vload_u(Bv[c] + kp * PAD);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vu av = vu{} + A[r * ra + kp * ka];
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] = Bf16Dot::dot(acc[r][c], av, b[c]);
    }
  }
  store_acc<R, NV>(acc, C, ldc);
}

template <int R, int NV, bool Zero>
inline void col_panel_bf16(int M, int K2, const uint32_t* A, int64_t ra, int64_t ka, const uint32_t* const* Bv,
                           float* C, int64_t ldc) {
  int m = 0;
  for (; m + R <= M; m += R) tile_bf16<R, NV, Zero>(K2, A + m * ra, ra, ka, Bv, C + m * ldc, ldc);
  const uint32_t* a = A + m * ra;
  float* c = C + m * ldc;
  switch (M - m) {
    case 1: tile_bf16<1, NV, Zero>(K2, a, ra, ka, Bv, c, ldc); break;
    case 2: tile_bf16<2, NV, Zero>(K2, a, ra, ka, Bv, c, ldc); break;
    case 3: tile_bf16<3, NV, Zero>(K2, a, ra, ka, Bv, c, ldc); break;
    case 4: tile_bf16<4, NV, Zero>(K2, a, ra, ka, Bv, c, ldc); break;
    case 5: tile_bf16<5, NV, Zero>(K2, a, ra, ka, Bv, c, ldc); break;
    default: break;
  }
}

// gemm's contract (same operands, same strides; N a multiple of PAD) with bf16 products: A
// and B are rounded to bf16 pairs along K (an odd K padded with a zero) into per-thread
// buffers, in vectors, then multiplied by the Bf16Dot micro-kernel.
//
// `paired`, when not null, is B already in pairs (pair_panel_rows: ldb == PAD, K even, panel
// stride bps / 2 words): the K^T, V, V^T and K panels of a call, paired once in pack_kv
// instead of at every product. The forward's S = Q K^T runs per head on sub-blocks of FSB
// rows, so pairing its B per product repeated the same conversions for every head and
// sub-block (the bf16 forward ran 0.84x the fp32-product path on Zen 4 before).
template <bool Zero>
__attribute__((noinline)) void gemm_bf16(int M, int N, int K, const float* A, int64_t ars, int64_t acs,
                                         const float* B, int64_t ldb, int64_t bps, float* C, int64_t ldc,
                                         const uint32_t* paired, int nv_max) {
  thread_local std::vector<uint32_t, LineAligned<uint32_t>> a2, b2;
  const int K2 = (K + 1) / 2;
  const bool by_pairs = ars == 1 && acs != 1;
  const int64_t ra = by_pairs ? 1 : K2, ka = by_pairs ? M : 1;
  a2.resize(static_cast<size_t>(M) * K2);
  // A2 in vectors: rows of contiguous elements (acs == 1) row by row, [M][K2]; columns of
  // contiguous elements (ars == 1: the backward's P^T and dS^T) pair by pair, [K2][M].
  if (by_pairs) {
    for (int kp = 0; kp < K2; ++kp) {
      const float* a = A + 2 * kp * acs;
      const bool odd = 2 * kp + 1 < K;
      uint32_t* o = a2.data() + static_cast<size_t>(kp) * M;
      int r = 0;
      for (; r + W <= M; r += W) vstore_u(o + r, Bf16Dot::rows(vload(a + r), odd ? vload(a + acs + r) : vf{}));
      for (; r < M; ++r) o[r] = bf16_pair(a[r], odd ? a[acs + r] : 0.0f);
    }
  } else {
    for (int r = 0; r < M; ++r) {
      const float* a = A + r * ars;
      uint32_t* o = a2.data() + static_cast<size_t>(r) * K2;
      int kp = 0;
      if (acs == 1)
        for (; 2 * (kp + W) <= K; kp += W) vstore_u(o + kp, Bf16Dot::words(vload(a + 2 * kp), vload(a + 2 * kp + W)));
      for (; kp < K2; ++kp) o[kp] = bf16_pair(a[2 * kp * acs], 2 * kp + 1 < K ? a[(2 * kp + 1) * acs] : 0.0f);
    }
  }
  const uint32_t* b2p = paired;
  int64_t panel = bps / 2;  // words between B2 panels
  if (!paired) {
    b2.resize(static_cast<size_t>(N) * K2);
    for (int j = 0; j < N / PAD; ++j)  // B2 panel j: [K2][PAD] words
      for (int kp = 0; kp < K2; ++kp) {
        const float* b = B + j * bps + 2 * kp * ldb;
        const bool odd = 2 * kp + 1 < K;
        uint32_t* o = b2.data() + (static_cast<size_t>(j) * K2 + kp) * PAD;
        for (int c = 0; c < PAD; c += W) vstore_u(o + c, Bf16Dot::rows(vload(b + c), odd ? vload(b + ldb + c) : vf{}));
      }
    b2p = b2.data();
    panel = int64_t{K2} * PAD;
  }
  auto col = [&](int n) { return b2p + (n / PAD) * panel + n % PAD; };
  column_tiles<BF16_NV>(N, nv_max, [&](auto nv, int n) {
    constexpr int NV = decltype(nv)::value;
    const uint32_t* bv[NV];
    for (int c = 0; c < NV; ++c) bv[c] = col(n + c * W);
    col_panel_bf16<MR, NV, Zero>(M, K2, a2.data(), ra, ka, bv, C + n, ldc);
  });
}

// One Bf16Dot step on `lanes` lanes (a multiple of W): acc[i] += the pair products of a[i],
// b[i]. The KernelTable's bf16_dot, for the tests of the step itself.
void bf16_dot_lanes(float* acc, const uint32_t* a, const uint32_t* b, int lanes) {
  for (int i = 0; i < lanes; i += W) vstore(acc + i, Bf16Dot::dot(vload(acc + i), vload_u(a + i), vload_u(b + i)));
}
// The two roundings to pairs on `n` floats (a multiple of 32), the KernelTable's bf16_pack:
// words[j] = the pair of x[2j], x[2j + 1]; rows[16 k + c] = the pair of x[32 k + c] and x[32 k
// + 16 + c] (rows of 16 floats, two by two, whatever W is).
void bf16_pack_lanes(const float* x, int n, uint32_t* words, uint32_t* rows) {
  for (int i = 0; i < n; i += 32)
    for (int c = 0; c < 16; c += W) {
      vstore_u(words + i / 2 + c, Bf16Dot::words(vload(x + i + 2 * c), vload(x + i + 2 * c + W)));
      vstore_u(rows + i / 2 + c, Bf16Dot::rows(vload(x + i + c), vload(x + i + 16 + c)));
    }
}
#endif

using uvec = std::vector<uint32_t, LineAligned<uint32_t>>;
using raw_uvec = std::vector<uint32_t, LineAlignedRaw<uint32_t>>;  // every element written before it is read
// A buffer of rows of PAD floats (panels whose row counts are even) as bf16 pairs: rows 2i
// and 2i + 1 become row i of PAD words, bf16_pair(row 2i [c], row 2i + 1 [c]), the layout
// gemm_bf16 packs B into, so float element (panel, k, c) lies at pair word (panel, k / 2, c)
// and the pair buffer's offset of a B with an even k is half the float offset. Compiled on
// every path (pack_kv is shared); only the bf16 paths call it.
inline void pair_panel_rows(const float* src, int64_t row_pairs, uint32_t* dst) {
#ifdef CPATTN_BF16_ROUND
  for (int64_t i = 0; i < row_pairs; ++i)
    for (int c = 0; c < PAD; c += W)
      vstore_u(dst + i * PAD + c, Bf16Dot::rows(vload(src + 2 * i * PAD + c), vload(src + (2 * i + 1) * PAD + c)));
#else
  (void)src, (void)row_pairs, (void)dst;  // only the bf16 paths pair their operands
#endif
}

// ---- AMX tiles (the amx paths) ---------------------------------------------------------------
// A kernel_<isa>.cpp that defines CPATTN_AMX runs the products of bf16-storage calls (and of
// fp16-storage calls where tiles_fp16() holds) on AMX tiles: TDPBF16PS / TDPFP16PS,
// C[16 x 16 fp32] += A[16 rows x 32 16-bit elements] . B[16 rows of 16 pairs], B in the VNNI
// layout (B(k, n) at row k / 2, element 2 n + k % 2), which is the bf16 dot products' pairs
// (pair_panel_rows). Operands are rounded to the storage format (P and dS as the bf16 paths
// do, fp16 for fp16 storage), the reduction dimension is zero padded to 32 elements per tile,
// rows to 16. bf16 calls take their K/V operands from pack_kv_tiles' pairs and round the query side
// to bf16 rows once (per forward unit, per backward task) and P, dS once per step, and call
// gemm_tiles16 on them; the backward runs dK and dV transposed (dK^T += Q^T dS, dV^T += dO^T
// P) so that P and dS are B operands, paired along the query rows like any other. fp16 calls
// (and tests) go through gemm_tiles, which rounds fp32 operands per product. Intel's documented semantics
// (the SDM's pseudo-code), which the emulator below follows exactly: per row m and column n,
// one instruction keeps two fp32 partial sums from 0, the even and the odd elements of the
// pairs, each step an fp32 FMA rounded to nearest even with denormal results flushed; then
// C(m, n) += (even + odd), each sum rounded and flushed. bf16 denormal inputs read as zero;
// fp16 denormal inputs are converted exactly (they are normal fp32 numbers); a denormal C
// reads as zero. The tile interface, Tiles, has two implementations:
//   CPATTN_AMX == 1: the instructions (inline assembly; GCC 12 has no AMX-FP16 intrinsic),
//   CPATTN_AMX == 2: an exact emulator in plain C++ (the amx_emulated path, any AVX2 CPU),
// so that the kernel case table runs the tiling, padding and layout logic of the amx path on
// every x86-64 CPU with AVX2. tile_block holds a 2 x 2 block of C in tiles 0-3 (2 i + j), the
// block's two A tiles in 4, 5 and its two B tiles in 6, 7; tile_dot_one uses 0, 1, 2.
// x with a denormal (exponent bits 0) replaced by a zero of its sign.
inline float ftz(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return (u & 0x7f800000u) == 0 ? std::bit_cast<float>(u & 0x80000000u) : x;
}

// a . b over n elements (n even) in the order and rounding of the tile products: per 32
// elements, even and odd partial sums, then added to the total (tile_dot_emulated). `daz`:
// denormal inputs read as zero, as TDPBF16PS reads bf16 (TDPFP16PS takes fp16 denormals).
inline float dot_tile_order(const float* a, const float* b, int n, bool daz) {
  const auto in = [daz](float x) { return daz ? ftz(x) : x; };
  float acc = 0.0f;
  for (int k0 = 0; k0 < n; k0 += 32) {
    float e = 0.0f, o = 0.0f;
    for (int k = k0; k < std::min(n, k0 + 32); k += 2) {
      e = ftz(std::fma(in(a[k]), in(b[k]), e));
      o = ftz(std::fma(in(a[k + 1]), in(b[k + 1]), o));
    }
    acc = ftz(acc + ftz(e + o));
  }
  return acc;
}

#ifdef CPATTN_AMX
struct TileShape {
  int rows, colsb;  // rows <= 16, bytes per row <= 64
};

// TDPBF16PS (fp16 false) / TDPFP16PS (fp16 true) on tile registers of 16 rows of 64 bytes:
// C's first `rows` rows, `cols` fp32 columns, `pairs` pairs along k (the SDM's pseudo-code).
template <bool F16>
void tile_dot_emulated(float* c, const uint16_t* a, const uint16_t* b, int rows, int pairs, int cols) {
  const auto widen = [](uint16_t h) { return F16 ? f16_to_f32(h) : ftz(bf16_to_f32(h)); };
  float be[16][16], bo[16][16];  // B's even and odd elements, widened: [pair][column]
  for (int k = 0; k < pairs; ++k)
    for (int n = 0; n < cols; ++n) {
      be[k][n] = widen(b[k * 32 + 2 * n]);
      bo[k][n] = widen(b[k * 32 + 2 * n + 1]);
    }
  for (int m = 0; m < rows; ++m) {
    float te[16] = {}, to[16] = {};
    for (int k = 0; k < pairs; ++k) {
      const float ae = widen(a[m * 32 + 2 * k]), ao = widen(a[m * 32 + 2 * k + 1]);
      for (int n = 0; n < cols; ++n) {
        te[n] = ftz(std::fma(ae, be[k][n], te[n]));
        to[n] = ftz(std::fma(ao, bo[k][n], to[n]));
      }
    }
    for (int n = 0; n < cols; ++n) c[m * 16 + n] = ftz(ftz(c[m * 16 + n]) + ftz(te[n] + to[n]));
  }
}

#if CPATTN_AMX == 1
// The instructions. LDTILECFG's 64-byte operand: palette 1, bytes per row and rows per tile.
struct Tiles {
  struct alignas(64) Config {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };
  static_assert(sizeof(Config) == 64);
  template <size_t N>
  static void configure(const TileShape (&t)[N]) {  // tiles 0 .. N-1
    static_assert(N <= 8);
    Config c{};
    c.palette = 1;
    for (size_t i = 0; i < N; ++i) {
      c.colsb[i] = static_cast<uint16_t>(t[i].colsb);
      c.rows[i] = static_cast<uint8_t>(t[i].rows);
    }
    asm volatile("ldtilecfg %0" ::"m"(c));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void zero() {
    asm volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int C, int A, int B>
  static void dot(bool fp16) {
    if (fp16)
      asm volatile("tdpfp16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
    else
      asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
  static void release() { asm volatile("tilerelease" ::: "memory"); }
};
// fp16 tiles need AMX-FP16 (attention.cpp's CPUID check); without it fp16 runs the FMA code.
inline bool tiles_fp16() { return cpu_has_amx_fp16(); }
#elif CPATTN_AMX == 2
// The emulator: eight tile registers of 16 rows x 64 bytes per thread, with their shapes.
struct Tiles {
  struct State {
    TileShape shape[8];
    alignas(64) unsigned char reg[8][16 * 64];
  };
  static State& state() {
    thread_local State s{};
    return s;
  }
  template <size_t N>
  static void configure(const TileShape (&t)[N]) {  // tiles 0 .. N-1; LDTILECFG zeroes every tile
    static_assert(N <= 8);
    State& s = state();
    std::memset(&s, 0, sizeof s);
    for (size_t i = 0; i < N; ++i) s.shape[i] = t[i];
  }
  template <int T>
  static void load(const void* p, int64_t stride) {  // rows past the shape read as zero
    State& s = state();
    std::memset(s.reg[T], 0, sizeof s.reg[T]);
    for (int r = 0; r < s.shape[T].rows; ++r)
      std::memcpy(s.reg[T] + r * 64, static_cast<const unsigned char*>(p) + r * stride, s.shape[T].colsb);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    const State& s = state();
    for (int r = 0; r < s.shape[T].rows; ++r)
      std::memcpy(static_cast<unsigned char*>(p) + r * stride, s.reg[T] + r * 64, s.shape[T].colsb);
  }
  template <int T>
  static void zero() {
    std::memset(state().reg[T], 0, sizeof state().reg[T]);
  }
  template <int C, int A, int B>
  static void dot(bool fp16) {
    State& s = state();
    float c[16 * 16];
    uint16_t a[16 * 32], b[16 * 32];
    std::memcpy(c, s.reg[C], sizeof c);
    std::memcpy(a, s.reg[A], sizeof a);
    std::memcpy(b, s.reg[B], sizeof b);
    const int rows = s.shape[C].rows, pairs = s.shape[A].colsb / 4, cols = s.shape[C].colsb / 4;
    if (fp16)
      tile_dot_emulated<true>(c, a, b, rows, pairs, cols);
    else
      tile_dot_emulated<false>(c, a, b, rows, pairs, cols);
    std::memcpy(s.reg[C], c, sizeof c);
  }
  static void release() { std::memset(&state(), 0, sizeof(State)); }
};
inline bool tiles_fp16() { return true; }  // the emulator has both instructions
#else
#error "CPATTN_AMX must be 1 (instructions) or 2 (emulated)"
#endif

// C tile (I, J) of a 2 x 2 block (tile 2 I + J) at c: loaded, or zeroed when Zero, before the
// block's products, and stored after them. A tile of fewer than 16 valid rows (the last rows
// of C) goes through a 16 x 16 staging buffer, so no row of C past them is read or written.
template <bool Zero, int I, int J>
inline void c_tile_begin(float* c, int64_t ldc, int valid, float* stage) {
  constexpr int T = 2 * I + J;
  float* ct = c + I * 16 * ldc + J * 16;
  if (valid < 16) {
    for (int r = 0; r < 16; ++r)
      for (int j = 0; j < 16; ++j) stage[r * 16 + j] = !Zero && r < valid ? ct[r * ldc + j] : 0.0f;
    Tiles::load<T>(stage, 64);
  } else if (Zero) {
    Tiles::zero<T>();
  } else {
    Tiles::load<T>(ct, ldc * 4);
  }
}
template <int I, int J>
inline void c_tile_end(float* c, int64_t ldc, int valid, float* stage) {
  constexpr int T = 2 * I + J;
  float* ct = c + I * 16 * ldc + J * 16;
  if (valid < 16) {
    Tiles::store<T>(stage, 64);
    for (int r = 0; r < valid; ++r) std::memcpy(ct + r * ldc, stage + r * 16, 16 * sizeof(float));
  } else {
    Tiles::store<T>(ct, ldc * 4);
  }
}

// Every product of a call runs on one tile configuration, all eight tiles 16 rows x 64 bytes,
// loaded by the thread's first product and kept until tiles_end() (the end of a forward or
// backward unit, by a TileScope, so also when the unit throws), instead of LDTILECFG and
// TILERELEASE around each product: the forward's products are a few hundred tile instructions
// each. B's short K edge and C's short rows are staged, never configured (a new configuration
// zeroes every tile); A's edges are its caller's zero padding.
inline bool& tiles_configured() {
  thread_local bool configured = false;
  return configured;
}
inline void tiles_begin() {
  if (tiles_configured()) return;
  constexpr TileShape full{16, 64};
  Tiles::configure({full, full, full, full, full, full, full, full});
  tiles_configured() = true;
}
inline void tiles_end() {
  if (!tiles_configured()) return;
  Tiles::release();
  tiles_configured() = false;
}

// An MT x NT block of C tiles (MT, NT in {1, 2}) at c, `rows` valid rows (16 (MT - 1) < rows
// <= 16 MT), over the Kp / 32 steps of A rows a (a_stride bytes apart) and B: step k0 reads B
// tile j at bt[j] + k0 / 2 * b_ld words (b_ld * 4 bytes a row) while k0 < k_full, and the
// staged tail tails[j] (16 words a row) at k0 == k_full. Per step, MT A tiles and NT B tiles
// are loaded for MT NT products.
template <bool Zero, int MT, int NT>
void tile_block(bool fp16, int rows, const uint16_t* a, int64_t a_stride, const uint32_t* const* bt, int64_t b_ld,
                int k_full, const uint32_t* const* tails, int Kp, float* c, int64_t ldc) {
  alignas(64) float stage[2][16 * 16];
  const int last = rows - 16 * (MT - 1);  // valid rows of the last row of tiles
  c_tile_begin<Zero, 0, 0>(c, ldc, MT == 1 ? last : 16, stage[0]);
  if constexpr (NT == 2) c_tile_begin<Zero, 0, 1>(c, ldc, MT == 1 ? last : 16, stage[1]);
  if constexpr (MT == 2) c_tile_begin<Zero, 1, 0>(c, ldc, last, stage[0]);
  if constexpr (MT == 2 && NT == 2) c_tile_begin<Zero, 1, 1>(c, ldc, last, stage[1]);
  const int64_t b_stride = b_ld * 4;
  for (int k0 = 0; k0 < Kp; k0 += 32) {
    Tiles::load<4>(a + k0, a_stride);
    if constexpr (MT == 2) Tiles::load<5>(a + 16 * a_stride / 2 + k0, a_stride);
    if (k0 < k_full) {
      Tiles::load<6>(bt[0] + k0 / 2 * b_ld, b_stride);
      if constexpr (NT == 2) Tiles::load<7>(bt[1] + k0 / 2 * b_ld, b_stride);
    } else {
      Tiles::load<6>(tails[0], 64);
      if constexpr (NT == 2) Tiles::load<7>(tails[1], 64);
    }
    Tiles::dot<0, 4, 6>(fp16);
    if constexpr (NT == 2) Tiles::dot<1, 4, 7>(fp16);
    if constexpr (MT == 2) Tiles::dot<2, 5, 6>(fp16);
    if constexpr (MT == 2 && NT == 2) Tiles::dot<3, 5, 7>(fp16);
  }
  c_tile_end<0, 0>(c, ldc, MT == 1 ? last : 16, stage[0]);
  if constexpr (NT == 2) c_tile_end<0, 1>(c, ldc, MT == 1 ? last : 16, stage[1]);
  if constexpr (MT == 2) c_tile_end<1, 0>(c, ldc, last, stage[0]);
  if constexpr (MT == 2 && NT == 2) c_tile_end<1, 1>(c, ldc, last, stage[1]);
}

// The last, partial k step of one 16-column panel of B (pairs b_ld words apart) as a 16 x 16
// tile: its `pairs` pairs from pair kp0 on, then zero pairs, so that nothing past the panel's
// last pair is read (and A's zero columns never meet a non-finite B).
inline void stage_tail(const uint32_t* panel, int64_t b_ld, int kp0, int pairs, uint32_t* tile) {
  for (int kp = 0; kp < pairs; ++kp) std::memcpy(tile + 16 * kp, panel + (kp0 + kp) * b_ld, 64);
  std::memset(tile + 16 * pairs, 0, static_cast<size_t>(16 - pairs) * 16 * sizeof(uint32_t));
}

// C[M x N] (+)= A B on tiles, the operands already in 16-bit form (N a multiple of 16):
//   A row-major, row r at a + r * lda elements (lda even); rows up to M rounded to 16 readable
//     (rows past M give C rows that are not stored), and columns [K, Kp) zero, Kp = K rounded
//     up to 32;
//   B in pairs of k (the VNNI layout, bf16_pair / pair_panel_rows): the word of columns n of
//     pair kp at b + (n / 16) * b_panel + kp * b_ld + n % 16; the pairs up to ceil(K / 2) are
//     read, those of a last partial step through a zeroed staging tile (so nothing past them is
//     read, and A's zero columns never meet a non-finite B).
// C runs in blocks of 2 x 2 tiles (32 x 32), smaller at the edges, column blocks outside.
template <bool Zero>
__attribute__((noinline)) void gemm_tiles16(bool fp16, int M, int N, int K, const uint16_t* a, int64_t lda,
                                            const uint32_t* b, int64_t b_ld, int64_t b_panel, float* C,
                                            int64_t ldc) {
  const int Kp = (K + 31) / 32 * 32, k_full = K / 32 * 32;
  const int tail_pairs = (K - k_full + 1) / 2;
  alignas(64) uint32_t tail[2][16 * 16];
  tiles_begin();
  const int64_t as = lda * 2;  // A tile row stride, bytes
  for (int n0 = 0; n0 < N; n0 += 32) {
    const bool two_n = N - n0 > 16;
    const uint32_t* bt[2] = {b + (n0 / 16) * b_panel, two_n ? b + (n0 / 16 + 1) * b_panel : nullptr};
    const uint32_t* tails[2] = {tail[0], tail[1]};
    if (k_full < Kp)
      for (int j = 0; j < (two_n ? 2 : 1); ++j) stage_tail(bt[j], b_ld, k_full / 2, tail_pairs, tail[j]);
    for (int m0 = 0; m0 < M; m0 += 32) {
      const int rows = std::min(32, M - m0);
      const uint16_t* am = a + m0 * lda;
      float* c = C + m0 * ldc + n0;
      const bool two_m = rows > 16;
      if (two_m && two_n) tile_block<Zero, 2, 2>(fp16, rows, am, as, bt, b_ld, k_full, tails, Kp, c, ldc);
      else if (two_m) tile_block<Zero, 2, 1>(fp16, rows, am, as, bt, b_ld, k_full, tails, Kp, c, ldc);
      else if (two_n) tile_block<Zero, 1, 2>(fp16, rows, am, as, bt, b_ld, k_full, tails, Kp, c, ldc);
      else tile_block<Zero, 1, 1>(fp16, rows, am, as, bt, b_ld, k_full, tails, Kp, c, ldc);
    }
  }
}

// gemm_tiles16<Zero>(false, rows, n, k, a, ...) (rows <= 32, n a multiple of 16) one
// 32-element k step of one block of C tiles (2 x 2, 2 x 1 for a last 16 columns; 1 x 2 or
// 1 x 1 when rows <= 16, two_m false) per step(): the step's A tiles and the block's B tiles
// loaded, its products run, the block's C tiles loaded (or zeroed) before its first step and
// stored after its last. A k that is an odd multiple of 16 (k % 32 == 16) takes its last
// step's B from `tails` (stage_tails: the last 8 pairs of each 16-column panel and 8 zero
// pairs, as gemm_tiles16 stages them) and A's columns [k, k + 16) must be zero. The same
// products in the same order, so bitwise gemm_tiles16's C in its valid rows; C's rows past the
// caller's valid rows, up to the block's 16 (two_m false) or 32, are loaded and stored whole
// (the caller's buffers must have them, and no valid row reads them), where gemm_tiles16
// stages them. The forward puts a
// softmax row between steps: the tiles then multiply beside the vector units, where a whole
// product in one go ran before or after them (only instructions close together in program
// order overlap, within the core's reorder window). Between steps the job owns all eight
// tiles: nothing else may use them until done().
struct TileJob {
  const uint16_t* a = nullptr;  // A rows, a_stride bytes apart
  int64_t a_stride = 0;
  const uint32_t* b = nullptr;  // B pairs: columns n at b + (n / 16) * b_panel + kp * b_ld + n % 16
  int64_t b_ld = 0, b_panel = 0;
  float* c = nullptr;
  int64_t ldc = 0;
  int n = 0, k = 0;
  bool zero = false;
  bool two_m = true;                // rows > 16: two rows of tiles
  const uint32_t* tails = nullptr;  // k % 32 == 16: panel j's last step at tails + 256 j
  int n0 = 0, k0 = 0;               // the next step

  bool done() const { return n0 >= n; }
  int steps_left() const { return done() ? 0 : (n - n0 + 31) / 32 * k_steps() - k0 / 32; }
  int k_steps() const { return (k + 31) / 32; }
  // Stages each of the n / 16 panels' last step (k % 32 == 16: its 8 pairs) at tails + 256 j.
  static void stage_tails(const uint32_t* b, int64_t b_ld, int64_t b_panel, int n, int k, uint32_t* tails) {
    for (int j = 0; j < n / 16; ++j) stage_tail(b + j * b_panel, b_ld, k / 32 * 16, 8, tails + 256 * j);
  }
  void step() {
    if (done()) return;
    float* const cb = c + n0;
    const int64_t cs = ldc * 4;
    const bool two_n = n - n0 > 16;  // else the last 16 columns: C tiles 0 and 2, B tile 6
    if (k0 == 0) {
      tiles_begin();
      if (zero) {
        Tiles::zero<0>();
        if (two_n) Tiles::zero<1>();
        if (two_m) Tiles::zero<2>();
        if (two_m && two_n) Tiles::zero<3>();
      } else {
        Tiles::load<0>(cb, cs);
        if (two_n) Tiles::load<1>(cb + 16, cs);
        if (two_m) Tiles::load<2>(cb + 16 * ldc, cs);
        if (two_m && two_n) Tiles::load<3>(cb + 16 * ldc + 16, cs);
      }
    }
    const bool tail = tails && k0 + 32 > k;
    const uint32_t* const b0 = tail ? tails + (n0 / 16) * 256 : b + (n0 / 16) * b_panel + k0 / 2 * b_ld;
    const int64_t b_step = tail ? 256 : b_panel, b_stride = tail ? 64 : b_ld * 4;
    Tiles::load<4>(a + k0, a_stride);
    if (two_m) Tiles::load<5>(a + 16 * a_stride / 2 + k0, a_stride);
    Tiles::load<6>(b0, b_stride);
    if (two_n) Tiles::load<7>(b0 + b_step, b_stride);
    Tiles::dot<0, 4, 6>(false);
    if (two_n) Tiles::dot<1, 4, 7>(false);
    if (two_m) Tiles::dot<2, 5, 6>(false);
    if (two_m && two_n) Tiles::dot<3, 5, 7>(false);
    k0 += 32;
    if (k0 < k) return;
    Tiles::store<0>(cb, cs);
    if (two_n) Tiles::store<1>(cb + 16, cs);
    if (two_m) Tiles::store<2>(cb + 16 * ldc, cs);
    if (two_m && two_n) Tiles::store<3>(cb + 16 * ldc + 16, cs);
    k0 = 0;
    n0 += 32;
  }
  void finish() {
    while (!done()) step();
  }
};

// n floats of src to bf16 at dst (the products' rounding, bf16_dot_bits), zero padded to
// n_pad (both even; n_pad - n < 32 need not be a multiple of W).
inline void round_row_bf16(const float* src, int n, int n_pad, uint16_t* dst) {
  int k = 0;
  for (; k + 2 * W <= n; k += 2 * W)
    vstore_u(reinterpret_cast<uint32_t*>(dst + k), Bf16Dot::words(vload(src + k), vload(src + k + W)));
  for (; k < n; ++k) dst[k] = bf16_dot_bits(src[k]);
  for (; k < n_pad; ++k) dst[k] = 0;
}
// Rows r0 and r0 + 1 of an fp32 [rows][ld] block as pair words [c] for c in [c0, c1) (a
// multiple of W apart), the odd row zero when it is past `rows`.
inline void pair_two_rows(const float* src, int64_t ld, int r0, int rows, int c0, int c1, uint32_t* dst) {
  const float* a = src + r0 * ld;
  const bool odd = r0 + 1 < rows;
  for (int c = c0; c < c1; c += W) vstore_u(dst + c, Bf16Dot::rows(vload(a + c), odd ? vload(a + ld + c) : vf{}));
}

// gemm's contract (same operands, same strides; N a multiple of PAD) on tiles: A is rounded
// to the 16-bit format into [Mp][Kp] (rows zero padded to 16, K to 32), B into pairs
// [N / 16][ceil(K / 2)][16] unless `paired` (bf16, K even) has them already (pack_kv's pairs).
template <bool Zero>
__attribute__((noinline)) void gemm_tiles(bool fp16, int M, int N, int K, const float* A, int64_t ars,
                                          int64_t acs, const float* B, int64_t ldb, int64_t bps, float* C,
                                          int64_t ldc, const uint32_t* paired) {
  thread_local std::vector<uint16_t, LineAligned<uint16_t>> a16;
  thread_local std::vector<uint32_t, LineAligned<uint32_t>> b16;
  const int Kp = (K + 31) / 32 * 32, Mp = (M + 15) / 16 * 16, K2 = (K + 1) / 2;
  const auto cvt = [fp16](float x) { return fp16 ? f32_to_f16(x) : bf16_dot_bits(x); };
  a16.resize(static_cast<size_t>(Mp) * Kp);
  for (int r = 0; r < Mp; ++r) {
    uint16_t* o = a16.data() + static_cast<size_t>(r) * Kp;
    if (r >= M) {
      std::fill_n(o, Kp, uint16_t{0});
    } else if (acs == 1 && !fp16) {
      round_row_bf16(A + r * ars, K, Kp, o);
    } else {
      for (int k = 0; k < K; ++k) o[k] = cvt(A[r * ars + k * acs]);
      std::fill(o + K, o + Kp, uint16_t{0});
    }
  }
  if (paired && !fp16 && K % 2 == 0)
    return gemm_tiles16<Zero>(fp16, M, N, K, a16.data(), Kp, paired, PAD, bps / 2, C, ldc);
  b16.resize(static_cast<size_t>(N) * K2);
  for (int j = 0; j < N / 16; ++j)
    for (int kp = 0; kp < K2; ++kp) {
      uint32_t* o = b16.data() + (static_cast<size_t>(j) * K2 + kp) * 16;
      for (int c = 0; c < 16; ++c) {
        const int n = 16 * j + c;
        const float* bc = B + (n / PAD) * bps + n % PAD;
        const float e = bc[2 * kp * ldb], od = 2 * kp + 1 < K ? bc[(2 * kp + 1) * ldb] : 0.0f;
        o[c] = uint32_t{cvt(e)} | uint32_t{cvt(od)} << 16;
      }
    }
  gemm_tiles16<Zero>(fp16, M, N, K, a16.data(), Kp, b16.data(), 16, int64_t{K2} * 16, C, ldc);
}

// One tile product alone: C[m x n] += A[m x 2 k2] B, C row-major (n floats a row), A row-major
// 16-bit elements, B VNNI [k2][n][2]; m, k2, n <= 16. The KernelTable's tile_dot, for tests.
void tile_dot_one(float* c, const uint16_t* a, const uint16_t* b, int m, int k2, int n, bool fp16) {
  tiles_end();
  Tiles::configure({{m, n * 4}, {m, k2 * 4}, {k2, n * 4}});
  Tiles::load<0>(c, n * 4);
  Tiles::load<1>(a, k2 * 4);
  Tiles::load<2>(b, n * 4);
  Tiles::dot<0, 1, 2>(fp16);
  Tiles::store<0>(c, n * 4);
  Tiles::release();
}

// One product by gemm_tiles16 or by a TileJob (job), for tests: the KernelTable's tile_gemm.
void tile_gemm_one(bool job, bool zero, int m, int n, int k, const uint16_t* a, int64_t lda, const uint32_t* b,
                   int64_t b_ld, int64_t b_panel, float* c, int64_t ldc) {
  if (!job) {
    if (zero) gemm_tiles16<true>(false, m, n, k, a, lda, b, b_ld, b_panel, c, ldc);
    else gemm_tiles16<false>(false, m, n, k, a, lda, b, b_ld, b_panel, c, ldc);
    tiles_end();
    return;
  }
  std::vector<uint32_t> tails;
  if (k % 32 == 16) {
    tails.resize(static_cast<size_t>(n / 16) * 256);
    TileJob::stage_tails(b, b_ld, b_panel, n, k, tails.data());
  }
  TileJob j{.a = a, .a_stride = lda * 2, .b = b, .b_ld = b_ld, .b_panel = b_panel, .c = c, .ldc = ldc, .n = n,
            .k = k, .zero = zero, .two_m = m > 16, .tails = tails.empty() ? nullptr : tails.data()};
  j.finish();
  tiles_end();
}
#else
// The tiles' operand helpers exist on the amx paths only; every call is behind Dot::bf16_tiles.
template <bool Zero>
inline void gemm_tiles16(bool, int, int, int, const uint16_t*, int64_t, const uint32_t*, int64_t, int64_t, float*,
                         int64_t) {}
inline void round_row_bf16(const float*, int, int, uint16_t*) {}
inline void pair_two_rows(const float*, int64_t, int, int, int, int, uint32_t*) {}
inline void tiles_end() {}
struct TileJob {
  const uint16_t* a = nullptr;
  int64_t a_stride = 0;
  const uint32_t* b = nullptr;
  int64_t b_ld = 0, b_panel = 0;
  float* c = nullptr;
  int64_t ldc = 0;
  int n = 0, k = 0;
  bool zero = false;
  bool two_m = true;
  const uint32_t* tails = nullptr;
  static void stage_tails(const uint32_t*, int64_t, int64_t, int, int, uint32_t*) {}
  bool done() const { return true; }
  int steps_left() const { return 0; }
  void step() {}
  void finish() {}
};
#endif  // CPATTN_AMX
// Releases the thread's tiles at the end of a unit however it ends (a no-op without tiles).
struct TileScope {
  TileScope() = default;
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
  ~TileScope() { tiles_end(); }
};
using u16vec = std::vector<uint16_t, LineAligned<uint16_t>>;

// How a call's products run: fp32 FMA (gemm), bf16 pairs (gemm_bf16) or tiles (gemm_tiles).
enum class Dot { fma, bf16_pairs, bf16_tiles, fp16_tiles };
// inv_keep = 1 / (1 - dropout_p): the fp16 tiles round their A operand, a kept P / (1 - p) for
// the products with V and dO, to fp16, which holds no more than 65504; a dropout that keeps
// fewer than 1 in 65504 runs the FMA code (its P / (1 - p) came out inf: out and dV with it).
inline Dot dot_for(DType dtype, [[maybe_unused]] float inv_keep) {
#if defined(CPATTN_BF16_DOT)
  if (dtype == DType::bf16) return Dot::bf16_pairs;
#elif defined(CPATTN_AMX)
  if (dtype == DType::bf16) return Dot::bf16_tiles;
  if (dtype == DType::f16 && tiles_fp16() && inv_keep <= 65504.0f) return Dot::fp16_tiles;
#endif
  (void)dtype;
  return Dot::fma;
}

// The one call of every product but the grouped forward's (gemm_groups): gemm, or the
// products of the call's Dot (dot_for).
// `paired`: B in bf16 pairs (Packed::paired), for the bf16_pairs products; ignored otherwise.
// `nv_max`: the widest bf16 tile, in vectors (BF16_NV where it is 4, otherwise 2): the forward's
// two products take the wide tiles; the backward's keep 2 (its products with 4 ran 3-8% slower
// in the bf16 backward on Zen 4, within the noise where only S = Q K^T had them).
template <bool Zero>
inline void mm(Dot dot, int M, int N, int K, const float* A, int64_t ars, int64_t acs,
               const float* B, int64_t ldb, int64_t bps, float* C, int64_t ldc,
               const uint32_t* paired = nullptr, int nv_max = 2) {
#ifdef CPATTN_BF16_DOT
  if (dot == Dot::bf16_pairs)
    return gemm_bf16<Zero>(M, N, K, A, ars, acs, B, ldb, bps, C, ldc, paired, nv_max);
#endif
  (void)paired, (void)nv_max;
#ifdef CPATTN_AMX
  if (dot == Dot::bf16_tiles || dot == Dot::fp16_tiles)
    return gemm_tiles<Zero>(dot == Dot::fp16_tiles, M, N, K, A, ars, acs, B, ldb, bps, C, ldc, paired);
#endif
  (void)dot;
  gemm<Zero>(M, N, K, A, ars, acs, B, ldb, bps, C, ldc);
}

// ---- storage conversion ------------------------------------------------------------------
// Element conversions are cpattn/dtype.hpp's (load_elem: common.hpp).
// Row of n elements starting at base[i0] to fp32 dst, zero padded to n_pad. One loop per
// dtype, so that the compiler vectorizes the conversion (a per-element switch kept the bf16
// and fp16 rows scalar: the query side's rows, loaded again by every call, were most of the
// backward's own time in bf16; docs/benchmarks.md, the ring at cp = 2).
inline void ld_row(const void* base, DType t, int64_t i0, int n, int n_pad, float* dst) {
  switch (t) {
    case DType::f32: std::memcpy(dst, static_cast<const float*>(base) + i0, sizeof(float) * n); break;
    case DType::f16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + i0;
      for (int d = 0; d < n; ++d) dst[d] = f16_to_f32(src[d]);
      break;
    }
    case DType::bf16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + i0;
      for (int d = 0; d < n; ++d) dst[d] = bf16_to_f32(src[d]);
      break;
    }
  }
  for (int d = n; d < n_pad; ++d) dst[d] = 0.0f;
}
// Asks for the n elements at base[i0] (a row of a token-major tensor) ahead of their use. The
// query side is read head by head, one row every row_stride elements (4 KiB and more apart
// for 16 heads of 128): the hardware prefetchers do not follow such a stride across pages,
// and each row's load waited for memory (most of the bf16 backward's own time).
inline void prefetch_row(const void* base, DType t, int64_t i0, int n) {
  const auto* p = static_cast<const char*>(base) + i0 * static_cast<int64_t>(dtype_size(t));
  const int64_t bytes = n * static_cast<int64_t>(dtype_size(t));
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}
constexpr int64_t kRowsAhead = 8;  // rows of the query side prefetched ahead of their load
inline void st_row(void* base, DType t, int64_t i0, int n, const float* src, float mul) {
  switch (t) {
    case DType::f32: {
      float* o = static_cast<float*>(base) + i0;
      for (int d = 0; d < n; ++d) o[d] = src[d] * mul;
      return;
    }
    case DType::f16: {
      uint16_t* o = static_cast<uint16_t*>(base) + i0;
      for (int d = 0; d < n; ++d) o[d] = f32_to_f16(src[d] * mul);
      return;
    }
    case DType::bf16: {  // f32_to_bf16 (cpattn/dtype.hpp) W elements at a time: the same integer steps
      uint16_t* o = static_cast<uint16_t*>(base) + i0;
      const vf mv = vset(mul);
      int d = 0;
      for (; d + W <= n; d += W) {
        // A vector cast, not std::bit_cast: unoptimized, that is an out-of-line function of the
        // baseline ISA, and passing it a 256- or 512-bit vector crashed a Debug build.
        const vu u = (vu)(vload(src + d) * mv);
        const vu r = (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        const vh h = __builtin_convertvector(r, vh);
        std::memcpy(o + d, &h, sizeof h);
      }
      for (; d < n; ++d) o[d] = f32_to_bf16(src[d] * mul);
      return;
    }
  }
}

#if CPATTN_VW == 16  // (AVX-512F: the avx512, avx512_bf16 and amx paths)
// r[i] (16 dwords each) transposed in place: r[j] element i = old r[i] element j. Two-source
// permutes throughout (GCC 12 warns of an uninitialized operand in its unpack and lane-shuffle
// intrinsics): per 128-bit lane the unpacks of dwords, then of dword pairs, then lane moves.
inline void transpose16x16_epi32(__m512i (&r)[16]) {
  auto lanes = [](int a, int b, int c, int d) {  // dword i of lane L from the 4L-relative index (16+: b's)
    return _mm512_setr_epi32(a, b, c, d, a + 4, b + 4, c + 4, d + 4, a + 8, b + 8, c + 8, d + 8, a + 12, b + 12,
                             c + 12, d + 12);
  };
  const __m512i lo32 = lanes(0, 16, 1, 17), hi32 = lanes(2, 18, 3, 19);
  const __m512i lo64 = lanes(0, 1, 16, 17), hi64 = lanes(2, 3, 18, 19);
  const __m512i even_lanes = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i odd_lanes = _mm512_add_epi32(even_lanes, _mm512_set1_epi32(4));
  auto perm = [](__m512i a, __m512i idx, __m512i b) { return _mm512_permutex2var_epi32(a, idx, b); };
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = perm(r[i], lo32, r[i + 1]);
    t[i + 1] = perm(r[i], hi32, r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = perm(t[i], lo64, t[i + 2]);
    r[i + 1] = perm(t[i], hi64, t[i + 2]);
    r[i + 2] = perm(t[i + 1], lo64, t[i + 3]);
    r[i + 3] = perm(t[i + 1], hi64, t[i + 3]);
  }
  // Each 128-bit lane of r[i] now holds a 4 x 4 block of the transpose; two lane shuffles
  // put the blocks in place.
  for (int i = 0; i < 4; ++i) {
    t[i] = perm(r[i], even_lanes, r[i + 4]);
    t[i + 4] = perm(r[i], odd_lanes, r[i + 4]);
    t[i + 8] = perm(r[i + 8], even_lanes, r[i + 12]);
    t[i + 12] = perm(r[i + 8], odd_lanes, r[i + 12]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = perm(t[i], even_lanes, t[i + 8]);
    r[i + 8] = perm(t[i], odd_lanes, t[i + 8]);
    r[i + 4] = perm(t[i + 4], even_lanes, t[i + 12]);
    r[i + 12] = perm(t[i + 4], odd_lanes, t[i + 12]);
  }
}
#endif

// ---- packed K/V --------------------------------------------------------------------------
struct Packed {
  int64_t nblk = 0;  // blocks of BK physical key rows
  int dp = 0, dvp = 0;
  // per (kv head, block), in PAD-column panels: kt [BK/PAD][dp][PAD] (K^T; panel j of a kv
  // head's keys is at Kt(hk, 0) + j * dp * PAD, whatever the block), vt [BK/PAD][dvp][PAD]
  // (V^T, likewise). K and V are per kv head, not per block: kr [dp/PAD][nblk*BK][PAD],
  // vr [dvp/PAD][nblk*BK][PAD], so that dS K and P V can run over any number of consecutive
  // blocks (B panel stride vr_ps(), the same for both). A forward packs kt and vr, a backward
  // kt, kr and vt (the others stay empty).
  // A packed buffer: its own storage, or `ext` (KvPackShare's buffer) when set before resize.
  template <class T, class Vec>
  struct Buf {
    Vec own;
    T* ext = nullptr;
    size_t n = 0;
    void resize(size_t m) {
      n = m;
      if (!ext) own.resize(m);
    }
    T* data() { return ext ? ext : own.data(); }
    const T* data() const { return ext ? ext : own.data(); }
    size_t size() const { return n; }
    size_t owned() const { return ext ? 0 : n; }  // elements this call allocated
    bool empty() const { return n == 0; }
  };
  Buf<float, raw_fvec> kt, kr, vr, vt;  // every element written by pack_kv (no zero fill first)
  // For bf16 products (pack_kv's `pairs`, or pack_kv_tiles alone on the amx paths, which
  // leaves the float buffers empty): the same ones in bf16 pairs of rows (pair_panel_rows),
  // each half the length its float buffer has; empty on the fp32-product paths.
  using Pairs = Buf<uint32_t, raw_uvec>;
  Pairs kt2, kr2, vr2, vt2;
  // The pairs of a B operand that starts at B in one of the float buffers at an even k (every
  // panel's row count is even), or null when there are none.
  const uint32_t* paired(const float* B) const {
    for (const auto& [f, u] : {std::pair{&kt, &kt2}, {&kr, &kr2}, {&vr, &vr2}, {&vt, &vt2}}) {
      if (u->empty() || B < f->data() || B >= f->data() + f->size()) continue;
      const int64_t off = B - f->data();
      return off % (2 * PAD) == 0 ? u->data() + off / 2 : nullptr;
    }
    return nullptr;
  }
  const float* Kt(int hk, int64_t b) const { return kt.data() + (hk * nblk + b) * BK * dp; }
  const float* Kr(int hk) const { return kr.data() + hk * nblk * BK * dp; }
  const float* Vr(int hk) const { return vr.data() + hk * nblk * BK * dvp; }
  int64_t vr_ps() const { return nblk * BK * PAD; }
  const float* Vt(int hk, int64_t b) const { return vt.data() + (hk * nblk + b) * BK * dvp; }
  // The pairs of the B operand of each product at key row k0 (a multiple of PAD): K^T, V^T
  // (panels of PAD keys) and K, V (row pairs; panel stride vr_ps() / 2). What paired() gives
  // for the float operand at the same place, also where pack_kv_tiles made no float buffers.
  const uint32_t* Kt2(int hk, int64_t k0) const { return kt2.data() + (hk * nblk * BK * dp + k0 / PAD * dp * PAD) / 2; }
  const uint32_t* Vt2(int hk, int64_t k0) const { return vt2.data() + (hk * nblk * BK * dvp + k0 / PAD * dvp * PAD) / 2; }
  const uint32_t* Kr2(int hk, int64_t k0) const { return kr2.data() + (hk * nblk * BK * dp + k0 * PAD) / 2; }
  const uint32_t* Vr2(int hk, int64_t k0) const { return vr2.data() + (hk * nblk * BK * dvp + k0 * PAD) / 2; }
};

// A KvPackShare's buffer as a call's packed operands: k_elems elements of K^T, then V (a
// forward) or K, then V^T (a backward), in the element type of `kt`'s buffer (floats, or
// words of bf16 pairs). Set before the buffers' resize.
template <class B>
void point_at_share(const KvPackShare& share, bool backward, size_t k_elems, B& kt, B& kr, B& vr, B& vt) {
  auto* w = reinterpret_cast<decltype(kt.ext)>(share.buffer);
  kt.ext = w;
  w += k_elems;
  if (backward) {
    kr.ext = w;
    vt.ext = w + k_elems;
  } else {
    vr.ext = w;
  }
}
// The key rows a call's tasks' runs name: the kernels read no other K/V row (AttnInputs), and
// with AttnBwdParams::named_rows_only write no other dK/dV row. all: every row is named (the
// usual call: nothing to test per row); else row[r], and per packed block of BK rows whether
// any of its rows is.
struct NamedRows {
  bool all = true;
  std::vector<char> row, block;
  NamedRows(const WorkList& w, int64_t total_k) {
    const std::vector<std::pair<int64_t, int64_t>> spans = named_key_rows(w);
    if (total_k == 0 || (spans.size() == 1 && spans[0].first == 0 && spans[0].second >= total_k)) return;
    all = false;
    row.assign(static_cast<size_t>(total_k), 0);
    block.assign(static_cast<size_t>((total_k + BK - 1) / BK), 0);
    for (const auto& [a, b] : spans) {
      std::fill(row.begin() + a, row.begin() + b, char{1});
      for (int64_t k = a / BK; k * BK < b; ++k) block[static_cast<size_t>(k)] = 1;
    }
  }
  bool named(int64_t r) const { return all || row[static_cast<size_t>(r)] != 0; }
  bool block_named(int64_t b) const { return all || block[static_cast<size_t>(b)] != 0; }
  // What a call's packing tests rows against: null (every row) when all are named or when it
  // packs a KvPackShare's part, which its other callers read whatever their runs name.
  const NamedRows* for_packing(const KvPackShare* share) const { return share || all ? nullptr : this; }
};

// The (kv head, block) units [first, second) a call packs of `units`: its share's, or all.
inline std::pair<int64_t, int64_t> packed_units(const KvPackShare* share, int64_t units) {
  if (!share) return {0, units};
  return {units * share->part / share->parts, units * (share->part + 1) / share->parts};
}

// The packed K/V of a forward (backward = false: K^T and V, its products' B operands) or of a
// backward (K^T, K and V^T; V rows are no operand of it). Alone (no KvPackShare), only the
// blocks with a row that `nm` names are packed, and their rows it does not name as zeros (read
// neither: a transfer may still be writing them); a share packs every row for every caller.
void pack_kv(const AttnInputs& in, bool backward, bool pairs, Packed& pk, const NamedRows& nm_in) {
  const ConstTensorView& K = in.k;
  const ConstTensorView& V = in.v;
  const int64_t total_k = K.rows;
  const DType dtype = in.dtype();
  const int64_t k_rs = K.row_step(), k_hs = K.head_step();
  const int64_t v_rs = V.row_step(), v_hs = V.head_step();
  pk.nblk = (total_k + BK - 1) / BK;
  pk.dp = pad_up(K.dim);
  pk.dvp = pad_up(V.dim);
  const size_t nb = static_cast<size_t>(K.heads) * pk.nblk * BK;
  // With in.kv_pack_share (KvPackLayout::fp32: not with pairs, which pack alone): the floats
  // in its buffer (K^T first, then V, or K then V^T), this call's share of the (kv head,
  // block) units alone; the caller syncs before any read.
  const KvPackShare* share = pairs ? nullptr : in.kv_pack_share;
  const NamedRows* nm = nm_in.for_packing(share);  // (null: every row)
  if (share) point_at_share(*share, backward, nb * pk.dp, pk.kt, pk.kr, pk.vr, pk.vt);  // nb (2 dp + dvp) floats
  // Not zeroed: every element of a packed block is written below, the last block's rows past
  // total_k as zeros (a block no run reaches is neither written nor read).
  pk.kt.resize(nb * pk.dp);
  pk.vr.resize(backward ? 0 : nb * pk.dvp);
  pk.kr.resize(backward ? nb * pk.dp : 0);
  pk.vt.resize(backward ? nb * pk.dvp : 0);
  const auto [u0, u1] = packed_units(share, K.heads * pk.nblk);
  // one panel buffer per thread (live while packing, before a backward's per-thread buffers)
  // (as many as the threads parallel_for starts: at most one a unit, whatever num_threads asks)
  std::vector<std::vector<float>> panels(static_cast<size_t>(threads_started(u1 - u0, in.options.num_threads)));
  parallel_for(u1 - u0, in.options.num_threads, [&](int64_t i, int th) {
    const int64_t u = u0 + i;
    const int hk = static_cast<int>(u / pk.nblk);
    const int64_t b = u % pk.nblk;
    if (nm && !nm->block_named(b)) return;
    float* kt = pk.kt.data() + u * BK * pk.dp;
    float* vr = backward ? nullptr : pk.vr.data() + hk * pk.nblk * BK * pk.dvp;
    float* kr = backward ? pk.kr.data() + hk * pk.nblk * BK * pk.dp : nullptr;
    float* vt = backward ? pk.vt.data() + u * BK * pk.dvp : nullptr;
    // A panel of PAD rows at a time: loaded into `rows` ([PAD][width], the pad past the head
    // dim and rows past total_k as zeros), then stored as rows (K, V: PAD-float pieces of each
    // row) and transposed (K^T, V^T). The next panel's rows are asked for first (the first
    // panel's before the loop): the rows of one kv head are a row step apart (2 KiB and more),
    // a stride the hardware prefetchers do not follow across pages, and each row's load waited
    // for memory.
    std::vector<float>& rows = panels[static_cast<size_t>(th)];
    rows.resize(static_cast<size_t>(PAD) * std::max(pk.dp, pk.dvp));
    auto load = [&](const ConstTensorView& X, int64_t rs, int64_t hs, int64_t r0, int width) {
      for (int c = 0; c < PAD; ++c) {
        const int64_t r = r0 + c;
        float* row = rows.data() + c * width;
        if (r < total_k && (!nm || nm->named(r)))
          ld_row(X.data, dtype, in.stored_key_row(r) * rs + hk * hs, X.dim, width, row);
        else
          std::fill(row, row + width, 0.0f);
      }
    };
    auto prefetch = [&](const ConstTensorView& X, int64_t rs, int64_t hs, int64_t r0) {
      for (int64_t r = r0; r < std::min(r0 + PAD, total_k); ++r)
        if (!nm || nm->named(r)) prefetch_row(X.data, dtype, in.stored_key_row(r) * rs + hk * hs, X.dim);
    };
    // rows as PAD-float pieces of each row: piece d / PAD of row r at dst + (d / PAD) * vr_ps() + r * PAD.
    auto store_rows = [&](int64_t r0, int width, float* dst) {
      for (int c = 0; c < PAD; ++c)
        for (int d0 = 0; d0 < width; d0 += PAD)
          std::memcpy(dst + (d0 / PAD) * pk.vr_ps() + (r0 + c) * PAD, rows.data() + c * width + d0, PAD * sizeof(float));
    };
    // rows transposed: dst[d * PAD + c] = row c's element d.
    auto store_transposed = [&](int width, float* dst) {
#if CPATTN_VW == 16
      static_assert(PAD == 16);
      __m512i x[16];
      for (int d0 = 0; d0 < width; d0 += 16) {
        for (int c = 0; c < 16; ++c) x[c] = _mm512_loadu_si512(rows.data() + c * width + d0);
        transpose16x16_epi32(x);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (d0 + j) * PAD, x[j]);
      }
#else
      for (int d = 0; d < width; ++d)
        for (int c = 0; c < PAD; ++c) dst[d * PAD + c] = rows[c * width + d];
#endif
    };
    prefetch(K, k_rs, k_hs, b * BK);
    prefetch(V, v_rs, v_hs, b * BK);
    for (int p = 0; p < BK / PAD; ++p) {
      const int64_t r0 = b * BK + p * PAD;
      if (p + 1 < BK / PAD) {  // (the block's own rows: the next block may be another caller's)
        prefetch(K, k_rs, k_hs, r0 + PAD);
        prefetch(V, v_rs, v_hs, r0 + PAD);
      }
      load(K, k_rs, k_hs, r0, pk.dp);
      store_transposed(pk.dp, kt + p * pk.dp * PAD);
      if (kr) store_rows(r0, pk.dp, kr);
      load(V, v_rs, v_hs, r0, pk.dvp);
      if (vr) store_rows(r0, pk.dvp, vr);
      if (vt) store_transposed(pk.dvp, vt + p * pk.dvp * PAD);
    }
  });
  if (!pairs) return;
  // The pairs, block by block: a block's rows of K^T and V^T are one run of panels of their
  // own; its rows of K and V are BK rows of each of the kv head's panels.
  pk.kt2.resize(pk.kt.size() / 2);
  pk.vr2.resize(pk.vr.size() / 2);
  pk.kr2.resize(pk.kr.size() / 2);
  pk.vt2.resize(pk.vt.size() / 2);
  parallel_for(K.heads * pk.nblk, in.options.num_threads, [&](int64_t u, int) {
    const int64_t hk = u / pk.nblk, b = u % pk.nblk;
    if (nm && !nm->block_named(b)) return;
    pair_panel_rows(pk.kt.data() + u * BK * pk.dp, BK * pk.dp / PAD / 2, pk.kt2.data() + u * BK * pk.dp / 2);
    if (!backward) {
      for (int pn = 0; pn < pk.dvp / PAD; ++pn) {
        const int64_t off = hk * pk.nblk * BK * pk.dvp + pn * pk.vr_ps() + b * BK * PAD;
        pair_panel_rows(pk.vr.data() + off, BK / 2, pk.vr2.data() + off / 2);
      }
      return;
    }
    for (int pn = 0; pn < pk.dp / PAD; ++pn) {
      const int64_t off = hk * pk.nblk * BK * pk.dp + pn * pk.vr_ps() + b * BK * PAD;
      pair_panel_rows(pk.kr.data() + off, BK / 2, pk.kr2.data() + off / 2);
    }
    pair_panel_rows(pk.vt.data() + u * BK * pk.dvp, BK * pk.dvp / PAD / 2, pk.vt2.data() + u * BK * pk.dvp / 2);
  });
}


#ifdef CPATTN_AMX
// bf16_dot_bits of a stored bf16 value, from its bits: a denormal to a zero of its sign, a NaN
// made quiet, every other value itself (it is a bf16 already: nothing to round).
inline uint32_t dot_bits_of_bf16(uint16_t b) {
  if ((b & 0x7f80u) == 0) return b & 0x8000u;
  return (b & 0x7fffu) > 0x7f80u ? b | 0x40u : b;
}

// pack_kv for bf16 storage on tiles: the four pair buffers alone, straight from the stored
// rows (the tiles read nothing else of K and V), bitwise what pack_kv's pairs hold. No float
// buffer: a third of pack_kv's writes, and no float pass between the source and the pairs.
// Every word is written (the last block's rows past total_k and the head dims' padding as
// zeros), so the buffers are not zero-filled first.
#if CPATTN_AMX == 1
// dot_bits_of_bf16 on 32 stored bf16 values at once.
inline __m512i dot_bits_of_bf16(__m512i x) {
  const __m512i exponent = _mm512_set1_epi16(0x7f80);
  const __mmask32 denormal = _mm512_testn_epi16_mask(x, exponent);
  const __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(x, _mm512_set1_epi16(0x7fff)), exponent);
  x = _mm512_mask_mov_epi16(x, denormal, _mm512_and_si512(x, _mm512_set1_epi16(static_cast<int16_t>(0x8000))));
  return _mm512_mask_mov_epi16(x, nan, _mm512_or_si512(x, _mm512_set1_epi16(0x40)));
}

// The 32 elements of a stored row from element e0 (those past `dim` as zeros), as dot bits;
// a null row (past total_k) is all zeros.
inline __m512i load_dot_bits(const uint16_t* row, int e0, int dim) {
  if (row == nullptr || e0 >= dim) return _mm512_setzero_si512();
  const int n = dim - e0;
  const __mmask32 m = n >= 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
  return dot_bits_of_bf16(_mm512_maskz_loadu_epi16(m, row + e0));
}

#endif


#if CPATTN_AMX == 1
// The _mm512_permutex2var_epi16 index that interleaves two rows' 32 16-bit elements x0, x1
// into words (x0[i], x1[i]) for i in [0, 16); plus 16 in every lane, for i in [16, 32): a row
// pair in the VNNI layout of a tile's B.
inline __m512i pair_lo_index() {
  return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
                          35, 3, 34, 2, 33, 1, 32, 0);
}

// dst[d * dst_ld + j] = src[j * ld + d] for j < 32 and d < dims: 32 rows of 16-bit elements
// (ld a multiple of 32, every row readable up to dims rounded up to 32), transposed; rows at
// and past `rows` give zero columns. Per 32 x 32: rows paired into words (dims d, rows 2p and
// 2p + 1) and two 16 x 16 transposes of words: column j's elements 64 bytes at a time.
inline void transpose_rows32(const uint16_t* src, int64_t ld, int rows, int dims, uint16_t* dst, int64_t dst_ld) {
  const __m512i lo = pair_lo_index(), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int d0 = 0; d0 < dims; d0 += 32) {
    __m512i r0[16], r1[16];
    for (int p = 0; p < 16; ++p) {
      const __m512i x0 = 2 * p < rows ? _mm512_loadu_si512(src + 2 * p * ld + d0) : _mm512_setzero_si512();
      const __m512i x1 = 2 * p + 1 < rows ? _mm512_loadu_si512(src + (2 * p + 1) * ld + d0) : _mm512_setzero_si512();
      r0[p] = _mm512_permutex2var_epi16(x0, lo, x1);
      r1[p] = _mm512_permutex2var_epi16(x0, hi, x1);
    }
    transpose16x16_epi32(r0);
    transpose16x16_epi32(r1);
    for (int i = 0; i < 16 && d0 + i < dims; ++i) _mm512_storeu_si512(dst + (d0 + i) * dst_ld, r0[i]);
    for (int i = 0; i < 16 && d0 + 16 + i < dims; ++i) _mm512_storeu_si512(dst + (d0 + 16 + i) * dst_ld, r1[i]);
  }
}

#endif
// pack_kv's operands (K^T and V, or with `backward` K^T, K and V^T) in bf16 pairs alone. With
// in.kv_pack_share: in its buffer (K^T first, then V, or K then V^T), this call's share of the
// (kv head, block) units alone; the caller syncs before any read.
void pack_kv_tiles(const AttnInputs& in, bool backward, Packed& pk, const NamedRows& nm_in) {
  const ConstTensorView& K = in.k;
  const ConstTensorView& V = in.v;
  const int64_t total_k = K.rows;
  const int64_t k_rs = K.row_step(), k_hs = K.head_step();
  const int64_t v_rs = V.row_step(), v_hs = V.head_step();
  pk.nblk = (total_k + BK - 1) / BK;
  pk.dp = pad_up(K.dim);
  pk.dvp = pad_up(V.dim);
  const int dp = pk.dp, dvp = pk.dvp;
  const size_t nb = static_cast<size_t>(K.heads) * pk.nblk * BK;
  const KvPackShare* share = in.kv_pack_share;
  const NamedRows* nm = nm_in.for_packing(share);
  if (share) point_at_share(*share, backward, nb * dp / 2, pk.kt2, pk.kr2, pk.vr2, pk.vt2);  // nb (2 dp + dvp) bf16
  pk.kt2.resize(nb * dp / 2);
  pk.vr2.resize(backward ? 0 : nb * dvp / 2);
  pk.kr2.resize(backward ? nb * dp / 2 : 0);
  pk.vt2.resize(backward ? nb * dvp / 2 : 0);
  const int64_t ps2 = pk.vr_ps() / 2;  // words per panel of K's and V's row pairs
  const auto* kd = static_cast<const uint16_t*>(K.data);
  const auto* vd = static_cast<const uint16_t*>(V.data);
  const auto [u0, u1] = packed_units(share, K.heads * pk.nblk);
  parallel_for(u1 - u0, in.options.num_threads, [&](int64_t i, int) {
    const int64_t u = u0 + i;
    const int hk = static_cast<int>(u / pk.nblk);
    const int64_t b = u % pk.nblk;
    if (nm && !nm->block_named(b)) return;
    // Key row r of K or V for this kv head (stored row in.key_rows[r] if given), null past
    // total_k and where no run names it.
    auto at = [&](int64_t r) { return r < total_k && (!nm || nm->named(r)); };
    auto k_row = [&](int64_t r) { return at(r) ? kd + in.stored_key_row(r) * k_rs + hk * k_hs : nullptr; };
    auto v_row = [&](int64_t r) { return at(r) ? vd + in.stored_key_row(r) * v_rs + hk * v_hs : nullptr; };
    uint32_t* kt2 = pk.kt2.data() + u * BK * dp / 2;
    uint32_t* vr2 = backward ? nullptr : pk.vr2.data() + hk * pk.nblk * BK * dvp / 2;
    uint32_t* kr2 = backward ? pk.kr2.data() + hk * pk.nblk * BK * dp / 2 : nullptr;
    uint32_t* vt2 = backward ? pk.vt2.data() + u * BK * dvp / 2 : nullptr;
#if CPATTN_AMX == 1
    // K^T, V^T of the block: word (panel c / PAD, pair j, column c % PAD) = row c's elements
    // 2j, 2j + 1. Per panel of 16 rows and 16 pairs: 16 row loads, one 16 x 16 transpose.
    auto transposed = [&](auto row_of, int dim, int dpad, uint32_t* blk) {
      __m512i r[16];
      for (int c0 = 0; c0 < BK; c0 += PAD) {
        uint32_t* panel = blk + (c0 / PAD) * (dpad / 2) * PAD;
        for (int j0 = 0; j0 < dpad / 2; j0 += 16) {
          for (int c = 0; c < 16; ++c) r[c] = load_dot_bits(row_of(b * BK + c0 + c), 2 * j0, dim);
          transpose16x16_epi32(r);
          for (int j = j0; j < std::min(j0 + 16, dpad / 2); ++j) _mm512_storeu_si512(panel + j * PAD, r[j - j0]);
        }
      }
    };
    // K, V: word (panel d / PAD, row pair r / 2, column d % PAD) = rows r, r + 1 at d: the two
    // rows' elements interleaved, two panels per 32 elements.
    const __m512i lo = pair_lo_index();
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    auto rows = [&](auto row_of, int dim, int dpad, uint32_t* head) {
      for (int64_t r = b * BK; r < (b + 1) * BK; r += 2) {
        const uint16_t* r0 = row_of(r);
        const uint16_t* r1 = row_of(r + 1);
        for (int d0 = 0; d0 < dpad; d0 += 32) {
          const __m512i x0 = load_dot_bits(r0, d0, dim), x1 = load_dot_bits(r1, d0, dim);
          uint32_t* w = head + (d0 / PAD) * ps2 + (r / 2) * PAD;
          _mm512_storeu_si512(w, _mm512_permutex2var_epi16(x0, lo, x1));
          if (d0 + PAD < dpad) _mm512_storeu_si512(w + ps2, _mm512_permutex2var_epi16(x0, hi, x1));
        }
      }
    };
#else
    auto transposed = [&](auto row_of, int dim, int dpad, uint32_t* blk) {
      for (int c = 0; c < BK; ++c) {
        const uint16_t* row = row_of(b * BK + c);
        uint32_t* w = blk + (c / PAD) * (dpad / 2) * PAD + c % PAD;
        for (int j = 0; j < dpad / 2; ++j) {
          const uint32_t e0 = row && 2 * j < dim ? dot_bits_of_bf16(row[2 * j]) : 0u;
          const uint32_t e1 = row && 2 * j + 1 < dim ? dot_bits_of_bf16(row[2 * j + 1]) : 0u;
          w[j * PAD] = e0 | e1 << 16;
        }
      }
    };
    auto rows = [&](auto row_of, int dim, int dpad, uint32_t* head) {
      for (int64_t r = b * BK; r < (b + 1) * BK; r += 2) {
        const uint16_t* r0 = row_of(r);
        const uint16_t* r1 = row_of(r + 1);
        for (int d = 0; d < dpad; ++d) {
          const uint32_t e0 = r0 && d < dim ? dot_bits_of_bf16(r0[d]) : 0u;
          const uint32_t e1 = r1 && d < dim ? dot_bits_of_bf16(r1[d]) : 0u;
          head[(d / PAD) * ps2 + (r / 2) * PAD + d % PAD] = e0 | e1 << 16;
        }
      }
    };
#endif
    transposed(k_row, K.dim, dp, kt2);
    if (!backward) {
      rows(v_row, V.dim, dvp, vr2);
      return;
    }
    rows(k_row, K.dim, dp, kr2);
    transposed(v_row, V.dim, dvp, vt2);
  });
}
#else
void pack_kv_tiles(const AttnInputs&, bool, Packed&, const NamedRows&) {}  // t16 is false without tiles
#endif

// The forward's exp pass over a softmax row's computed columns [a0, a1) (a multiple of W
// apart): e = 2^(s * mul - m) added to sum in column order and, with bf16 tiles, written
// straight to the row's P operand as round_row_bf16 would write it from e (zero padded to
// n32), so that e is neither stored in fp32 nor read again. Without bf16 rounding the
// tiles never ask for it.
#ifdef CPATTN_BF16_ROUND
inline vf exp_row_bf16(const float* s, int a0, int a1, vf mulv, vf mv, int n32, uint16_t* prow) {
  vf sum = vf{};
  int c = a0;
  for (; c + 2 * W <= a1; c += 2 * W) {
    const vf e0 = vexp2_softmax(vload(s + c) * mulv - mv);
    const vf e1 = vexp2_softmax(vload(s + c + W) * mulv - mv);
    sum += e0;
    sum += e1;
    vstore_u(reinterpret_cast<uint32_t*>(prow + (c - a0)), Bf16Dot::words(e0, e1));
  }
  if (c < a1) {  // W columns left: their words and W zeros (a1 - a0 is a multiple of W, so
                 // this stays within n32)
    const vf e0 = vexp2_softmax(vload(s + c) * mulv - mv);
    sum += e0;
    vstore_u(reinterpret_cast<uint32_t*>(prow + (c - a0)), Bf16Dot::words(e0, vf{}));
    c += 2 * W;
  }
  for (int k = c - a0; k < n32; ++k) prow[k] = 0;
  return sum;
}
#else
// Never called: P is fused only on bf16 tiles, whose paths define CPATTN_BF16_ROUND.
inline vf exp_row_bf16(const float*, int, int, vf, vf, int, uint16_t*) { __builtin_unreachable(); }
#endif

// A piece: key columns [c0, c1) of block b of B rows (physical rows b*B + c), positions
// p_lo + (c - c0); products run over the PAD-aligned columns [a0, a1).
struct Piece {
  int64_t b, p_lo;
  int c0, c1, a0, a1;
};

// Calls fn(piece) for the pieces of task t in key order that some query position in
// [qp_min, qp_max] can see: pieces wholly left of the window are skipped, and the first piece
// past the right limit (causal or window) ends the loop. fn returns nothing.
template <int B, class Fn>
void for_each_piece(const WorkList& w, const AttnTask& t, const Visibility& vz, int64_t qp_min,
                    int64_t qp_max, Fn&& fn) {
  for (int64_t r = t.run_begin; r < t.run_end; ++r) {
    const KeyRun& run = w.runs[r];
    const int64_t end = run.row + run.len;
    for (int64_t b = run.row / B; b * B < end; ++b) {
      const int64_t lo = std::max(run.row, b * B), hi = std::min(end, (b + 1) * B);
      Piece pc;
      pc.b = b;
      pc.p_lo = run.pos + (lo - run.row);
      if (vz.hi_bounded && pc.p_lo > qp_max + vz.hi) return;
      if (vz.lo_bounded && pc.p_lo + (hi - lo) - 1 < qp_min - vz.lo) continue;
      pc.c0 = static_cast<int>(lo - b * B);
      pc.c1 = static_cast<int>(hi - b * B);
      pc.a0 = pc.c0 / PAD * PAD;
      pc.a1 = (pc.c1 + PAD - 1) / PAD * PAD;
      fn(pc);
    }
  }
}

// Visible columns of a piece for query position qp: [vb, ve) (empty when vb >= ve).
inline int visible_end(const Piece& pc, const Visibility& vz, int64_t qp) {
  if (!vz.hi_bounded) return pc.c1;
  const int64_t e = pc.c0 + (qp + vz.hi - pc.p_lo) + 1;
  return static_cast<int>(std::clamp<int64_t>(e, pc.c0, pc.c1));
}
inline int visible_begin(const Piece& pc, const Visibility& vz, int64_t qp) {
  if (!vz.lo_bounded) return pc.c0;
  const int64_t b = pc.c0 + (qp - vz.lo - pc.p_lo);
  return static_cast<int>(std::clamp<int64_t>(b, pc.c0, pc.c1));
}

// The soft cap and ALiBi of one score x = scale * q.k at key position kp; dcap gets
// d(result)/dx. Only on the paths with a soft cap or ALiBi (Visibility::extra).
inline float transform_score(float x, float cap, float slope, int64_t qp, int64_t kp, float& dcap) {
  dcap = 1.0f;
  if (cap > 0.0f) {
    const float th = std::tanh(x / cap);
    x = cap * th;
    dcap = 1.0f - th * th;
  }
  const int64_t dist = qp > kp ? qp - kp : kp - qp;
  return x - slope * static_cast<float>(dist);
}

// The per-call constants of the masks, scores, dropout and products: forward_impl's and
// backward_impl's alike.
struct CallRules {
  Visibility vz;
  bool scored;      // per-element score transforms (soft cap, ALiBi)
  float scale, cl;  // the softmax scale, and it times log2(e)
  bool dropout;
  uint32_t thr;     // dropout_threshold(dropout_p)
  float inv_keep;   // 1 / (1 - dropout_p)
  Dot bd;           // how the products run (mm)
  CallRules(const AttnInputs& in, const AttnOptions& opt)
      : vz(visibility(opt)),
        scored(vz.softcap || vz.alibi),
        scale(in.softmax_scale()),
        cl(scale * kLog2e),
        dropout(opt.dropout_p > 0.0f),
        thr(dropout_threshold(opt.dropout_p)),
        inv_keep(1.0f / (1.0f - opt.dropout_p)),
        bd(dot_for(in.dtype(), inv_keep)) {}
};

// ---- forward -----------------------------------------------------------------------------
struct FwdScratch {
  fvec q, o, s, m, l;      // s: S rows [FSB][FBK] ([GH][..] grouped; tiles: [2][32][FBK_TILES], by parity)
  u16vec q16, p16;         // bf16_tiles: Q rows [GH * BQ][dp rounded to 32], P rows [2][32][FBK_TILES]
  uvec pv_tails;           // bf16_tiles: a P V job's staged last step, [dvp / 16][16 x 16] (TileJob::tails)
  std::vector<char> seen;  // [GH * BQ]: whether the row saw a key in this call
};

void forward_impl(const AttnFwdParams& p) {
  const AttnInputs& in = p.in;
  const AttnOptions& opt = in.options;
  const WorkList& w = *in.work;
  const DType dtype = in.dtype();
  const int hq = in.q.heads, group = in.q.heads / in.k.heads;
  const int head_dim_qk = in.q.dim, head_dim_v = in.v.dim;
  const void* const q_data = in.q.data;
  const int64_t q_rs = in.q.row_step(), q_hs = in.q.head_step();
  void* const out_data = p.out.data;
  const int64_t out_rs = p.out.row_step(), out_hs = p.out.head_step();
  float* const lse = p.lse;  // optional, but for OutMode::accumulate
  // OutMode::accumulate: fp32 out and lse are the running result the online softmax resumes.
  const bool resume = p.out_mode == OutMode::accumulate;
  const DType out_dtype = p.out.dtype;
  const CallRules cr(in, opt);

  Packed pk;
  // bf16 tiles (the amx path) take their B operands in the pairs of the bf16 dot products
  // (the VNNI layout), Q and P rounded to bf16 rows once: per unit, per sub-block and piece.
  const bool t16 = cr.bd == Dot::bf16_tiles;
  const NamedRows named(w, in.k.rows);
  if (t16)
    pack_kv_tiles(in, false, pk, named);
  else
    pack_kv(in, false, cr.bd == Dot::bf16_pairs, pk, named);
  // Every caller's share packed (KvPackLayout fp32 or bf16_tiles); alone, a barrier the callers keep alike.
  if (in.kv_pack_share) in.kv_pack_share->sync();
  const int dp = pk.dp, dvp = pk.dvp;
  const int dq32 = (dp + 31) / 32 * 32;
  // Sub-block rows: FSB for the vector products, two 16-row tiles for the tiles.
  const int fsb = t16 ? 32 : FSB;
  const int fbk = t16 ? FBK_TILES : FBK;  // keys per piece

  struct Unit {
    int64_t task, qb;
  };
  std::vector<Unit> blocks;
  for (size_t t = 0; t < w.tasks.size(); ++t)
    for (int64_t qb = 0; qb * BQ < w.tasks[t].q_len; ++qb) blocks.push_back({static_cast<int64_t>(t), qb});

  // A unit is (task, block of BQ query rows, kv head, set of up to GH of that kv head's
  // query heads) and runs its heads piece by piece, so that each K^T/V piece comes from L3
  // once per set and serves the set's heads from L2 (their Q and O blocks and the piece fit).
  const int hkn = in.k.heads;
  const int sets = (group + GH - 1) / GH;
  const int64_t units = static_cast<int64_t>(blocks.size()) * hkn * sets;
  const int nthr = threads_started(units, opt.num_threads);
  std::vector<FwdScratch> scr(nthr);
  const size_t gh = static_cast<size_t>(std::min(group, GH));
  // fp32 products on AVX-512 run a set's heads' sub-blocks of the same rows as one product
  // (gemm_groups, below).
  const bool grouping = !t16 && W == 16 && cr.bd == Dot::fma;
  for (auto& s : scr) {
    s.q.resize(gh * BQ * dp);
    s.o.resize(gh * BQ * dvp);
    s.s.resize((t16 ? 2 : grouping ? gh : 1) * fsb * fbk);  // (s_buf)
    if (t16) {
      s.q16.resize(gh * BQ * dq32);
      s.p16.resize(static_cast<size_t>(2) * fsb * fbk);
      s.pv_tails.resize(static_cast<size_t>(dvp / 16) * 256);
    }
    s.m.resize(gh * BQ);
    s.l.resize(gh * BQ);
    s.seen.resize(gh * BQ);
  }

  // Handed out as threads come free: a unit's results are its own rows and heads of out and lse,
  // and no row it stores depends on scratch it did not set (q, o, m, l, seen are set at its
  // start; on tiles the rows past its last are computed from an earlier unit's and never
  // stored), so any thread may run any unit. With the static i % threads split, one of two
  // threads often ran its half 10-20% slower than the other and left it idle at the end (Zen 2,
  // 8192 tokens, GQA: 1.63-1.67x one thread's forward static, 2.01-2.03x dynamic;
  // docs/benchmarks.md).
  Progress progress(in.progress);  // (called by thread 0 alone)
  parallel_for_dynamic(units, nthr, [&](int64_t u, int th) {
    const TileScope tiles;
    FwdScratch& S = scr[th];
    const Unit un = blocks[u / (hkn * sets)];
    const int hk = static_cast<int>(u % (hkn * sets)) / sets;
    const int h0 = hk * group + static_cast<int>(u % sets) * GH;  // the set's first query head
    const int nh = std::min(GH, hk * group + group - h0);         // and its head count
    const AttnTask& t = w.tasks[un.task];
    const int64_t row0 = t.q_row + un.qb * BQ, qp0 = t.q_pos + un.qb * BQ;
    const int m = static_cast<int>(std::min<int64_t>(BQ, t.q_len - un.qb * BQ));
    for (int g = 0; g < nh; ++g) {
      const int h = h0 + g;
      for (int r = 0; r < m; ++r) {
        if (r + kRowsAhead < m) prefetch_row(q_data, dtype, (row0 + r + kRowsAhead) * q_rs + h * q_hs, head_dim_qk);
        ld_row(q_data, dtype, (row0 + r) * q_rs + h * q_hs, head_dim_qk, dp,
               S.q.data() + (g * BQ + r) * dp);
        if (t16) round_row_bf16(S.q.data() + (g * BQ + r) * dp, dp, dq32, S.q16.data() + (g * BQ + r) * dq32);
      }
      std::fill_n(S.o.data() + g * BQ * dvp, m * dvp, 0.0f);
    }
    std::fill(S.m.begin(), S.m.end(), kNegInf);
    std::fill(S.l.begin(), S.l.end(), 0.0f);
    std::fill(S.seen.begin(), S.seen.end(), char{0});
    if (resume) {
      // The earlier result (out, lse) as the state (o, m, l) with o / l = out and
      // m + log2(l) = lse / ln 2: m = lse * log2(e), l = 1 (lse -inf: nothing yet, l = 0).
      for (int g = 0; g < nh; ++g)
        for (int r = 0; r < m; ++r) {
          if (r + kRowsAhead < m)
            prefetch_row(out_data, DType::f32, (row0 + r + kRowsAhead) * out_rs + (h0 + g) * out_hs, head_dim_v);
          const float prev = lse[(row0 + r) * hq + h0 + g];
          if (prev == kNegInf) continue;
          ld_row(out_data, DType::f32, (row0 + r) * out_rs + (h0 + g) * out_hs, head_dim_v, dvp,
                 S.o.data() + (g * BQ + r) * dvp);
          S.m[g * BQ + r] = prev * kLog2e;
          S.l[g * BQ + r] = 1.0f;
        }
    }

    const int64_t qp_last = qp0 + m - 1;
    // The right limit (causal or window) of query position qp trims a piece's computed
    // columns to those some row up to qp can see: [a0, a1) -> [a0, trimmed_end).
    auto trimmed_end = [&](const Piece& pc, int64_t qp) {
      if (!cr.vz.hi_bounded) return pc.a1;
      return static_cast<int>(std::min<int64_t>(pc.a1, (pc.c0 + (qp + cr.vz.hi - pc.p_lo) + PAD) / PAD * PAD));
    };
    auto run_piece = [&](Piece pc) {
      progress(th);
      // Columns past the last row's right limit (causal or window) are masked for every row:
      // not computed.
      pc.a1 = trimmed_end(pc, qp_last);
      // The unit's rows run in sub-blocks of FSB rows (32 on tiles) per head of the set: S = Q
      // Kt, the softmax and O += P V of a sub-block touch its Q, S and O rows only, which stay
      // in L1 on the vector paths unless grouped (blocking.hpp; on tiles two sub-blocks' S and
      // P, 96 KiB, are live at once, from L2). The piece's sub-blocks that some row of theirs
      // sees, in order (at least one: for_each_piece passes only pieces the unit's last row
      // sees):
      struct Sub {
        int g, r0, sb;
        Piece ps;  // the piece as this sub-block computes it
        bool any;  // whether a row saw a key (else P V is skipped)
      };
      static_assert(FSB >= 16);  // fsb >= 16: at most BQ / 16 + 1 sub-blocks per head
      std::array<Sub, GH * ((BQ + 15) / 16)> subs;
      int ns = 0;
      for (int g = 0; g < nh; ++g)
        for (int r0 = 0; r0 < m; r0 += fsb) {
          const int sb = std::min(fsb, m - r0);
          Piece ps = pc;
          ps.a1 = trimmed_end(pc, qp0 + r0 + sb - 1);
          if (ps.a1 > ps.a0) subs[ns++] = {g, r0, sb, ps, false};
        }
      if (ns == 0) return;
      // On tiles sub-block i has S and P rows of its own, buffer i % 2: the tiles fill the next
      // sub-block's S and multiply the last one's P while this one's softmax runs (below).
      // Grouped, each head of the set has S rows of its own (its sub-blocks run together, below);
      // otherwise the sub-blocks take the one buffer in turn, which stays in L1.
      auto s_buf = [&](int i) { return S.s.data() + (t16 ? i % 2 : grouping ? subs[i].g : 0) * fsb * fbk; };
      auto p_buf = [&](int i) { return S.p16.data() + (i % 2) * fsb * fbk; };
      // S[sb, a0:a1) = Q[sb, dp] Kt[dp, a0:a1). On tiles, when `job` is given and the product
      // has no edge a TileJob does not take (k = dp a multiple of 32), it is set up in *job to
      // run step by step; otherwise it runs now (and *job stays done). A job's C rows past sb,
      // up to 16 or 32, are computed too: S and P have 32 rows per sub-block, O and Q BQ per
      // head (a multiple of 32; fsb = 32 on tiles, so r0 is 0 or 32 and r0 + 32 <= BQ), and
      // those rows are past the unit's last (r0 + sb = m when sb < 32), read by no row of it.
      static_assert(PAD == 16 && BQ % 32 == 0);  // the jobs take key counts and head dims in whole 16-column tiles
      // `heads` > 1 (grouping only): sub-block i (head 0's) and the same rows of the set's next
      // heads - 1 heads as one product (gemm_groups; their S buffers fsb * fbk floats apart, Q
      // and O blocks BQ rows); on tiles `heads` is 1.
      auto scores = [&](int i, TileJob* job, int heads) {
        assert(heads == 1 || (grouping && subs[i].g == 0));  // one S buffer per head only when grouping
        const Sub& x = subs[i];
        const int n = x.ps.a1 - x.ps.a0;
        const int64_t k0 = x.ps.b * fbk + x.ps.a0;  // first physical key row computed
        if (t16) {
          const uint16_t* a = S.q16.data() + (x.g * BQ + x.r0) * dq32;
          if (job && dp % 32 == 0) {  // (n is a multiple of PAD = 16)
            *job = TileJob{.a = a, .a_stride = dq32 * 2, .b = pk.Kt2(hk, k0), .b_ld = PAD, .b_panel = dp * PAD / 2,
                           .c = s_buf(i) + x.ps.a0, .ldc = fbk, .n = n, .k = dp, .zero = true, .two_m = x.sb > 16};
            return;
          }
          gemm_tiles16<true>(false, x.sb, n, dp, a, dq32, pk.Kt2(hk, k0), PAD, dp * PAD / 2, s_buf(i) + x.ps.a0, fbk);
        } else {
          const float* kt = pk.Kt(hk, 0) + (k0 / PAD) * dp * PAD;
          const float* q = S.q.data() + (x.g * BQ + x.r0) * dp;
          if (heads > 1)
            gemm_groups<true>(heads, int64_t{BQ} * dp, int64_t{fsb} * fbk, x.sb, n, dp, q, dp, 1, kt, PAD, dp * PAD,
                              s_buf(i) + x.ps.a0, fbk);
          else
            mm<true>(cr.bd, x.sb, n, dp, q, dp, 1, kt, PAD, dp * PAD, s_buf(i) + x.ps.a0, fbk, pk.paired(kt), BF16_NV);
        }
      };
      // O[sb, dvp] += P[sb, a0:a1) V[a0:a1, dvp] (P rows of unseen rows are 0); `job` as above.
      auto pv = [&](int i, TileJob* job, int heads) {
        assert(heads == 1 || (grouping && subs[i].g == 0));
        const Sub& x = subs[i];
        if (!x.any) return;
        const int n = x.ps.a1 - x.ps.a0;
        const int64_t k0 = x.ps.b * fbk + x.ps.a0;
        float* o_g = S.o.data() + (x.g * BQ + x.r0) * dvp;
        if (t16) {
          if (cr.dropout)  // P is rounded after the dropout's scaling
            for (int r = 0; r < x.sb; ++r)
              round_row_bf16(s_buf(i) + r * fbk + x.ps.a0, n, (n + 31) / 32 * 32, p_buf(i) + r * fbk);
          if (job) {  // (dvp is a multiple of PAD = 16; P's columns [n, n rounded to 32) are zero)
            const uint32_t* vb = pk.Vr2(hk, k0);
            const bool tail = n % 32 != 0;
            if (tail) TileJob::stage_tails(vb, PAD, pk.vr_ps() / 2, dvp, n, S.pv_tails.data());
            *job = TileJob{.a = p_buf(i), .a_stride = fbk * 2, .b = vb, .b_ld = PAD, .b_panel = pk.vr_ps() / 2,
                           .c = o_g, .ldc = dvp, .n = dvp, .k = n, .zero = false, .two_m = x.sb > 16,
                           .tails = tail ? S.pv_tails.data() : nullptr};
            return;
          }
          gemm_tiles16<false>(false, x.sb, dvp, n, p_buf(i), fbk, pk.Vr2(hk, k0), PAD, pk.vr_ps() / 2, o_g, dvp);
        } else {
          const float* v = pk.Vr(hk) + k0 * PAD;
          if (heads > 1)
            gemm_groups<false>(heads, int64_t{fsb} * fbk, int64_t{BQ} * dvp, x.sb, dvp, n, s_buf(i) + x.ps.a0, fbk, 1,
                               v, PAD, pk.vr_ps(), o_g, dvp);
          else
            mm<false>(cr.bd, x.sb, dvp, n, s_buf(i) + x.ps.a0, fbk, 1, v, PAD, pk.vr_ps(), o_g, dvp, pk.paired(v),
                      BF16_NV);
        }
      };
      // The softmax of sub-block i's rows; between() runs before each row and before its exp pass.
      auto softmax = [&](int i, auto&& between) {
        Sub& x = subs[i];
        const Piece& ps = x.ps;
        const int g = x.g, r0 = x.r0, sb = x.sb, h = h0 + g;
        const int n = ps.a1 - ps.a0;
        const bool full = ps.a0 == ps.c0 && ps.a1 == ps.c1;
        float* o_g = S.o.data() + (g * BQ + r0) * dvp;
        float* m_g = S.m.data() + g * BQ + r0;
        float* l_g = S.l.data() + g * BQ + r0;
        char* seen = S.seen.data() + g * BQ + r0;
        // With bf16 tiles and no dropout (which scales e in fp32 first), the exp pass writes
        // P in bf16 itself.
        const bool p_fused = t16 && !cr.dropout;
        const int n32 = (n + 31) / 32 * 32;
        for (int r = 0; r < sb; ++r) {
          between();
          float* s = s_buf(i) + r * fbk;
          const int64_t qp = qp0 + r0 + r;
          const int ve = visible_end(ps, cr.vz, qp);
          const int vb = visible_begin(ps, cr.vz, qp);
          if (ve <= vb) {  // nothing visible in this piece for this row
            if (p_fused) std::fill_n(p_buf(i) + r * fbk, n32, uint16_t{0});
            else
              for (int c = ps.a0; c < ps.a1; ++c) s[c] = 0.0f;
            continue;
          }
          seen[r] = 1;
          x.any = true;
          // Scores to the log2 domain: x = s * cl. A row that sees every column of the piece
          // (the common case) fuses the scale into the max and the exp (exp2(s * cl - m));
          // a partly masked row is scaled and masked in place first (cl may be negative, so
          // -inf must be written after the scale). Soft cap / ALiBi: per element, scalar.
          vf mx = vset(kNegInf);
          float mul = 1.0f;
          if (cr.scored) {
            const float slope = cr.vz.alibi ? opt.alibi_slopes[h] : 0.0f;
            float dcap;
            for (int c = ps.a0; c < ps.a1; ++c)
              s[c] = c >= vb && c < ve
                         ? transform_score(s[c] * cr.scale, opt.softcap, slope, qp,
                                           ps.p_lo + (c - ps.c0), dcap) * kLog2e
                         : kNegInf;
            mx = row_max(s, ps.a0, ps.a1, vset(1.0f));
          } else if (full && vb == ps.c0 && ve == ps.c1) {
            mul = cr.cl;
            const vf cv = vset(cr.cl);
            if (cr.cl > 0.0f) {  // max(s * cl) = max(s) * cl exactly: rounding is monotonic
              mx = row_max(s, ps.a0, ps.a1, vset(1.0f)) * cv;
            } else {
              mx = row_max(s, ps.a0, ps.a1, cv);
            }
          } else {
            for (int c = ps.a0; c < ps.a1; c += W) vstore(s + c, vload(s + c) * vset(cr.cl));
            for (int c = ps.a0; c < vb; ++c) s[c] = kNegInf;
            for (int c = ve; c < ps.a1; ++c) s[c] = kNegInf;
            mx = row_max(s, ps.a0, ps.a1, vset(1.0f));
          }
          between();
          const float m_old = m_g[r];
          const float m_new = std::fmax(m_old, hmax(mx));
          // alpha = 2^(m_old - m_new): 1 when the max did not move (exact), and O is then
          // not rescaled
          const float alpha = m_old == m_new ? 1.0f : m_old == kNegInf ? 0.0f : std::exp2(m_old - m_new);
          vf sum = vf{};
          const vf mv = vset(m_new), mulv = vset(mul);
          if (p_fused)
            sum = exp_row_bf16(s, ps.a0, ps.a1, mulv, mv, n32, p_buf(i) + r * fbk);
          else
            for (int c = ps.a0; c < ps.a1; c += W) {
              const vf e = vexp2_softmax(vload(s + c) * mulv - mv);
              sum += e;
              vstore(s + c, e);
            }
          l_g[r] = l_g[r] * alpha + hsum(sum);
          m_g[r] = m_new;
          if (alpha != 1.0f) {
            float* o = o_g + r * dvp;
            for (int d = 0; d < dvp; d += W) vstore(o + d, vload(o + d) * vset(alpha));
          }
          if (cr.dropout) {
            const uint64_t key = dropout_row_key(opt.seed, h + opt.dropout_head_offset, t.doc, qp);
            for (int c = vb; c < ve; ++c)
              s[c] = dropout_keep_row(key, ps.p_lo + (c - ps.c0), cr.thr) ? s[c] * cr.inv_keep : 0.0f;
          }
        }
      };
      if (!t16) {
        // Grouping (fp32 products on AVX-512, measured on the Intel Xeon with AMX; Zen 4 not
        // measured): the set's heads share the piece's K^T and V, so the same rows of every head
        // run as one product (gemm_groups: a B column tile stays in L1 while all the heads' A and
        // C rows stream), then their softmax, then one P V. Which sub-blocks are kept depends on
        // their rows alone, so every head has the same ns / nh of them, sub-block k of head g at
        // subs[g * nk + k] with the same piece; whether a row saw a key does not depend on the
        // head either (x.any). Elsewhere (AVX2's 16-column tiles would stream the heads' rows
        // from L2 once per 16 columns; the bf16 and fp16 products convert their A operands per
        // call) each sub-block in turn.
        if (grouping && nh > 1) {
          const int nk = ns / nh;
          for (int k = 0; k < nk; ++k) {  // subs[k]: head 0's (g = 0), the first of the product
            scores(k, nullptr, nh);
            for (int g = 0; g < nh; ++g) softmax(g * nk + k, [] {});
            pv(k, nullptr, nh);
          }
        } else {
          for (int i = 0; i < ns; ++i) {
            scores(i, nullptr, 1);
            softmax(i, [] {});
            pv(i, nullptr, 1);
          }
        }
        return;
      }
      // On tiles the products of the neighbours run between the softmax's rows: sub-block i's
      // softmax runs beside the tiles of S for i + 1 and of O += P V for i - 1, a few steps per
      // row (TileJob), so that the AMX unit and the vector units work at once. Each sub-block's
      // products and softmax are the same operations on the same operands as in turn, so the
      // results are bitwise the same; a product with edges a job does not take runs in one go
      // before the softmax, while no job holds the tiles.
      TileJob next_s, last_pv;
      scores(0, nullptr, 1);
      for (int i = 0; i < ns; ++i) {
        next_s = TileJob{};
        last_pv = TileJob{};
        if (i > 0) pv(i - 1, &last_pv, 1);  // first: with dropout it rounds P from S's buffer (i - 1) % 2,
        if (i + 1 < ns) scores(i + 1, &next_s, 1);  // which this fills (now, or in steps)
        // The steps, spread evenly over the softmax's two calls per row (before the row max
        // and before the exp pass): finer than one burst per row, which ran 5% slower.
        const int steps = next_s.steps_left() + last_pv.steps_left();
        const int points = 2 * subs[i].sb;
        int credit = 0;  // steps * calls - points * steps issued (no division per call)
        softmax(i, [&] {
          for (credit += steps; credit >= points; credit -= points) {
            if (!next_s.done()) next_s.step();
            else last_pv.step();
          }
        });
        next_s.finish();
        last_pv.finish();
      }
      pv(ns - 1, nullptr, 1);
    };
    if (t16)
      for_each_piece<FBK_TILES>(w, t, cr.vz, qp0, qp_last, run_piece);
    else
      for_each_piece<FBK>(w, t, cr.vz, qp0, qp_last, run_piece);

    for (int g = 0; g < nh; ++g) {
      const int h = h0 + g;
      for (int r = 0; r < m; ++r) {
        // Accumulate mode: a row that saw no key of this call keeps out and lse as they were
        // (written back through the state, lse would come back as (lse log2 e) ln 2, not
        // always lse's bits).
        if (resume && !S.seen[g * BQ + r]) continue;
        const float l = S.l[g * BQ + r];
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        st_row(out_data, out_dtype, (row0 + r) * out_rs + h * out_hs, head_dim_v,
               S.o.data() + (g * BQ + r) * dvp, inv);
        if (lse) lse[(row0 + r) * hq + h] = l > 0.0f ? S.m[g * BQ + r] * kLn2 + std::log(l) : kNegInf;
      }
    }
  });
}

// ---- backward ----------------------------------------------------------------------------
// One query head's rows of the task being run (a set's heads run side by side, so that their
// dK/dV pieces add into one tile: BwdScratch::heads).
struct BwdHead {
  fvec q, dout, dq, lse2, delta;  // per task rows, row-major (tiles: q and dout one row, rounded to q16, do16)
  fvec q_pan, dout_pan;           // q, dout in panels [d/PAD][max_q][PAD] (not with tiles)
  // bf16 tiles (the amx path): Q and dO rows in bf16 [mq32][dq32], [mq32][dv32] (the A of S and
  // dP) and transposed per step of BQB_TILES query rows, [mq128 / BQB_TILES][dp][BQB_TILES] and
  // [.][dvp][.] (the A of dK^T and dV^T: a tile's rows 256 bytes apart; with [dp][mq32] they
  // were mq32 * 2 bytes apart, 16 KiB at 8192 rows, all in one L1 set, and the backward ran
  // 7-10% slower). mq32, mq128: max_q rounded up to 32, to BQB_TILES.
  u16vec q16, do16, qt16, dot16;
  BwdHead(int64_t max_q, int dqk, int dvp, bool tiles) {
    const size_t mq = static_cast<size_t>(max_q), rows = tiles ? 1 : mq;
    q.resize(rows * dqk);
    dq.resize(mq * dqk);
    dout.resize(rows * dvp);
    if (!tiles) {
      q_pan.resize(mq * dqk);
      dout_pan.resize(mq * dvp);
    } else {
      const size_t m32 = static_cast<size_t>((max_q + 31) / 32 * 32), dq32 = (dqk + 31) / 32 * 32,
                   dv32 = (dvp + 31) / 32 * 32;
      q16.resize(m32 * dq32);
      do16.resize(m32 * dv32);
      const size_t m128 = static_cast<size_t>((max_q + BQB_TILES - 1) / BQB_TILES * BQB_TILES);
      qt16.resize(static_cast<size_t>(dqk) * m128);
      dot16.resize(static_cast<size_t>(dvp) * m128);
    }
    for (fvec* b : {&lse2, &delta}) b->resize(mq);
  }
  size_t floats() const {  // in 4-byte units
    size_t n = 0;
    for (const fvec* b : {&q, &dout, &dq, &lse2, &delta, &q_pan, &dout_pan}) n += b->size();
    for (const u16vec* b : {&q16, &do16, &qt16, &dot16}) n += (b->size() + 1) / 2;
    return n;
  }
};

struct BwdScratch {
  std::vector<BwdHead> heads;     // a set's heads, in head order
  fvec s, pd, dp;                 // [bqb][BBK] (bqb: BQB, or BQB_TILES with tiles)
  fvec dk, dv;                    // piece tiles [BBK][dp], [BBK][dvp] (tiles: [dp][BBK], [dvp][BBK])
  fvec orow;                      // an out row [dvp]
  // bf16 tiles (the amx path): a step's P and dS in pairs of query rows [bqb / 2][BBK] (the B
  // of dV^T and dK^T) and dS rows in bf16 [bqb][BBK] (the A of dQ).
  u16vec ds16;
  uvec pv2, ds2;
  // Sizes every buffer for `per` heads, tasks of at most max_q rows and padded head dims dqk, dvp.
  BwdScratch(int per, int64_t max_q, int dqk, int dvp, bool tiles) {
    const size_t kq = static_cast<size_t>(tiles ? BQB_TILES : BQB) * BBK;
    heads.reserve(static_cast<size_t>(per));
    for (int j = 0; j < per; ++j) heads.emplace_back(max_q, dqk, dvp, tiles);
    if (tiles) {
      ds16.resize(kq);
      pv2.resize(kq / 2);
      ds2.resize(kq / 2);
    }
    for (fvec* b : {&s, &pd, &dp}) b->resize(kq);
    dk.resize(size_t{BBK} * dqk);
    dv.resize(size_t{BBK} * dvp);
    orow.resize(dvp);
  }
  size_t floats() const {  // in 4-byte units
    size_t n = pv2.size() + ds2.size() + (ds16.size() + 1) / 2;
    for (const fvec* b : {&s, &pd, &dp, &dk, &dv, &orow}) n += b->size();
    for (const BwdHead& h : heads) n += h.floats();
    return n;
  }
};


// The sums over a KV head's head sets of its dK or dV (the per-set buffers of a backward),
// in set order: the one code of backward_impl's final sum and of attention_grad_share_rows, so
// that a KvGradShare's reader writes bitwise what the kernel writes itself.
//
// Transposed blocks (bf16 tiles: [dpad][BBK] floats a set's block of BBK key rows), 16 rows
// from column c16: rows16[j][d] = (set 0's element (d, c16 + j) + set 1's + ...) + 0.0f over
// the nr blocks in set order, d < dpad (a multiple of 16); zeros when nr == 0. The + 0.0f: the
// sum was 0 + s_0 + s_1 + ..., and a set's own -0.0 (a tile product that flushed to a zero of
// its sign) came out +0.0; (s_0 + s_1 + ...) + 0.0f is that sum bitwise (x + y is -0.0 only
// when both are). 16 x 16 transposes on the AVX-512 paths, aligned stores: rows16 is 64-byte
// aligned.
inline void sum_sets_rows16(const float* const* blocks, int nr, int dpad, int c16, float (&rows16)[16][256]) {
  static_assert(PAD == 16);
  if (nr == 0) {
    for (int j = 0; j < 16; ++j) std::fill_n(rows16[j], dpad, 0.0f);
    return;
  }
  for (int d0 = 0; d0 < dpad; d0 += 16) {
#if CPATTN_VW == 16
    __m512i x[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t at = int64_t{d0 + i} * BBK + c16;
      __m512 sum = _mm512_loadu_ps(blocks[0] + at);
      for (int k = 1; k < nr; ++k) sum = _mm512_add_ps(sum, _mm512_loadu_ps(blocks[k] + at));
      for (int k = 0; k < nr; ++k) __builtin_prefetch(blocks[k] + at + 16);  // the next 16 rows' line
      x[i] = _mm512_castps_si512(_mm512_add_ps(sum, _mm512_setzero_ps()));
    }
    transpose16x16_epi32(x);
    for (int j = 0; j < 16; ++j) _mm512_store_ps(rows16[j] + d0, _mm512_castsi512_ps(x[j]));
#else
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) {
        const int64_t at = int64_t{d0 + i} * BBK + c16 + j;
        float sum = blocks[0][at];
        for (int k = 1; k < nr; ++k) sum += blocks[k][at];
        rows16[j][d0 + i] = sum + 0.0f;
      }
#endif
  }
}
// The head sets of KV head hk that reached key block b, in set order (touched: a flag per (unit
// hk * sets + st, block)): out[i] = at(unit) for each; returns how many (none: the sums are zeros).
template <class At>
int reached_sets(const char* touched, int hk, int sets, int64_t nbb, int64_t b, const float** out, At at) {
  int nr = 0;
  for (int st = 0; st < sets; ++st) {
    const int64_t u = int64_t{hk} * sets + st;
    if (touched[u * nbb + b]) out[nr++] = at(u);
  }
  return nr;
}
// Rows (the other paths: a set's key row of n floats): acc[d] = 0 + set 0's + set 1's + ...
// over the nr rows in set order, d < n.
inline void sum_sets_row(const float* const* rows, int nr, int n, float* acc) {
  std::fill_n(acc, n, 0.0f);
  for (int k = 0; k < nr; ++k)
    for (int d = 0; d < n; ++d) acc[d] += rows[k][d];
}

void backward_impl(const AttnBwdParams& p) {
  const AttnInputs& in = p.in;
  const AttnOptions& opt = in.options;
  const WorkList& w = *in.work;
  const DType dtype = in.dtype();
  const int hq = in.q.heads, hkn = in.k.heads, group = hq / hkn;
  const int head_dim_qk = in.q.dim, head_dim_v = in.v.dim;
  const int64_t total_k = in.k.rows;
  const void* const q_data = in.q.data;
  const int64_t q_rs = in.q.row_step(), q_hs = in.q.head_step();
  const void* const out_data = p.out.data;
  const int64_t out_rs = p.out.row_step(), out_hs = p.out.head_step();
  const void* const dout_data = p.dout.data;
  const int64_t dout_rs = p.dout.row_step(), dout_hs = p.dout.head_step();
  void* const dq_data = p.dq.data;
  const int64_t dq_rs = p.dq.row_step(), dq_hs = p.dq.head_step();
  void* const dk_data = p.dk.data;
  const int64_t dk_rs = p.dk.row_step(), dk_hs = p.dk.head_step();
  void* const dv_data = p.dv.data;
  const int64_t dv_rs = p.dv.row_step(), dv_hs = p.dv.head_step();
  const float* const lse = p.lse;
  const CallRules cr(in, opt);

  Packed pk;
  // bf16 tiles (the amx path): K/V's B operands in pairs, as the bf16 dot products take them;
  // Q, dO and their transposes in bf16 once per task; P and dS paired and rounded per step.
  const bool t16 = cr.bd == Dot::bf16_tiles;
  const NamedRows named(w, total_k);
  if (t16)
    pack_kv_tiles(in, true, pk, named);
  else
    pack_kv(in, true, cr.bd == Dot::bf16_pairs, pk, named);
  if (in.kv_pack_share) in.kv_pack_share->sync();
  const int dp = pk.dp, dvp = pk.dvp;
  const int dq32 = (dp + 31) / 32 * 32, dv32 = (dvp + 31) / 32 * 32;
  const int bqb = t16 ? BQB_TILES : BQB;  // query rows per step

  int64_t max_q = p.longest_task;  // (0, or the longest of the calls this call's tasks are split over)
  for (const AttnTask& t : w.tasks) max_q = std::max(max_q, t.q_len);
  // A unit is (kv head, set of `per` consecutive query heads of its group): dK, dV of the
  // set's heads accumulate, one tile per piece for all of them, in the set's buffers
  // [total_k][dp], [total_k][dvp] (fp32, unscaled dK), summed over the sets in order at the end
  // (bwd_set_heads).
  const int per = bwd_set_heads(hq, hkn, max_q, t16), sets = bwd_sets(hq, hkn, max_q, t16);
  const int64_t units = int64_t{hkn} * sets;
  // bf16 tiles keep them transposed per block of BBK key rows, [nbb][dp][BBK] and [nbb][dvp][BBK],
  // the layout of the pieces' dK^T, dV^T tiles, so that a piece is added in vectors.
  const int64_t nbb = (total_k + BBK - 1) / BBK;
  const int64_t g_rows = t16 ? nbb * BBK : total_k;  // rows of one unit's buffers
  // A unit's block of BBK key rows is written by the first piece that reaches it, in one pass
  // (the piece's keys copied, the block's others zeroed), and added to by the later ones;
  // `touched` says which blocks have been, and the final sum reads those alone: no pass
  // zeroes the buffers.
  // With a KvGradShare they are its buffer's (GradShareLayout), left there for
  // attention_grad_share_rows to sum: this call has no final sum.
  const KvGradShare* const share = p.grad_share;
  RawFloats gk_own(share ? 0 : static_cast<size_t>(units) * g_rows * dp);
  RawFloats gv_own(share ? 0 : static_cast<size_t>(units) * g_rows * dvp);
  std::vector<char> touched_own(share ? 0 : static_cast<size_t>(units * nbb), 0);
  float* gk = gk_own.data();
  float* gv = gv_own.data();
  char* touched = touched_own.data();
  if (share) {
    const GradShareLayout L = grad_share_layout(total_k, hq, hkn, head_dim_qk, head_dim_v, max_q, t16, cr.scale);
    std::memcpy(share->buffer, &L, sizeof L);
    gk = reinterpret_cast<float*>(share->buffer + GradShareLayout::kHeader);
    gv = reinterpret_cast<float*>(share->buffer + L.gv_offset());
    touched = reinterpret_cast<char*>(share->buffer + L.touched_offset());
    std::memset(touched, 0, static_cast<size_t>(units * nbb));
  }

  const int nthr = threads_started(units, opt.num_threads);
  std::vector<BwdScratch> scr;  // made in place: a copied template would be one more thread's worth
  scr.reserve(static_cast<size_t>(nthr));
  for (int i = 0; i < nthr; ++i) scr.emplace_back(per, max_q, dp, dvp, t16);
  {  // what was allocated stays within attention_backward_scratch_bytes (blocking.hpp)
    size_t used = pk.kt.owned() + pk.kr.owned() + pk.vr.owned() + pk.vt.owned() + gk_own.size() + gv_own.size() +
                  pk.kt2.owned() + pk.kr2.owned() + pk.vr2.owned() + pk.vt2.owned();  // (not a KvPackShare's)
    for (const BwdScratch& s : scr) used += s.floats();
    // + the final sum's, per thread of its own loop: the sets' pointers (2 x sets, two floats
    // each) and, on rows, the sums of a key row (ak, av; the tiles' leave through 16 rows on
    // the stack)
    const int fin_thr = threads_started(bwd_final_items(total_k, t16), opt.num_threads);
    used += static_cast<size_t>(fin_thr) * (4 * static_cast<size_t>(sets) + (t16 ? 0 : dp + dvp));
    BwdScratchFloats bound =
        backward_scratch_floats(total_k, hq, hkn, head_dim_qk, head_dim_v, max_q, cr.bd == Dot::bf16_pairs, t16);
    if (share) bound.per_set_grads = 0;  // (the share's buffer holds them: attention_backward_scratch_bytes)
    check_scratch_bound(used, bound.total(nthr, fin_thr));
  }

  // The query heads [h0, h1) of a set of unit u (one kv head's): its tasks in order, the pieces
  // of each in key order, and for each piece the set's heads in order, their dK/dV adding into
  // one tile (a piece's tile is written out once per set, not once per head).
  Progress progress(in.progress);  // (called by thread 0 alone)
  auto run_set = [&](BwdScratch& S, int th, int h0, int h1, float* gku, float* gvu, char* tu) {
    const int hk = h0 / group;
    for (const AttnTask& t : w.tasks) {
      const int64_t nq = t.q_len;
      float* const orow = S.orow.data();
      for (int h = h0; h < h1; ++h) {  // the heads' rows, in bf16 and transposed with tiles
        BwdHead& H = S.heads[static_cast<size_t>(h - h0)];
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t row = t.q_row + i;
          if (i + kRowsAhead < nq) {
            const int64_t ahead = row + kRowsAhead;
            prefetch_row(q_data, dtype, ahead * q_rs + h * q_hs, head_dim_qk);
            prefetch_row(dout_data, dtype, ahead * dout_rs + h * dout_hs, head_dim_v);
            prefetch_row(out_data, dtype, ahead * out_rs + h * out_hs, head_dim_v);
          }
          float* const qr = H.q.data() + (t16 ? 0 : i * dp);  // tiles: one row, rounded below
          ld_row(q_data, dtype, row * q_rs + h * q_hs, head_dim_qk, dp, qr);
          float* dor = H.dout.data() + (t16 ? 0 : i * dvp);
          ld_row(dout_data, dtype, row * dout_rs + h * dout_hs, head_dim_v, dvp, dor);
          ld_row(out_data, dtype, row * out_rs + h * out_hs, head_dim_v, dvp, orow);
          if (t16) {
            uint16_t* q16 = H.q16.data() + i * dq32;
            uint16_t* do16 = H.do16.data() + i * dv32;
            round_row_bf16(qr, dp, dq32, q16);
            round_row_bf16(dor, dvp, dv32, do16);
          } else {
            for (int d = 0; d < dp; d += PAD)  // a panel row is PAD consecutive floats
              std::memcpy(H.q_pan.data() + ((d / PAD) * max_q + i) * PAD, qr + d, PAD * sizeof(float));
            for (int d = 0; d < dvp; d += PAD)
              std::memcpy(H.dout_pan.data() + ((d / PAD) * max_q + i) * PAD, dor + d, PAD * sizeof(float));
          }
          float delta = 0.0f;  // dout_i . out_i
          if (cr.bd == Dot::bf16_pairs) {  // in the order of the bf16 dot products (odd, then even element of each pair)
            // that give dP, so that dP - delta is exactly 0 where it is in exact arithmetic
            // (a query that sees one key: out = v, dP = dout . v)
            // (std::fma, not `delta += a * b` twice per pair: GCC 12.2 at -O3 vectorizes that
            // in-order reduction over interleaved pairs wrongly)
            for (int d = 0; d < dvp; d += 2) {
              delta = std::fma(dor[d + 1], orow[d + 1], delta);
              delta = std::fma(dor[d], orow[d], delta);
            }
          } else if (cr.bd == Dot::bf16_tiles || cr.bd == Dot::fp16_tiles) {  // likewise, in the tiles' order
            delta = dot_tile_order(dor, orow, dvp, cr.bd == Dot::bf16_tiles);
          } else {
            for (int d = 0; d < head_dim_v; ++d) delta += dor[d] * orow[d];
          }
          H.delta[i] = delta;
          H.lse2[i] = lse[row * hq + h] * kLog2e;
        }
        std::fill(H.dq.begin(), H.dq.begin() + nq * dp, 0.0f);
        if (t16) {
          // The transposes, 32 rows at a time (their lines stay in L1 while the columns are
          // written; a row at a time wrote every element to another line and page); their
          // columns past the task's last query, up to a whole tile step, are zero.
          // Query row j of step j / BQB_TILES is column j % BQB_TILES of that step's block.
          constexpr int B = BQB_TILES;
          static_assert(B % 32 == 0);
          for (int64_t j0 = 0; j0 < nq; j0 += 32) {
            const int64_t j1 = std::min(nq, j0 + 32), blk = j0 / B;
            uint16_t* const qt = H.qt16.data() + blk * dp * B - blk * B;   // + d * B + j
            uint16_t* const dot = H.dot16.data() + blk * dvp * B - blk * B;
#if CPATTN_AMX == 1
            transpose_rows32(H.q16.data() + j0 * dq32, dq32, static_cast<int>(j1 - j0), dp, qt + j0, B);
            transpose_rows32(H.do16.data() + j0 * dv32, dv32, static_cast<int>(j1 - j0), dvp, dot + j0, B);
#else
            for (int d = 0; d < dp; ++d)
              for (int64_t j = j0; j < j1; ++j) qt[d * B + j] = H.q16[j * dq32 + d];
            for (int d = 0; d < dvp; ++d)
              for (int64_t j = j0; j < j1; ++j) dot[d * B + j] = H.do16[j * dv32 + d];
#endif
          }
#if CPATTN_AMX != 1  // (transpose_rows32 writes them)
          const int64_t nq32 = (nq + 31) / 32 * 32, last = (nq - 1) / B;  // nq32 stays in the last block
          for (int d = 0; d < dp; ++d)
            std::fill_n(H.qt16.data() + (last * dp + d) * B + nq - last * B, nq32 - nq, uint16_t{0});
          for (int d = 0; d < dvp; ++d)
            std::fill_n(H.dot16.data() + (last * dvp + d) * B + nq - last * B, nq32 - nq, uint16_t{0});
#endif
        }
      }

      for_each_piece<BBK>(w, t, cr.vz, t.q_pos, t.q_pos + nq - 1, [&](const Piece& pc) {
        const int n = pc.a1 - pc.a0;
        const int64_t k0 = pc.b * BBK + pc.a0;  // first physical key row computed
        // first query block that sees the piece
        int64_t qb0 = 0;
        if (cr.vz.hi_bounded && pc.p_lo - cr.vz.hi > t.q_pos) qb0 = (pc.p_lo - cr.vz.hi - t.q_pos) / bqb;
        // the last key position of the piece: query blocks past its left window end the loop
        const int64_t p_hi = pc.p_lo + (pc.c1 - pc.c0) - 1;
        bool first = true;  // the piece's first step writes its dK, dV tiles (no zero fill)
        for (int h = h0; h < h1; ++h) {
          BwdHead& H = S.heads[static_cast<size_t>(h - h0)];
          for (int64_t qb = qb0; qb * bqb < nq; ++qb) {
            progress(th);
            const int64_t i0 = qb * bqb, qp0 = t.q_pos + i0;
            if (cr.vz.lo_bounded && qp0 - cr.vz.lo > p_hi) break;
            const int m = static_cast<int>(std::min<int64_t>(bqb, nq - i0));
            // S = Q Kt, dP = dO Vt   [m, a0:a1)
            if (t16) {
              gemm_tiles16<true>(false, m, n, dp, H.q16.data() + i0 * dq32, dq32, pk.Kt2(hk, k0), PAD, dp * PAD / 2,
                                 S.s.data() + pc.a0, BBK);
              gemm_tiles16<true>(false, m, n, dvp, H.do16.data() + i0 * dv32, dv32, pk.Vt2(hk, k0), PAD,
                                 dvp * PAD / 2, S.dp.data() + pc.a0, BBK);
            } else {
              const float* kt = pk.Kt(hk, 0) + (k0 / PAD) * dp * PAD;
              const float* vt = pk.Vt(hk, 0) + (k0 / PAD) * dvp * PAD;
              mm<true>(cr.bd, m, n, dp, H.q.data() + i0 * dp, dp, 1, kt, PAD, dp * PAD, S.s.data() + pc.a0, BBK,
                       pk.paired(kt));
              mm<true>(cr.bd, m, n, dvp, H.dout.data() + i0 * dvp, dvp, 1, vt, PAD, dvp * PAD, S.dp.data() + pc.a0,
                       BBK, pk.paired(vt));
            }
            // The next query block's Q, dO and their panels come from L3 (per-task buffers of
            // max_q rows): fetch them while this block's softmax and products run.
            const bool more = !t16 && i0 + BQB < nq;
            for (int r = 0; more && r < m; ++r) {
              const int64_t ni = i0 + BQB + r;
              if (ni >= nq) break;
              for (int d = 0; d < dp; d += 16) __builtin_prefetch(H.q.data() + ni * dp + d);
              for (int d = 0; d < dvp; d += 16) __builtin_prefetch(H.dout.data() + ni * dvp + d);
              if (r % 4 == 0) {  // a panel row is 16 floats: 4 rows per line
                for (int d = 0; d < dp; d += PAD) __builtin_prefetch(H.q_pan.data() + ((d / PAD) * max_q + ni) * PAD);
                for (int d = 0; d < dvp; d += PAD) __builtin_prefetch(H.dout_pan.data() + ((d / PAD) * max_q + ni) * PAD);
              }
            }
            for (int r = 0; r < m; ++r) {
              float* s = S.s.data() + r * BBK;   // -> P, then dS
              float* dpr = S.dp.data() + r * BBK;
              float* pd = S.pd.data() + r * BBK;  // P after dropout
              const int ve = visible_end(pc, cr.vz, qp0 + r);
              const int vb = visible_begin(pc, cr.vz, qp0 + r);
              const float l2 = H.lse2[i0 + r];
              if (ve <= vb || l2 == kNegInf) {
                for (int c = pc.a0; c < pc.a1; ++c) s[c] = pd[c] = 0.0f;
                continue;
              }
              if (cr.scored) {  // soft cap / ALiBi: per element, scalar; dS gets the cap's derivative
                const float slope = cr.vz.alibi ? opt.alibi_slopes[h] : 0.0f;
                const float dl = H.delta[i0 + r];
                const uint64_t key = cr.dropout ? dropout_row_key(opt.seed, h + opt.dropout_head_offset, t.doc, qp0 + r) : 0;
                for (int c = pc.a0; c < pc.a1; ++c) {
                  if (c < vb || c >= ve) {
                    s[c] = pd[c] = 0.0f;
                    continue;
                  }
                  const int64_t kp = pc.p_lo + (c - pc.c0);
                  float dcap;
                  const float x = transform_score(s[c] * cr.scale, opt.softcap, slope, qp0 + r, kp, dcap);
                  const float x2 = x * kLog2e - l2;
                  const float pv = std::exp2(x2 > 0.0f ? 0.0f : x2);  // P <= 1, as vexp2 (a NaN stays NaN)
                  const float kf = !cr.dropout ? 1.0f : dropout_keep_row(key, kp, cr.thr) ? cr.inv_keep : 0.0f;
                  pd[c] = pv * kf;
                  s[c] = pv * (dpr[c] * kf - dl) * dcap;
                }
                continue;
              }
              const vf lv = vset(l2), cv = vset(cr.cl), dl = vset(H.delta[i0 + r]);
              for (int c = pc.a0; c < pc.a1; c += W) vstore(s + c, vload(s + c) * cv - lv);
              for (int c = pc.a0; c < vb; ++c) s[c] = kNegInf;
              for (int c = ve; c < pc.a1; ++c) s[c] = kNegInf;
              if (!cr.dropout) {
                for (int c = pc.a0; c < pc.a1; c += W) {
                  const vf pv = vexp2(vload(s + c));
                  vstore(pd + c, pv);
                  vstore(s + c, pv * (vload(dpr + c) - dl));  // dS = P (dP - delta)
                }
              } else {
                const uint64_t key = dropout_row_key(opt.seed, h + opt.dropout_head_offset, t.doc, qp0 + r);
                for (int c = pc.a0; c < pc.a1; c += W) vstore(s + c, vexp2(vload(s + c)));
                for (int c = pc.a0; c < pc.a1; ++c) {
                  const bool vis = c >= vb && c < ve;
                  const float kf = vis && dropout_keep_row(key, pc.p_lo + (c - pc.c0), cr.thr) ? cr.inv_keep : 0.0f;
                  pd[c] = s[c] * kf;
                  s[c] = s[c] * (dpr[c] * kf - H.delta[i0 + r]);
                }
              }
            }
            // dV[a0:a1) += Pd^T dO ; dK[a0:a1) += dS^T Q ; dQ += dS K[a0:a1). dS = P (dP - delta)
            // is an fp32 intermediate whose range is dP's (a sum over the head dim of dO V): fp16
            // tiles would round it to fp16 and overflow past 65504 (or flush it below 6e-8), so
            // with fp16 storage its two products run on the FMA code; bf16 has fp32's range.
            const Dot ds_dot = cr.bd == Dot::fp16_tiles ? Dot::fma : cr.bd;
            if (t16) {
              // dV^T[:, a0:a1) += dO^T P, dK^T[:, a0:a1) += Q^T dS (B: P, dS in pairs of query rows);
              // dQ += dS K (A: dS rows in bf16)
              const int n32 = (n + 31) / 32 * 32;
              for (int r = 0; r < m; r += 2) {
                pair_two_rows(S.pd.data(), BBK, r, m, pc.a0, pc.a1, S.pv2.data() + (r / 2) * BBK);
                pair_two_rows(S.s.data(), BBK, r, m, pc.a0, pc.a1, S.ds2.data() + (r / 2) * BBK);
                round_row_bf16(S.s.data() + r * BBK + pc.a0, n, n32, S.ds16.data() + r * BBK);
                if (r + 1 < m) round_row_bf16(S.s.data() + (r + 1) * BBK + pc.a0, n, n32, S.ds16.data() + (r + 1) * BBK);
              }
              const uint16_t* dot = H.dot16.data() + i0 * dvp;  // the step's block (i0 = its index * bqb)
              const uint16_t* qt = H.qt16.data() + i0 * dp;
              const uint32_t* pv2 = S.pv2.data() + pc.a0;
              const uint32_t* ds2 = S.ds2.data() + pc.a0;
              float* const tv = S.dv.data() + pc.a0;
              float* const tk = S.dk.data() + pc.a0;
              if (first) {
                gemm_tiles16<true>(false, dvp, n, m, dot, bqb, pv2, BBK, 16, tv, BBK);
                gemm_tiles16<true>(false, dp, n, m, qt, bqb, ds2, BBK, 16, tk, BBK);
              } else {
                gemm_tiles16<false>(false, dvp, n, m, dot, bqb, pv2, BBK, 16, tv, BBK);
                gemm_tiles16<false>(false, dp, n, m, qt, bqb, ds2, BBK, 16, tk, BBK);
              }
              first = false;
              gemm_tiles16<false>(false, m, dp, n, S.ds16.data(), BBK, pk.Kr2(hk, k0), PAD, pk.vr_ps() / 2,
                                  H.dq.data() + i0 * dp, dp);
              continue;
            }
            float* const tv = S.dv.data() + pc.a0 * dvp;
            float* const tk = S.dk.data() + pc.a0 * dp;
            if (first) {
              mm<true>(cr.bd, n, dvp, m, S.pd.data() + pc.a0, 1, BBK, H.dout_pan.data() + i0 * PAD, PAD,
                         max_q * PAD, tv, dvp);
              mm<true>(ds_dot, n, dp, m, S.s.data() + pc.a0, 1, BBK, H.q_pan.data() + i0 * PAD, PAD,
                         max_q * PAD, tk, dp);
            } else {
              mm<false>(cr.bd, n, dvp, m, S.pd.data() + pc.a0, 1, BBK, H.dout_pan.data() + i0 * PAD, PAD,
                          max_q * PAD, tv, dvp);
              mm<false>(ds_dot, n, dp, m, S.s.data() + pc.a0, 1, BBK, H.q_pan.data() + i0 * PAD, PAD,
                          max_q * PAD, tk, dp);
            }
            first = false;
            mm<false>(ds_dot, m, dp, n, S.s.data() + pc.a0, BBK, 1, pk.Kr(hk) + k0 * PAD, PAD,
                        pk.vr_ps(), H.dq.data() + i0 * dp, dp, pk.paired(pk.Kr(hk) + k0 * PAD));
          }
        }
        if (first) return;  // no query block saw the piece: nothing to add
        // add the piece's rows to the unit's dK/dV: the block's first piece writes the whole
        // block in one pass (its rows copied, the others zeroed), the later ones add
        const int block_rows = static_cast<int>(std::min<int64_t>(BBK, total_k - pc.b * BBK));
        const bool fresh = !tu[pc.b];
        tu[pc.b] = 1;
        if (t16) {  // transposed tiles into the transposed block
          float* const gkb = gku + pc.b * BBK * dp;
          float* const gvb = gvu + pc.b * BBK * dvp;
          if (fresh) {  // one pass: the piece's columns copied, the block's others zeroed
            auto put = [&](float* g, const float* tile, int dims) {
              for (int d = 0; d < dims; ++d, g += BBK, tile += BBK) {
                std::fill(g, g + pc.c0, 0.0f);
                std::copy(tile + pc.c0, tile + pc.c1, g + pc.c0);
                std::fill(g + pc.c1, g + BBK, 0.0f);
              }
            };
            put(gkb, S.dk.data(), dp);
            put(gvb, S.dv.data(), dvp);
            return;
          }
          for (int d = 0; d < dp; ++d)
            for (int c = pc.c0; c < pc.c1; ++c) gkb[d * BBK + c] += S.dk[d * BBK + c];
          for (int d = 0; d < dvp; ++d)
            for (int c = pc.c0; c < pc.c1; ++c) gvb[d * BBK + c] += S.dv[d * BBK + c];
          return;
        }
        if (fresh) {  // one pass: the piece's rows copied, the block's others zeroed
          auto put = [&](float* g, const float* tile, int dims) {
            std::fill_n(g, pc.c0 * dims, 0.0f);
            std::copy(tile + pc.c0 * dims, tile + pc.c1 * dims, g + pc.c0 * dims);
            std::fill(g + pc.c1 * dims, g + block_rows * dims, 0.0f);
          };
          put(gku + pc.b * BBK * dp, S.dk.data(), dp);
          put(gvu + pc.b * BBK * dvp, S.dv.data(), dvp);
          return;
        }
        for (int c = pc.c0; c < pc.c1; ++c) {
          const int64_t row = pc.b * BBK + c;
          float* gkr = gku + row * dp;
          float* gvr = gvu + row * dvp;
          const float* tk = S.dk.data() + c * dp;
          const float* tv = S.dv.data() + c * dvp;
          for (int d = 0; d < dp; d += W) vstore(gkr + d, vload(gkr + d) + vload(tk + d));
          for (int d = 0; d < dvp; d += W) vstore(gvr + d, vload(gvr + d) + vload(tv + d));
        }
      });
      for (int h = h0; h < h1; ++h) {
        const BwdHead& H = S.heads[static_cast<size_t>(h - h0)];
        for (int64_t i = 0; i < nq; ++i) {
          const float* src = H.dq.data() + i * dp;
          if (p.grad_mode == GradMode::accumulate_all) {  // fp32 view: added to
            if (i + kRowsAhead < nq)
              prefetch_row(dq_data, DType::f32, (t.q_row + i + kRowsAhead) * dq_rs + h * dq_hs, head_dim_qk);
            float* o = static_cast<float*>(dq_data) + (t.q_row + i) * dq_rs + h * dq_hs;
            for (int d = 0; d < head_dim_qk; ++d) o[d] += src[d] * cr.scale;
          } else {
            st_row(dq_data, dtype, (t.q_row + i) * dq_rs + h * dq_hs, head_dim_qk, src, cr.scale);
          }
        }
      }
    }
  };

  // Unit u = (kv head u / sets, set u % sets): its heads side by side.
  parallel_for(units, nthr, [&](int64_t u, int th) {
    const int hk = static_cast<int>(u / sets), set = static_cast<int>(u % sets);
    float* gku = gk + static_cast<size_t>(u) * g_rows * dp;
    float* gvu = gv + static_cast<size_t>(u) * g_rows * dvp;
    const int h0 = hk * group + set * per, h1 = std::min(h0 + per, (hk + 1) * group);
    const TileScope tiles;
    run_set(scr[th], th, h0, h1, gku, gvu, touched + u * nbb);
  });
  if (share) return;  // the reader sums (attention_grad_share_rows)

  // dk[r, hk] = scale * sum over the kv head's sets (in set order) of gk; dv likewise.
  // Elements [d0, d0 + n) of key row r of kv head hk (dK when is_k, else dV; stored row
  // in.key_rows[r] if given) from their sums over the sets, src (unscaled dK). Write mode
  // stores them in the views' dtype (the storage dtype or fp32). named_rows_only: a row that no
  // run names is left as it is.
  auto write_kv = [&](bool is_k, int64_t r, int hk, int d0, int n, const float* src) {
    if (p.named_rows_only && !named.named(r)) return;
    void* const data = is_k ? dk_data : dv_data;
    const int64_t sr = in.stored_key_row(r);
    const int64_t at = sr * (is_k ? dk_rs : dv_rs) + hk * (is_k ? dk_hs : dv_hs) + d0;
    const float mul = is_k ? cr.scale : 1.0f;
    if (p.grad_mode == GradMode::write) {
      st_row(data, p.dk.dtype, at, n, src, mul);
    } else {  // fp32 views
      float* o = static_cast<float*>(data) + at;
      for (int d = 0; d < n; ++d) o[d] += src[d] * mul;
    }
  };
  if (t16) {  // per block of BBK rows: the sets' transposed blocks summed in set order, 16 rows at a time
    parallel_for(nbb, opt.num_threads, [&](int64_t b, int) {  // (nbb = bwd_final_items(total_k, true))
      alignas(64) float rows16[16][256];  // 16 of the block's rows, whole (dp <= 256)
      std::vector<const float*> ks(static_cast<size_t>(sets)), vs(ks.size());
      const int64_t r0 = b * BBK;
      const int rows = static_cast<int>(std::min<int64_t>(BBK, total_k - r0));
      for (int hk = 0; hk < hkn; ++hk) {
        const auto block = [&](const float* g, int dims) {
          return [=](int64_t unit) { return g + (unit * nbb + b) * BBK * dims; };
        };
        const int nr = reached_sets(touched, hk, sets, nbb, b, ks.data(), block(gk, dp));
        reached_sets(touched, hk, sets, nbb, b, vs.data(), block(gv, dvp));
        for (const bool is_k : {true, false}) {
          const int dim = is_k ? head_dim_qk : head_dim_v;
          for (int c0 = 0; c0 < rows; c0 += 16) {
            sum_sets_rows16((is_k ? ks : vs).data(), nr, pad_up(dim), c0, rows16);
            for (int j = 0; j < std::min(16, rows - c0); ++j) write_kv(is_k, r0 + c0 + j, hk, 0, dim, rows16[j]);
          }
        }
      }
    });
    return;
  }
  parallel_for(bwd_final_items(total_k, false), opt.num_threads, [&](int64_t u, int) {
    std::vector<float> ak(dp), av(dvp);
    std::vector<const float*> ks(static_cast<size_t>(sets)), vs(ks.size());
    const int64_t r1 = std::min(total_k, (u + 1) * kFinalSumRows);
    for (int64_t r = u * kFinalSumRows; r < r1; ++r)
      for (int hk = 0; hk < hkn; ++hk) {
        const auto row = [&](const float* g, int dims) {
          return [=](int64_t unit) { return g + (unit * total_k + r) * dims; };
        };
        const int nr = reached_sets(touched, hk, sets, nbb, r / BBK, ks.data(), row(gk, dp));
        reached_sets(touched, hk, sets, nbb, r / BBK, vs.data(), row(gv, dvp));
        sum_sets_row(ks.data(), nr, dp, ak.data());
        sum_sets_row(vs.data(), nr, dvp, av.data());
        write_kv(true, r, hk, 0, head_dim_qk, ak.data());
        write_kv(false, r, hk, 0, head_dim_v, av.data());
      }
  });
}


// attention_grad_share_rows (attention.cpp) on this path: key rows [r0, r0 + n) of the dK and
// dV a backward left in a KvGradShare's buffer (GradShareLayout), with the operations of
// backward_impl's own final sum, so bitwise what it writes into fp32 views: per row and KV
// head the sum over the sets that reached the row's block, in set order (transposed, bf16
// tiles: s_0 + s_1 + ... then + 0.0f, or 0.0f where no set did; otherwise 0.0f + s_0 + s_1 +
// ...), times the scale (dK) or 1 (dV). Rows go 16 at a time (one 16 x 16 transpose of a
// transposed block's 16 columns per 16 dims); a group's rows outside [r0, r0 + n) are summed and
// not written.
void grad_share_rows_impl(const GradShareLayout& L, const std::byte* buffer, int64_t r0, int64_t n, float* dk,
                          float* dv) {
  const auto* touched = reinterpret_cast<const char*>(buffer + L.touched_offset());
  thread_local std::vector<const float*> src;  // (called cp times per few rows: no allocation per call)
  src.resize(static_cast<size_t>(L.sets));
  alignas(64) float rows16[16][256];  // a group's 16 rows of one KV head, whole (dims <= 256)
  for (const bool is_k : {true, false}) {
    const int dim = is_k ? L.dqk : L.dv, dpad = is_k ? L.dp : L.dvp;
    const float mul = is_k ? L.scale : 1.0f;
    const auto* g = reinterpret_cast<const float*>(buffer + (is_k ? GradShareLayout::kHeader : L.gv_offset()));
    float* const out = is_k ? dk : dv;
    const int64_t row_out = int64_t{L.hkv} * dim;
    for (int64_t a = r0; a < r0 + n;) {
      const int64_t g0 = a / 16 * 16, e = std::min(r0 + n, g0 + 16);  // rows [a, e) of the group from g0
      const int64_t b = g0 / BBK;
      const int c16 = static_cast<int>(g0 - b * BBK);  // the group's first column in its block
      for (int hk = 0; hk < L.hkv; ++hk) {
        // The sets that reached block b: transposed, each one's block b ([dpad][BBK] floats);
        // otherwise each one's row a ([g_rows][dpad] floats a set).
        const int nr = reached_sets(touched, hk, L.sets, L.nbb, b, src.data(), [&](int64_t unit) {
          return g + (L.transposed ? (unit * L.nbb + b) * BBK : unit * L.g_rows + a) * dpad;
        });
        if (L.transposed) {
          sum_sets_rows16(src.data(), nr, dpad, c16, rows16);
        } else {
          for (int64_t r = a; r < e; ++r) {
            sum_sets_row(src.data(), nr, dpad, rows16[r - g0]);
            for (int k = 0; k < nr; ++k) src[static_cast<size_t>(k)] += dpad;
          }
        }
        for (int64_t r = a; r < e; ++r) {
          float* o = out + (r - r0) * row_out + int64_t{hk} * dim;
          const float* row = rows16[r - g0];
          for (int d = 0; d < dim; ++d) o[d] = row[d] * mul;
        }
      }
      a = e;
    }
  }
}

}  // namespace
}  // namespace cpattn::kernels::CPATTN_KNS
