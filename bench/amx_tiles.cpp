// The AMX tile products alone, against the tile peak (issue 14; docs/design.md section 14):
// what 2 x 2 blocks of C tiles reach with their operands in L1, with C's load and store per
// block, as gemm_tiles16 (the kernels' product) over 128 x 128 x 128 with operands in L2, and
// the forward's S product of a unit in its block order and two others; then how vector work
// (512-bit FMAs or adds, 256-bit FMAs) runs beside tile products, as the forward's softmax
// runs beside its tiles (a second table: nanoseconds per iteration, each alone and both).
// It compiles the amx path's kernel code (kernel_isa.inc) in a namespace of its own, so that
// it times the library's gemm_tiles16 and TileJob themselves (the 2 x 2 block loops and two
// of the S product's orders are this file's, on the same tile primitives).
//
//   build/release/bench/amx_tiles [--repeats 5]
//
// Prints one Markdown row per case: GFLOP/s, median of --repeats runs (about 0.1 s each; the
// S product's and the vector cases' 0.04-0.09 s), and the share of the first case (dot
// products alone: the tile peak of this run). The products run first, the peak loops after
// them, the vector cases last: after seconds of tiles at their peak the core's clock may be
// lower, so read those in ratio to each other. Exits 0 with a message on a CPU
// without AMX-BF16 (or where Linux refuses the tile state).
#define CPATTN_KNS amx_bench
#define CPATTN_VW 16
#define CPATTN_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c"
#define CPATTN_AMX 1
#define CPATTN_GCC_ONLY
#include "kernel_isa.inc"

#include <cpattn/attention.hpp>

