// The benchmarks' timing: the median of several timed runs after one untimed, and GFLOP/s of a
// callable at that time (the machine is shared and noisy: medians, never means).
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace cpattn::bench {

// The median of v (its upper middle when v has an even size); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds of fn(), the median of `repeats` timed runs after one untimed.
template <class Fn>
double median_seconds(int repeats, Fn&& fn) {
  using Clock = std::chrono::steady_clock;
  fn();
  std::vector<double> r;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = Clock::now();
    fn();
    r.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(r);
}

// GFLOP/s of fn(), which does `flops`, at median_seconds' time.
template <class Fn>
double gflops(int repeats, double flops, Fn&& fn) {
  return flops / median_seconds(repeats, fn) / 1e9;
}

}  // namespace cpattn::bench
