#include <cpattn/error.hpp>
#include <cpattn/memory.hpp>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>

namespace cpattn {
namespace {

constexpr uint64_t kUnknown = std::numeric_limits<uint64_t>::max();

// The first number in the file at `path` ("max" and unreadable files: nullopt).
std::optional<uint64_t> read_number(const char* path) {
  std::ifstream in(path);
  uint64_t v = 0;
  if (in >> v) return v;
  return std::nullopt;
}

// MemAvailable from /proc/meminfo, in bytes.
std::optional<uint64_t> mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return saturating_mul(kib, 1024);
  }
  return std::nullopt;
}

// The cgroup's limit less its usage: v2 first, then v1 (whose "no limit" is a huge number).
std::optional<uint64_t> cgroup_headroom() {
  const struct {
    const char *limit, *usage;
  } files[] = {{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
               {"/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"}};
  for (const auto& f : files) {
    const std::optional<uint64_t> limit = read_number(f.limit);
    if (!limit || *limit >= (uint64_t{1} << 62)) continue;
    const uint64_t usage = read_number(f.usage).value_or(0);
    return usage < *limit ? *limit - usage : 0;
  }
  return std::nullopt;
}

}  // namespace

uint64_t saturating_mul(uint64_t a, uint64_t b) {
  return b != 0 && a > kUnknown / b ? kUnknown : a * b;
}
uint64_t saturating_add(uint64_t a, uint64_t b) { return a > kUnknown - b ? kUnknown : a + b; }

AvailableMemory available_memory() {
  AvailableMemory m{kUnknown, "unknown"};
  const auto lower = [&m](std::optional<uint64_t> v, const char* source) {
    if (v && *v < m.bytes) m = {*v, source};
  };
  lower(mem_available(), "MemAvailable in /proc/meminfo");
  lower(cgroup_headroom(), "the cgroup's memory limit less its usage");
  if (const char* env = std::getenv("CPATTN_MEMORY_LIMIT_BYTES"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(env, &end, 10);
    CPATTN_CHECK(errno == 0 && end != env && *end == '\0' && env[0] != '-',
                 "CPATTN_MEMORY_LIMIT_BYTES must be a number of bytes, got '", env, "'");
    lower(static_cast<uint64_t>(v), "CPATTN_MEMORY_LIMIT_BYTES");
  }
  return m;
}

std::string format_bytes(uint64_t bytes) {
  if (bytes == kUnknown) return "more than 16 EiB";
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 6) v /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

void check_memory(uint64_t needed, std::string_view what, std::string_view detail,
                  const AvailableMemory& available) {
  CPATTN_CHECK(needed <= available.bytes, what, " needs ", format_bytes(needed), " (", detail, "), more than the ",
               format_bytes(available.bytes), " available (", available.source, ")");
}

}  // namespace cpattn