#include "gflops.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__clang__)
int main() {
  std::puts("amx_tiles: the amx path is built by GCC only");
  return 0;
}
#else
namespace {

using namespace cpattn::kernels::amx_bench;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")
alignas(64) uint16_t g_a[2][16 * 32 * 8];   // two A tiles' rows for 8 k steps (512 bytes a row)
alignas(64) uint32_t g_b[2][16 * 16 * 8];   // two B tiles for 8 k steps
alignas(64) float g_c[32 * 64];             // a 2 x 2 block of C tiles (row stride 64 floats)

// `blocks` 2 x 2 blocks of `ksteps` 32-element steps each: kLoads adds the A and B tile loads
// per step, kC the C tiles' load before and store after each block.
enum Mode { kDots, kLoads, kC };
template <Mode M>
__attribute__((noinline)) void blocks_run(int blocks, int ksteps) {
  for (int i = 0; i < blocks; ++i) {
    if (M == kC) {
      Tiles::load<0>(g_c, 256);
      Tiles::load<1>(g_c + 16, 256);
      Tiles::load<2>(g_c + 16 * 64, 256);
      Tiles::load<3>(g_c + 16 * 64 + 16, 256);
    }
    for (int k = 0; k < ksteps; ++k) {
      if (M != kDots) {
        Tiles::load<4>(g_a[0] + k * 32, 512);
        Tiles::load<5>(g_a[1] + k * 32, 512);
        Tiles::load<6>(g_b[0] + k * 256, 64);
        Tiles::load<7>(g_b[1] + k * 256, 64);
      }
      Tiles::dot<0, 4, 6>(false);
      Tiles::dot<1, 4, 7>(false);
      Tiles::dot<2, 5, 6>(false);
      Tiles::dot<3, 5, 7>(false);
    }
    if (M == kC) {
      Tiles::store<0>(g_c, 256);
      Tiles::store<1>(g_c + 16, 256);
      Tiles::store<2>(g_c + 16 * 64, 256);
      Tiles::store<3>(g_c + 16 * 64 + 16, 256);
    }
  }
}

// The forward's S = Q K^T for one unit and piece of a GQA set (4 heads x 64 query rows, 256
// keys, D 128; K^T in the pairs of pack_kv_tiles, Q rows in bf16), in three block orders:
// kBlocks22, the kernel's (a TileJob per 32-row sub-block, as the forward runs it: 2 x 2
// blocks of C tiles, each B tile read for 2 products); kBlocks41 (per head, 4 x 1 blocks: each
// B tile read for 4, the A tiles reloaded per product, from L1); kHeadsInner (2 x 2 blocks,
// the heads' sub-blocks of the same rows one after another per column block, so that B comes
// from L1). The last two are loops of this file's on the same tile primitives.
constexpr int kSetHeads = 4, kUnitRows = 64, kPieceKeys = 256, kDim = 128;
alignas(64) uint16_t g_q[kSetHeads * kUnitRows * kDim];
alignas(64) uint32_t g_kt[kPieceKeys * kDim / 2];  // panel of 16 keys j: kDim / 2 pair rows of 16 words
alignas(64) float g_s[kSetHeads * kUnitRows * kPieceKeys];
enum Order { kBlocks22, kBlocks41, kHeadsInner };
// A hand block's framing: C tiles 0-3 zeroed before its steps, then stored at c + off[t]
// (rows of S, kPieceKeys floats apart).
inline void zero_c() {
  Tiles::zero<0>();
  Tiles::zero<1>();
  Tiles::zero<2>();
  Tiles::zero<3>();
}
inline void store_c(float* c, const int (&off)[4]) {
  Tiles::store<0>(c + off[0], kPieceKeys * 4);
  Tiles::store<1>(c + off[1], kPieceKeys * 4);
  Tiles::store<2>(c + off[2], kPieceKeys * 4);
  Tiles::store<3>(c + off[3], kPieceKeys * 4);
}
// C tiles 0-3 of the 2 x 2 block at (r, n0) of head h: zeroed, kDim / 32 steps, stored (a
// TileJob's block, by hand, for kHeadsInner's order).
inline void s_block22(int h, int r, int n0) {
  const uint16_t* a = g_q + (h * kUnitRows + r) * kDim;
  float* c = g_s + (h * kUnitRows + r) * kPieceKeys + n0;
  const uint32_t* b0 = g_kt + (n0 / 16) * (kDim / 2) * 16;
  const uint32_t* b1 = b0 + (kDim / 2) * 16;
  zero_c();
  for (int k0 = 0; k0 < kDim; k0 += 32) {
    Tiles::load<4>(a + k0, kDim * 2);
    Tiles::load<5>(a + 16 * kDim + k0, kDim * 2);
    Tiles::load<6>(b0 + k0 / 2 * 16, 64);
    Tiles::load<7>(b1 + k0 / 2 * 16, 64);
    Tiles::dot<0, 4, 6>(false);
    Tiles::dot<1, 4, 7>(false);
    Tiles::dot<2, 5, 6>(false);
    Tiles::dot<3, 5, 7>(false);
  }
  store_c(c, {0, 16, 16 * kPieceKeys, 16 * kPieceKeys + 16});
}
// C tiles 0-3 of the 4 x 1 block at column n0 of head h (its 64 rows); B alternates in 6, 7.
inline void s_block41(int h, int n0) {
  const uint16_t* a = g_q + h * kUnitRows * kDim;
  float* c = g_s + h * kUnitRows * kPieceKeys + n0;
  const uint32_t* b = g_kt + (n0 / 16) * (kDim / 2) * 16;
  zero_c();
  for (int k0 = 0; k0 < kDim; k0 += 64) {
    Tiles::load<6>(b + k0 / 2 * 16, 64);
    Tiles::load<4>(a + k0, kDim * 2);
    Tiles::dot<0, 4, 6>(false);
    Tiles::load<5>(a + 16 * kDim + k0, kDim * 2);
    Tiles::dot<1, 5, 6>(false);
    Tiles::load<4>(a + 32 * kDim + k0, kDim * 2);
    Tiles::dot<2, 4, 6>(false);
    Tiles::load<5>(a + 48 * kDim + k0, kDim * 2);
    Tiles::dot<3, 5, 6>(false);
    Tiles::load<7>(b + (k0 + 32) / 2 * 16, 64);
    Tiles::load<4>(a + k0 + 32, kDim * 2);
    Tiles::dot<0, 4, 7>(false);
    Tiles::load<5>(a + 16 * kDim + k0 + 32, kDim * 2);
    Tiles::dot<1, 5, 7>(false);
    Tiles::load<4>(a + 32 * kDim + k0 + 32, kDim * 2);
    Tiles::dot<2, 4, 7>(false);
    Tiles::load<5>(a + 48 * kDim + k0 + 32, kDim * 2);
    Tiles::dot<3, 5, 7>(false);
  }
  store_c(c, {0, 16 * kPieceKeys, 32 * kPieceKeys, 48 * kPieceKeys});
}
template <Order O>
__attribute__((noinline)) void s_product() {
  if constexpr (O == kBlocks41) {
    for (int h = 0; h < kSetHeads; ++h)
      for (int n0 = 0; n0 < kPieceKeys; n0 += 16) s_block41(h, n0);
  } else if constexpr (O == kBlocks22) {
    for (int h = 0; h < kSetHeads; ++h)
      for (int r = 0; r < kUnitRows; r += 32)
        TileJob{.a = g_q + (h * kUnitRows + r) * kDim, .a_stride = kDim * 2, .b = g_kt, .b_ld = 16,
                .b_panel = (kDim / 2) * 16, .c = g_s + (h * kUnitRows + r) * kPieceKeys, .ldc = kPieceKeys,
                .n = kPieceKeys, .k = kDim, .zero = true, .two_m = true}
            .finish();
  } else {
    for (int r = 0; r < kUnitRows; r += 32)
      for (int n0 = 0; n0 < kPieceKeys; n0 += 32)
        for (int h = 0; h < kSetHeads; ++h) s_block22(h, r, n0);
  }
}

// Vector work beside the tile products: per iteration `Dots` TDPBF16PS on tiles already loaded
// (no memory) and `Groups` x 8 independent vector operations V, 8 chains: 512-bit FMAs or
// adds, or 256-bit FMAs. Alone, 16 groups of FMAs (of either width) and 4 products each take
// about 64 cycles; together they take the larger of the two where the vector unit and the
// tiles run side by side, and their sum where they take turns. 32 groups of 256-bit FMAs do
// the lane work of 16 groups of 512-bit ones.
enum VecOp { kFma512, kAdd512, kFma256 };
template <int Dots, int Groups, VecOp V>
__attribute__((noinline)) float vector_beside_tiles(long iters) {
  typedef float Vec __attribute__((vector_size(V == kFma256 ? 32 : 64)));
  constexpr int kLanes = sizeof(Vec) / 4;
  Vec acc[8];
  const Vec m = Vec{} + 0.999f, a = Vec{} + 0.001f;
  for (int i = 0; i < 8; ++i) acc[i] = Vec{} + (1.0f + static_cast<float>(i));
  for (long it = 0; it < iters; ++it) {
    if constexpr (Dots > 0) {
      Tiles::dot<0, 4, 6>(false);
      Tiles::dot<1, 4, 7>(false);
      Tiles::dot<2, 5, 6>(false);
      Tiles::dot<3, 5, 7>(false);
    }
    for (int g = 0; g < Groups; ++g)
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        if constexpr (V == kAdd512) acc[i] = acc[i] + a;
        else acc[i] = acc[i] * m + a;  // (an FMA: -ffp-contract=fast)
      }
  }
  alignas(64) float lanes[kLanes];
  float sum = 0.0f;
  for (int i = 0; i < 8; ++i) {
    std::memcpy(lanes, &acc[i], sizeof lanes);
    for (const float x : lanes) sum += x;
  }
  return sum;
}
#pragma GCC pop_options

