// Memory budgets: what the machine has available, and a refusal with both sizes when a request
// needs more, made before anything is allocated (instead of std::bad_alloc or the OOM killer
// half way through a run). The estimates of what a request needs live beside what they size
// (cp_memory_estimate in cp.hpp); the commands add their own tensors to them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace cpattn {

struct AvailableMemory {
  uint64_t bytes = 0;       // what this process may still allocate
  std::string source;       // where `bytes` comes from, for messages
};

// The smaller of /proc/meminfo's MemAvailable and the cgroup's limit less its usage (cgroup v2
// memory.max - memory.current, else v1 memory.limit_in_bytes - memory.usage_in_bytes); where
// neither can be read, UINT64_MAX ("unknown", nothing is refused). The environment variable
// CPATTN_MEMORY_LIMIT_BYTES, when set, lowers it further (tests, and users who share a node).
AvailableMemory available_memory();

// "12.3 GiB", "512.0 MiB", "4.0 KiB", "17 B": sizes in messages.
std::string format_bytes(uint64_t bytes);

// Throws cpattn::Error "<what> needs <needed> (<detail>), more than the <available> available
// (<source>)" when needed > available.bytes; `detail` says what makes up `needed`.
void check_memory(uint64_t needed, std::string_view what, std::string_view detail,
                  const AvailableMemory& available = available_memory());

// a * b + ..., saturating at UINT64_MAX instead of wrapping (sizes of absurd requests).
uint64_t saturating_mul(uint64_t a, uint64_t b);
uint64_t saturating_add(uint64_t a, uint64_t b);

}  // namespace cpattn
