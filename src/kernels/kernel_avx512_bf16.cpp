// The avx512_bf16 kernel path: kernel_impl.hpp compiled with 16-float vectors and bf16 dot
// products (vdpbf16ps, CPATTN_BF16_DOT 1) for bf16 storage; fp32/fp16 storage runs the same
// FMA code as the avx512 path. Every header is included before the target switch (see
// kernel_impl.hpp); the target pragma is this file's -mavx512f -mavx512bf16, scoped so that
// no header's out-of-line function is compiled for it.
#include "blocking.hpp"
#include "common.hpp"

#include <cpattn/dtype.hpp>

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__clang__)
// clang (the fuzz preset's compiler) ignores GCC's target pragma, which this file's intrinsic
// needs: the path is built by GCC only. Under clang its table is empty and
// kernel_path_supported(avx512_bf16) is false (attention.cpp).
namespace cpattn::kernels::avx512_bf16 {
const KernelTable table{.forward = nullptr, .backward = nullptr};
}  // namespace cpattn::kernels::avx512_bf16
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")
#define CPATTN_KNS avx512_bf16
#define CPATTN_VW 16
#define CPATTN_BF16_DOT 1
#include "kernel_impl.hpp"
#pragma GCC pop_options

namespace cpattn::kernels::avx512_bf16 {
const KernelTable table{.forward = forward_impl, .backward = backward_impl, .bf16_dot = bf16_dot_lanes};
}  // namespace cpattn::kernels::avx512_bf16
#endif  // __clang__
