// The kernels' scratch cache (common.hpp, scratch_allocate): large blocks freed by one call are
// kept for the next one, so that a training loop's kernel calls do not page-fault and zero
// their scratch afresh in the kernel every time (on the AMX Xeon of docs/benchmarks.md page
// faults were 20-25% of a packed batch's samples).
#include "common.hpp"

#include <cpattn/attention.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <new>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define CPATTN_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define CPATTN_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define CPATTN_POISON(p, n) ((void)(p), (void)(n))
#define CPATTN_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace cpattn::kernels {
namespace {

constexpr size_t kAlign = 64;
// Smaller blocks go straight to operator new: malloc's own bins serve them without faults.
constexpr size_t kMinCached = size_t{256} << 10;

// The size class of a cached block: bytes rounded up to an eighth of its power of two, so
// that calls whose shapes differ a little reuse each other's blocks (at most 12.5% of a
// block's address space unused; pages never touched are never resident).
size_t size_class(size_t bytes) {
  const int top = 63 - __builtin_clzll(bytes);
  const size_t step = size_t{1} << (top - 3);
  return (bytes + step - 1) / step * step;
}

// Blocks freed and kept, and the bytes of cached-class blocks in use. The cache never holds
// more than the most scratch that was ever in use at once (high_water): a process keeps at
// most what its largest call needed, as it would between two such calls without the cache.
struct Cache {
  struct Block {
    void* p;
    size_t bytes;
    uint64_t stamp;  // when it was freed: the oldest goes first
  };
  std::mutex mu;
  std::vector<Block> free;
  size_t cached = 0, live = 0, high_water = 0;
  uint64_t clock = 0;

  void evict_oldest() {  // mu held, free not empty
    auto it = std::min_element(free.begin(), free.end(),
                               [](const Block& a, const Block& b) { return a.stamp < b.stamp; });
    CPATTN_UNPOISON(it->p, it->bytes);
    ::operator delete(it->p, std::align_val_t{kAlign});
    cached -= it->bytes;
    *it = free.back();
    free.pop_back();
  }
};

// AddressSanitizer: the bytes past the request (from the next 8-byte granule) to the end of
// its size class stay unaddressable, so that an overrun is reported as without the cache.
void poison_tail(void* p, size_t bytes, size_t cls) {
  const size_t used = (bytes + 7) / 8 * 8;
  if (used < cls) CPATTN_POISON(static_cast<std::byte*>(p) + used, cls - used);
}

// Never destroyed: thread-local vectors of other threads may free into it at any time.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

}  // namespace

void* scratch_allocate(size_t bytes) {
  if (bytes < kMinCached) return ::operator new(bytes, std::align_val_t{kAlign});
  const size_t cls = size_class(bytes);
  Cache& c = cache();
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    Cache::Block* best = nullptr;
    for (Cache::Block& b : c.free)
      if (b.bytes == cls && (!best || b.stamp > best->stamp)) best = &b;
    if (best) {
      void* p = best->p;
      c.cached -= cls;
      *best = c.free.back();
      c.free.pop_back();
      c.live += cls;
      CPATTN_UNPOISON(p, cls);
      poison_tail(p, bytes, cls);
      return p;
    }
    // A miss: the blocks of other sizes go first where keeping them would take the process
    // past its high-water mark. The block is counted live before it is allocated, under the
    // lock, so that concurrent misses see each other: cached + live never pass high_water.
    while (!c.free.empty() && c.cached + c.live + cls > std::max(c.high_water, c.live + cls)) c.evict_oldest();
    c.live += cls;
    c.high_water = std::max(c.high_water, c.live);
  }
  void* p = nullptr;
  try {
    p = ::operator new(cls, std::align_val_t{kAlign});
  } catch (...) {
    const std::lock_guard<std::mutex> lock(c.mu);
    c.live -= cls;
    throw;
  }
  poison_tail(p, bytes, cls);
  return p;
}

void scratch_free(void* p, size_t bytes) noexcept {
  if (!p) return;
  if (bytes < kMinCached) {
    ::operator delete(p, std::align_val_t{kAlign});
    return;
  }
  const size_t cls = size_class(bytes);
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mu);
  c.live -= cls;
  try {
    c.free.push_back({p, cls, ++c.clock});
  } catch (...) {  // no room to remember it: give it back
    ::operator delete(p, std::align_val_t{kAlign});
    return;
  }
  c.cached += cls;
  CPATTN_POISON(p, cls);  // a kernel that used scratch after freeing it is still caught
}

}  // namespace cpattn::kernels

namespace cpattn {

size_t kernel_scratch_cached_bytes() {
  kernels::Cache& c = kernels::cache();
  const std::lock_guard<std::mutex> lock(c.mu);
  return c.cached;
}

void release_kernel_scratch() {
  kernels::Cache& c = kernels::cache();
  const std::lock_guard<std::mutex> lock(c.mu);
  while (!c.free.empty()) c.evict_oldest();
}

}  // namespace cpattn
