#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>

#include <gtest/gtest.h>

#include <vector>

namespace cpattn {
namespace {

using V = std::vector<int64_t>;

TEST(PlanCache, HitOnEqualContentMissAfterAnyChange) {
  PlanCache cache;
  EXPECT_EQ(cache.capacity(), 8u);
  V cu{0, 16, 40};
  const auto a = cache.get(cu, 2, 0);
  EXPECT_EQ(cache.misses(), 1);
  EXPECT_EQ(cache.hits(), 0);
  const V copy = cu;  // equal content in another buffer is a hit
  const auto b = cache.get(copy, 2, 0);
  EXPECT_EQ(a.get(), b.get());
  EXPECT_EQ(cache.hits(), 1);

  // Changing the boundaries in place (the same buffer) must miss, and the new plan must be
  // for the new content: a cache that keyed by address would return a stale plan here.
  cu[1] = 20;
  const auto c = cache.get(cu, 2, 0);
  EXPECT_EQ(cache.misses(), 2);
  EXPECT_EQ(c->cu_seqlens, cu);
  EXPECT_EQ(c->actual_seq_kvlen, get_thd_load_balanced_cp_metadata(cu, 2, 0).actual_seq_kvlen);
  EXPECT_EQ(a->cu_seqlens, (V{0, 16, 40}));  // a held plan is untouched

  cache.get(cu, 2, 1);  // other rank
  cache.get(cu, 4, 0);  // other cp
  EXPECT_EQ(cache.misses(), 4);
  EXPECT_EQ(cache.size(), 4u);
}

TEST(PlanCache, EvictsTheLeastRecentlyUsedPastCapacity) {
  PlanCache cache(3);
  const V b1{0, 8}, b2{0, 16}, b3{0, 24}, b4{0, 32};
  cache.get(b1, 2, 0);
  cache.get(b2, 2, 0);
  cache.get(b3, 2, 0);
  cache.get(b1, 2, 0);  // b1 is now the most recent; b2 the least
  EXPECT_EQ(cache.hits(), 1);
  cache.get(b4, 2, 0);  // evicts b2
  EXPECT_EQ(cache.size(), 3u);
  cache.get(b1, 2, 0);
  cache.get(b3, 2, 0);
  EXPECT_EQ(cache.hits(), 3);
  cache.get(b2, 2, 0);
  EXPECT_EQ(cache.misses(), 5);
}

TEST(PlanCache, ClearDropsEntriesAndCounters) {
  PlanCache cache;
  const V cu{0, 8};
  const auto held = cache.get(cu, 1, 0);
  cache.get(cu, 1, 0);
  cache.clear();
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(cache.hits(), 0);
  EXPECT_EQ(cache.misses(), 0);
  cache.get(cu, 1, 0);
  EXPECT_EQ(cache.misses(), 1);
  EXPECT_EQ(held->local_tokens, 8);  // still valid after clear
}

TEST(PlanCache, InvalidInputIsNotCached) {
  PlanCache cache;
  EXPECT_THROW(cache.get(V{0, 8, 8}, 2, 0), Error);
  EXPECT_THROW(PlanCache(0), Error);
  EXPECT_EQ(cache.size(), 0u);
}

TEST(PlanCache, Int32AndInt64SpellingsShareAnEntry) {
  PlanCache cache;
  const std::vector<int32_t> cu32{0, 5, 16, 40};
  const V cu64{0, 5, 16, 40};
  const auto a = cache.get(cu32, 2, 1);
  EXPECT_EQ(cache.misses(), 1);
  const auto b = cache.get(cu64, 2, 1);  // the same boundaries in int64: a hit
  EXPECT_EQ(a.get(), b.get());
  EXPECT_EQ(cache.hits(), 1);
  EXPECT_EQ(cache.get(cu32, 2, 1).get(), a.get());
  EXPECT_EQ(cache.hits(), 2);
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(a->cu_seqlens, cu64);
  EXPECT_EQ(a->kv_gather_index, get_thd_load_balanced_cp_metadata(cu64, 2, 1).kv_gather_index);
  const std::vector<int32_t> other{0, 5, 17, 40};
  EXPECT_NE(cache.get(other, 2, 1).get(), a.get());
  EXPECT_EQ(cache.misses(), 2);
  EXPECT_THROW(cache.get(std::vector<int32_t>{0, 8, 8}, 2, 0), Error);
  EXPECT_EQ(cache.size(), 2u);
}

TEST(PlanCache, HashSeesEveryEntry) {
  EXPECT_NE(hash_boundaries(V{0, 16, 40}), hash_boundaries(V{0, 17, 40}));
  EXPECT_NE(hash_boundaries(V{0, 16, 40}), hash_boundaries(V{0, 16, 41}));
  EXPECT_NE(hash_boundaries(V{0, 40}), hash_boundaries(V{0, 16, 40}));
}

}  // namespace
}  // namespace cpattn
