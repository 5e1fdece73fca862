// The all-to-all groups' head split (include/cpattn/cp_scheme.hpp).
#include <cpattn/cp_scheme.hpp>
#include <cpattn/error.hpp>

#include <algorithm>

namespace cpattn {

std::string head_split_error(int num_heads_q, int num_heads_k, int inner) {
  const std::string n = std::to_string(inner);
  if (num_heads_q % inner != 0)
    return "num_heads_q = " + std::to_string(num_heads_q) + " must be divisible by the all-to-all group size " + n +
           " (each rank runs num_heads_q / " + n + " query heads)";
  if (num_heads_k % inner != 0 && inner % num_heads_k != 0)
    return "num_heads_k = " + std::to_string(num_heads_k) + " must be divisible by the all-to-all group size " + n +
           " (split KV heads) or divide it (replicated KV heads)";
  return "";
}

HeadSplit head_split(int num_heads_q, int num_heads_k, int inner, std::string_view what) {
  const std::string why = head_split_error(num_heads_q, num_heads_k, inner);
  CPATTN_CHECK(why.empty(), what, ": ", why);
  return {.inner = inner, .hq = num_heads_q, .hkv = num_heads_k};
}

int overlap_kv_groups(int num_heads_k) {
  int groups = std::min(num_heads_k, 4);  // more groups: more progress points, smaller kernel calls
  while (groups > 1 && num_heads_k % groups != 0) --groups;
  return std::max(groups, 1);
}

}  // namespace cpattn
