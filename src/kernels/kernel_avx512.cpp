// The avx512 kernel path: kernel_impl.hpp compiled with 16-float vectors.
// Every header is included before the target switch (see kernel_impl.hpp).
#include "common.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
#define CPATTN_KNS avx512
#define CPATTN_VW 16
#include "kernel_impl.hpp"
