// Fuzzes the machine-profile JSON parser of `cpattn simulate --profile` (tools/sim_profile.cpp):
// any bytes are either not JSON, or rejected with a cpattn::Error naming the field, or parse
// to a valid profile that writes back to JSON parsing to the same profile. Seeds: the
// documented profiles in examples/profiles/.
#include <cpattn/error.hpp>
#include <cpattn/sim.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>

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
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(data, data + size);
  } catch (const nlohmann::json::exception&) {
    return 0;  // not JSON: read_profile's "not valid JSON" error
  }
  cpattn::MachineProfile p;
  try {
    p = cpattn::cli::parse_profile(j, "fuzz");
  } catch (const cpattn::Error&) {
    return 0;
  }
  // Accepted: valid, and its written form parses (no exception allowed here) to the same one.
  cpattn::check_machine_profile(p);
  const std::string text = cpattn::cli::profile_json(p, "fuzz round trip").dump();
  if (!same(cpattn::cli::parse_profile(nlohmann::json::parse(text), "round trip"), p)) std::abort();
  return 0;
}
