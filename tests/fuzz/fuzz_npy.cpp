// Fuzzes the .npy reader: any bytes either raise cpattn::Error or parse to an array whose data
// matches its shape, and which formats back to a file that parses to the same array.
#include <cpattn/error.hpp>
#include <cpattn/npy.hpp>

#include <cstdint>
#include <cstdlib>
#include <span>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const cpattn::NpyArray a = cpattn::parse_npy(std::as_bytes(std::span(data, size)), "fuzz");
    if (static_cast<size_t>(a.elements()) * a.element_size() != a.data.size()) std::abort();
    if (a.data.size() <= (1 << 20)) {
      const cpattn::NpyArray b = cpattn::parse_npy(cpattn::format_npy(a), "again");
      if (b.shape != a.shape || b.data != a.data || b.type != a.type) std::abort();
      (void)a.as_float();
    }
  } catch (const cpattn::Error&) {
  }
  return 0;
}
