// Fuzzes `cpattn plan --lengths-file`'s reader (tools/cmd_plan.cpp), the file input that
// fuzz_cli leaves out (it keeps to flags): any text either raises cpattn::Error or gives
// lengths >= 1 that, written back one per line, read back the same; their boundaries are
// then either refused (a total past the planner's bound) or end at their sum.
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>

#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::istringstream text(std::string(reinterpret_cast<const char*>(data), size));
  try {
    const std::vector<int64_t> lengths = cpattn::cli::parse_lengths_file(text, "fuzz");
    if (lengths.empty()) std::abort();
    std::ostringstream again;
    for (const int64_t l : lengths) {
      if (l < 1) std::abort();
      again << l << '\n';
    }
    std::istringstream back(again.str());
    if (cpattn::cli::parse_lengths_file(back, "again") != lengths) std::abort();
    try {
      const std::vector<int64_t> cu = cpattn::cu_seqlens_from_lengths(lengths, "--lengths-file");
      int64_t sum = 0;
      for (const int64_t l : lengths) sum += l;  // cu_seqlens_from_lengths bounds the total first
      if (cu.size() != lengths.size() + 1 || cu.front() != 0 || cu.back() != sum) std::abort();
    } catch (const cpattn::Error&) {
    }
  } catch (const cpattn::Error&) {
  }
  return 0;
}
