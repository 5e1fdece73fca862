// Machine profiles as JSON (docs/simulate.md "Profile format"): what `cpattn calibrate` writes
// and `cpattn simulate --profile` reads.
#pragma once

#include <cpattn/sim.hpp>

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace cpattn::cli {

// Reads and checks a profile; errors name the file and the field (profile.<path>) and the
// rule: a missing or non-numeric field, an unknown key or dtype, a negative value, a key given
// twice in one object.
MachineProfile read_profile(const std::string& path);
// The same checks on a profile's text (what read_profile reads; the fuzzer's entry), its errors
// starting with `where`.
MachineProfile parse_profile_text(std::string_view text, const std::string& where);
// The field checks alone, on parsed JSON (no duplicate-key check: the parser has dropped them).
MachineProfile parse_profile(const nlohmann::json& j, const std::string& where);
// The JSON form of `p` (rates of unknown dtypes left out), with `source` describing the numbers.
nlohmann::json profile_json(const MachineProfile& p, const std::string& source);

// The profile `simulate` uses without --profile: examples/profiles/gpu-8x-nvlink-400g.json's
// nominal numbers (tests/tools/test_cli_simulate.py holds the two equal).
MachineProfile default_profile();

}  // namespace cpattn::cli
