// Fuzzes the machine-profile JSON parser of `cpattn simulate --profile` (tools/sim_profile.cpp):
// any bytes are either rejected with a cpattn::Error (not JSON, a key twice in one object, a
// field missing or out of its rule), or parse to a valid profile that writes back to JSON
// parsing to the same profile. Seeds: the documented profiles in examples/profiles/.
#include <cpattn/error.hpp>
#include <cpattn/sim.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "sim_profile.hpp"

namespace {

bool same(const cpattn::MachineProfile& a, const cpattn::MachineProfile& b) {
  return a.name == b.name && a.fwd_gflops == b.fwd_gflops && a.bwd_gflops == b.bwd_gflops &&
         a.intra.bandwidth_gbs == b.intra.bandwidth_gbs && a.intra.latency_us == b.intra.latency_us &&
         a.inter.bandwidth_gbs == b.inter.bandwidth_gbs && a.inter.latency_us == b.inter.latency_us &&
         a.ranks_per_node == b.ranks_per_node && a.memory_gb == b.memory_gb && a.fwd_overhead == b.fwd_overhead &&
         a.bwd_overhead == b.bwd_overhead;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  cpattn::MachineProfile p;
  try {
    // read_profile's own path: the JSON parse, the duplicate-key check, the field checks.
    p = cpattn::cli::parse_profile_text(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const cpattn::Error&) {
    return 0;
  }
  // Accepted: valid, and its written form parses (no exception allowed here) to the same one.
  cpattn::check_machine_profile(p);
  const std::string text = cpattn::cli::profile_json(p, "fuzz round trip").dump();
  if (!same(cpattn::cli::parse_profile_text(text, "round trip"), p)) std::abort();
  return 0;
}
