// Fuzzes the training checkpoint reader (src/train/checkpoint.cpp) against two small runs'
// configurations, a dense model and one with experts (make_checkpoint_seeds.py writes the
// seeds for the same ones). The first byte picks the mode: bit 0 set, the checksum of the rest
// is recomputed first, so that the fuzzer gets past it to the configuration and value checks
// (else the bytes are read as they are); bit 1 set, the model with experts is the run's. Any
// bytes either raise cpattn::Error or parse to a state that holds only finite weights and
// moments (second moments >= 0), a non-negative step and data position and at most `step`
// skipped steps, and that formats back to exactly the bytes read (a version 3 to 5 file: to a
// version 6 file that reads back to the same state).
#include <cpattn/error.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "checkpoint.hpp"
#include "checkpoint_seed_configs.hpp"

namespace {

using namespace cpattn::train;

// The runs every input is read against (make_checkpoint_seeds.py's DENSE and MOE).
using seed_configs::kDense;
using seed_configs::kMoe;

// checkpoint.hpp's layout: magic, version, count, the fields, the checksum, then the payload.
void fix_checksum(std::vector<std::byte>& f) {
  if (f.size() < 24) return;
  int64_t count = 0;
  std::memcpy(&count, f.data() + 16, 8);
  if (count < 0 || count > 1024) return;
  const std::size_t header = 8 + 8 * (2 + static_cast<std::size_t>(count)) + 8;
  if (f.size() < header) return;
  uint64_t h = fnv1a64(std::span(f.data() + 8, header - 16));
  h = fnv1a64(std::span(f.data() + header, f.size() - header), h);
  std::memcpy(f.data() + header - 8, &h, 8);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  std::vector<std::byte> file(bytes + 1, bytes + size);
  if (data[0] & 1) fix_checksum(file);
  const CheckpointConfig& cfg = (data[0] & 2) ? kMoe : kDense;
  try {
    const CheckpointState s = parse_checkpoint(file, "fuzz", cfg);
    if (s.step < 0 || s.skipped < 0 || s.skipped > s.step || s.data.doc < 0 || s.data.offset < 0 || s.data.epoch < 0) std::abort();
    if (s.params.size() != static_cast<std::size_t>(cfg.n_params) || s.m.size() != s.params.size() ||
        s.v.size() != s.params.size())
      std::abort();
    for (std::size_t i = 0; i < s.params.size(); ++i)
      if (!std::isfinite(s.params[i]) || !std::isfinite(s.m[i]) || !std::isfinite(s.v[i]) || s.v[i] < 0) std::abort();
    CheckpointConfig as_read = cfg;  // (micro as the file has it: 0, not recorded, matches any run)
    as_read.id.micro = s.micro;
    const std::vector<std::byte> again = format_checkpoint(as_read, s.step, s.skipped, s.data, s.params, s.m, s.v);
    int64_t version = 0;
    std::memcpy(&version, file.data() + 8, 8);  // parsed: at least the magic, version and count
    if (version == 6 && again != file) std::abort();
    CheckpointState t;
    try {  // what this cpattn writes, it reads: an error here is the reader's or the writer's bug
      t = parse_checkpoint(again, "fuzz", as_read);
    } catch (const cpattn::Error&) {
      std::abort();
    }
    if (t.step != s.step || t.skipped != s.skipped || !(t.data == s.data) || t.params != s.params || t.m != s.m || t.v != s.v) std::abort();
  } catch (const cpattn::Error&) {
  }
  return 0;
}
