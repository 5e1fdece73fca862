// The machine profile of the simulator's tests: rates and links simple enough to work times
// out by hand (tests/sim/test_sim.cpp); the byte and memory counts do not depend on them
// (tests/sim/test_sim_bytes.cpp).
#pragma once

#include <cpattn/sim.hpp>

namespace cpattn::testing {

// One node of two ranks: 1 GB/s and 10 us between them (0.1 GB/s and 100 us between nodes);
// 1 GFLOP/s forward, 0.5 backward; 1 GB per rank.
inline MachineProfile hand_profile() {
  return {.name = "hand",
          .fwd_gflops = {1, 1, 1},
          .bwd_gflops = {0.5, 0.5, 0.5},
          .intra = {.bandwidth_gbs = 1, .latency_us = 10},
          .inter = {.bandwidth_gbs = 0.1, .latency_us = 100},
          .ranks_per_node = 2,
          .memory_gb = 1};
}

}  // namespace cpattn::testing
