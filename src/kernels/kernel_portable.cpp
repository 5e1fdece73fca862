// The portable kernel path: kernel_impl.hpp compiled with 4-float vectors, the x86-64 baseline (no target switch).
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

#define CPATTN_KNS portable
#define CPATTN_VW 4
#include "kernel_impl.hpp"

namespace cpattn::kernels::portable {
const KernelTable table{.forward = forward_impl, .backward = backward_impl};
}  // namespace cpattn::kernels::portable