using cpattn::bench::gflops;
using cpattn::bench::median_seconds;

}  // namespace

int main(int argc, char** argv) {
  int repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--repeats") repeats = std::max(1, std::atoi(argv[i + 1]));
  if (!cpattn::kernel_path_supported(cpattn::KernelPath::amx)) {
    std::puts("amx_tiles: this CPU (or its kernel) does not run the amx path; nothing to measure");
    return 0;
  }
  tiles_begin();
  constexpr double kBlockStep = 4.0 * 16 * 16 * 32 * 2;  // flops of one k step of a 2 x 2 block
  const int blocks = 100000;
  struct Row {
    const char* what;
    double gf;
  };
  // The products first: run after the block loops below they measured 25-40% lower here
  // (AMX at its peak for a second or more lowers the core's clock, or its power state, for a
  // while after).
  std::vector<Row> products, rows;
  // gemm_tiles16<false> over M = N = K = 128 (C += A B, the backward's products' shape), its
  // operands (32 + 32 + 64 KiB) in L2 when one set repeats, from L3 when 16 sets rotate.
  constexpr int M = 128, N = 128, K = 128;
  for (const int sets : {1, 16}) {
    std::vector<uint16_t> a(static_cast<size_t>(sets) * M * K, 0x3f80);       // 1.0 in bf16
    std::vector<uint32_t> b(static_cast<size_t>(sets) * N * K / 2, 0x3f803f80);
    std::vector<float> c(static_cast<size_t>(sets) * M * N, 0.0f);
    const int calls = 2000;
    products.push_back({sets == 1 ? "gemm_tiles16 128 x 128 x 128, one operand set (L2)"
                                  : "gemm_tiles16 128 x 128 x 128, 16 operand sets in turn",
                        gflops(repeats, 2.0 * M * N * K * calls, [&] {
                          for (int i = 0; i < calls; ++i) {
                            const size_t j = static_cast<size_t>(i % sets);
                            gemm_tiles16<false>(false, M, N, K, a.data() + j * M * K, K, b.data() + j * N * K / 2,
                                                16, int64_t{K} / 2 * 16, c.data() + j * M * N, N);
                          }
                        })});
  }
  // The forward's S product of a unit and piece (64 KiB of K^T: from L2), in the three orders.
  std::fill(std::begin(g_q), std::end(g_q), uint16_t{0x3f80});
  std::fill(std::begin(g_kt), std::end(g_kt), 0x3f803f80u);
  const double s_flops = 2.0 * kSetHeads * kUnitRows * kPieceKeys * kDim;
  const int s_calls = 4000;
  auto s_case = [&](const char* what, void (*fn)()) {
    products.push_back({what, gflops(repeats, s_flops * static_cast<double>(s_calls), [&] {
                          for (int i = 0; i < s_calls; ++i) fn();
                        })});
  };
  s_case("forward S of a GQA set (4 x 64 rows, 256 keys, D 128): 2 x 2 blocks per sub-block (the kernel's)",
         s_product<kBlocks22>);
  s_case("the same, 4 x 1 blocks per head (each B tile read for 4 products)", s_product<kBlocks41>);
  s_case("the same, 2 x 2 blocks, the heads' sub-blocks inner (B from L1)", s_product<kHeadsInner>);
  rows.push_back({"2 x 2 blocks, dot products alone (4 k steps)",
                  gflops(repeats, kBlockStep * 4 * blocks, [&] { blocks_run<kDots>(blocks, 4); })});
  rows.push_back({"+ A and B tile loads from L1 (4 k steps)",
                  gflops(repeats, kBlockStep * 4 * blocks, [&] { blocks_run<kLoads>(blocks, 4); })});
  rows.push_back({"+ C tiles loaded and stored per block (4 k steps)",
                  gflops(repeats, kBlockStep * 4 * blocks, [&] { blocks_run<kC>(blocks, 4); })});
  rows.push_back({"+ C tiles loaded and stored per block (8 k steps)",
                  gflops(repeats, kBlockStep * 8 * blocks / 2, [&] { blocks_run<kC>(blocks / 2, 8); })});
  rows.insert(rows.end(), products.begin(), products.end());

  // Nanoseconds per iteration of vector_beside_tiles (median of --repeats runs of 2M).
  Tiles::load<4>(g_a[0], 512);
  Tiles::load<5>(g_a[1], 512);
  Tiles::load<6>(g_b[0], 64);
  Tiles::load<7>(g_b[1], 64);
  struct Mixed {
    const char* what;
    double ns;
  };
  std::vector<Mixed> mixed;
  auto ns_of = [&](const char* what, float (*fn)(long)) {
    const long iters = 2000000;
    const double s = median_seconds(repeats, [&] {
      volatile float sink = fn(iters);
      (void)sink;
    });
    mixed.push_back({what, s * 1e9 / static_cast<double>(iters)});
  };
  ns_of("4 tile products", vector_beside_tiles<4, 0, kFma512>);
  ns_of("16 x 8 512-bit FMAs", vector_beside_tiles<0, 16, kFma512>);
  ns_of("4 tile products + 16 x 8 512-bit FMAs", vector_beside_tiles<4, 16, kFma512>);
  ns_of("16 x 8 512-bit adds", vector_beside_tiles<0, 16, kAdd512>);
  ns_of("4 tile products + 16 x 8 512-bit adds", vector_beside_tiles<4, 16, kAdd512>);
  ns_of("16 x 8 256-bit FMAs", vector_beside_tiles<0, 16, kFma256>);
  ns_of("4 tile products + 16 x 8 256-bit FMAs", vector_beside_tiles<4, 16, kFma256>);
  ns_of("32 x 8 256-bit FMAs", vector_beside_tiles<0, 32, kFma256>);
  ns_of("4 tile products + 32 x 8 256-bit FMAs", vector_beside_tiles<4, 32, kFma256>);
  tiles_end();
  std::printf("| case | GFLOP/s | share of the first |\n|---|---|---|\n");
  for (const Row& r : rows) std::printf("| %s | %.1f | %.0f%% |\n", r.what, r.gf, 100.0 * r.gf / rows[0].gf);
  std::printf("\n| vector work beside the tiles, per iteration | ns |\n|---|---|\n");
  for (const Mixed& r : mixed) std::printf("| %s | %.1f |\n", r.what, r.ns);
  return 0;
}
#endif
