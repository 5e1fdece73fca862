#include <cpattn/tensor.hpp>

#include <cmath>
#include <cstddef>
#include <sstream>
#include <vector>

namespace cpattn {

std::optional<ElementIndex> first_nonfinite(ConstTensorView t) {
  std::vector<float> row(static_cast<std::size_t>(t.dim));
  const std::size_t es = dtype_size(t.dtype);
  for (int64_t i = 0; i < t.rows; ++i)
    for (int h = 0; h < t.heads; ++h) {
      to_float(static_cast<const std::byte*>(t.data) + t.offset(i, h) * es, t.dtype, row.size(), row.data());
      for (int d = 0; d < t.dim; ++d)
        if (!std::isfinite(row[static_cast<std::size_t>(d)])) return ElementIndex{i, h, d};
    }
  return std::nullopt;
}

std::string describe_element(const char* name, float value, int64_t token, const ElementIndex& at) {
  std::ostringstream os;
  os << name << " holds " << value << " at token " << token << ", head " << at.head << ", dim " << at.dim;
  return os.str();
}

}  // namespace cpattn
