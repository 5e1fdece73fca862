// The avx2 kernel path: kernel_impl.hpp compiled with 8-float vectors.
// Every header is included before the target switch (see kernel_impl.hpp).
#include "common.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#pragma GCC target("avx2,fma,f16c")
#define CPATTN_KNS avx2
#define CPATTN_VW 8
#include "kernel_impl.hpp"
