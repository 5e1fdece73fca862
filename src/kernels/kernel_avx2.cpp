// The avx2 kernel path: kernel_impl.hpp compiled with 8-float vectors.
// Every header is included before the target switch (see kernel_impl.hpp).
#include "blocking.hpp"
#include "common.hpp"

#include <cpattn/dtype.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define CPATTN_KNS avx2
#define CPATTN_VW 8
#include "kernel_impl.hpp"
#pragma GCC pop_options

namespace cpattn::kernels::avx2 {
const KernelTable table{.forward = forward_impl, .backward = backward_impl};
}  // namespace cpattn::kernels::avx2
