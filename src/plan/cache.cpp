#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>

#include <algorithm>

namespace cpattn {

uint64_t hash_boundaries(std::span<const int64_t> cu_seqlens) {
  // A multiply-xorshift mix per entry: fast, and any change of any entry changes the hash
  // with overwhelming probability. The cache compares content on a match anyway.
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (cu_seqlens.size() * 0xC2B2AE3D27D4EB4Full);
  for (const int64_t v : cu_seqlens) {
    h ^= static_cast<uint64_t>(v) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 32;
  }
  return h;
}

PlanCache::PlanCache(std::size_t capacity) : capacity_(capacity) {
  CPATTN_CHECK(capacity >= 1, "PlanCache capacity must be >= 1, got ", capacity);
  entries_.reserve(capacity);
}

std::shared_ptr<const RankPlan> PlanCache::get(std::span<const int64_t> cu_seqlens, int cp, int rank,
                                               CpSplit split) {
  const uint64_t h = hash_boundaries(cu_seqlens);
  {
    std::lock_guard lock(mutex_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->hash == h && it->cp == cp && it->rank == rank && it->split == split &&
          std::ranges::equal(it->plan->cu_seqlens, cu_seqlens)) {
        ++hits_;
        std::rotate(it, it + 1, entries_.end());  // most recently used goes last
        return entries_.back().plan;
      }
    }
    ++misses_;
  }
  // Plan outside the lock: planning is pure, and a racing miss at worst plans twice.
  auto plan = std::make_shared<const RankPlan>(
      get_thd_load_balanced_cp_metadata(cu_seqlens, cp, rank, PlanOptions{.split = split}));
  std::lock_guard lock(mutex_);
  if (entries_.size() == capacity_) entries_.erase(entries_.begin());  // least recently used
  entries_.push_back(Entry{h, cp, rank, split, plan});
  return plan;
}

std::shared_ptr<const RankPlan> PlanCache::get(std::span<const int32_t> cu_seqlens, int cp, int rank,
                                               CpSplit split) {
  // Keyed by the widened values: the same hash and content as the int64 spelling.
  const std::vector<int64_t> wide = widen_boundaries(cu_seqlens);
  return get(std::span<const int64_t>(wide), cp, rank, split);
}

std::size_t PlanCache::size() const {
  std::lock_guard lock(mutex_);
  return entries_.size();
}
int64_t PlanCache::hits() const {
  std::lock_guard lock(mutex_);
  return hits_;
}
int64_t PlanCache::misses() const {
  std::lock_guard lock(mutex_);
  return misses_;
}
void PlanCache::clear() {
  std::lock_guard lock(mutex_);
  entries_.clear();
  hits_ = misses_ = 0;
}

}  // namespace cpattn
