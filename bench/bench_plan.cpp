// Planner speed (issue: under 5 ms per rank for 1,000,000 tokens in 10,000 documents at
// cp = 8; a cache hit that costs no more than hashing the boundaries).
//   build/release/bench/bench_plan --benchmark_repetitions=5 --benchmark_report_aggregates_only
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <benchmark/benchmark.h>

#include <random>
#include <vector>

namespace {

// 10,000 documents of random lengths summing to exactly 1,000,000 tokens.
std::vector<int64_t> million_token_batch(uint64_t seed = 42) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> lengths(10000, 1);
  for (int64_t left = 1000000 - 10000; left > 0; --left) ++lengths[rng() % lengths.size()];
  return cpattn::cu_seqlens_from_lengths(lengths);
}

const std::vector<int64_t>& batch() {
  static const std::vector<int64_t> cu = million_token_batch();
  return cu;
}
// Another batch of the same sizes, for the reused plans: planned in turn with batch(), each
// call plans a new batch, as a training loop does (a plan that already holds the batch keeps
// its layout: a loop over the ranks of one batch, not what these measure).
const std::vector<int64_t>& other_batch() {
  static const std::vector<int64_t> cu = million_token_batch(43);
  return cu;
}

void BM_PlanOneRank(benchmark::State& state) {
  const int rank = static_cast<int>(state.range(0));
  for (auto _ : state) {
    cpattn::RankPlan p = cpattn::get_thd_load_balanced_cp_metadata(batch(), 8, rank);
    benchmark::DoNotOptimize(p.kv_gather_index.data());
  }
  state.counters["tokens"] = static_cast<double>(batch().back());
}
BENCHMARK(BM_PlanOneRank)->DenseRange(0, 7)->Unit(benchmark::kMillisecond);

// The same into a reused plan: what a training loop that plans every new batch pays.
void BM_PlanOneRankReused(benchmark::State& state) {
  const int rank = static_cast<int>(state.range(0));
  cpattn::RankPlan p;
  bool other = false;
  for (auto _ : state) {
    cpattn::get_thd_load_balanced_cp_metadata((other = !other) ? other_batch() : batch(), 8, rank, p);
    benchmark::DoNotOptimize(p.kv_gather_index.data());
  }
}
BENCHMARK(BM_PlanOneRankReused)->DenseRange(0, 7)->Unit(benchmark::kMillisecond);

// The padding-free split into a reused plan: the slots' assignment by load comes on top.
void BM_PlanOneRankReusedPaddingFree(benchmark::State& state) {
  const int rank = static_cast<int>(state.range(0));
  cpattn::RankPlan p;
  bool other = false;
  for (auto _ : state) {
    cpattn::get_thd_load_balanced_cp_metadata((other = !other) ? other_batch() : batch(), 8, rank,
                                              {.split = cpattn::CpSplit::padding_free}, p);
    benchmark::DoNotOptimize(p.kv_gather_index.data());
  }
}
BENCHMARK(BM_PlanOneRankReusedPaddingFree)->DenseRange(0, 7)->Unit(benchmark::kMillisecond);

void BM_CacheHit(benchmark::State& state) {
  cpattn::PlanCache cache;
  for (int r = 0; r < 8; ++r) cache.get(batch(), 8, r);
  for (auto _ : state) benchmark::DoNotOptimize(cache.get(batch(), 8, 7).get());
}
BENCHMARK(BM_CacheHit)->Unit(benchmark::kMicrosecond);

void BM_HashBoundaries(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(cpattn::hash_boundaries(batch()));
}
BENCHMARK(BM_HashBoundaries)->Unit(benchmark::kMicrosecond);

void BM_BalanceReport(benchmark::State& state) {
  const auto split = static_cast<cpattn::CpSplit>(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(cpattn::balance_report(batch(), 8, split).ranks.data());
}
BENCHMARK(BM_BalanceReport)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

}  // namespace
