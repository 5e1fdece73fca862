// The portable kernel path: kernel_impl.hpp compiled with 4-float vectors.
// Every header is included before the target switch (see kernel_impl.hpp).
#include "common.hpp"

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
