#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>

#include <algorithm>

namespace cpattn {

void check_cu_seqlens(std::span<const int64_t> cu_seqlens, int64_t total_tokens,
                      std::string_view name) {
  CPATTN_CHECK(cu_seqlens.size() >= 2, name, " must hold at least one document ([0, T]), got ",
               cu_seqlens.size(), " entries");
  CPATTN_CHECK(cu_seqlens[0] == 0, name, "[0] must be 0, got ", cu_seqlens[0]);
  for (std::size_t i = 1; i < cu_seqlens.size(); ++i) {
    CPATTN_CHECK(cu_seqlens[i] >= 0, name, "[", i, "] must not be negative, got ", cu_seqlens[i]);
    CPATTN_CHECK(cu_seqlens[i] <= kMaxTokens, name, "[", i, "] = ", cu_seqlens[i],
                 " exceeds the largest supported token count ", kMaxTokens);
    CPATTN_CHECK(cu_seqlens[i] > cu_seqlens[i - 1], name, " must be strictly increasing (no empty ",
                 "document), but ", name, "[", i - 1, "] = ", cu_seqlens[i - 1], " and ", name, "[",
                 i, "] = ", cu_seqlens[i]);
  }
  CPATTN_CHECK(total_tokens == kUnknownTokens || cu_seqlens.back() == total_tokens, name,
               " must end at the token count ", total_tokens, ", but its last entry ", name, "[",
               cu_seqlens.size() - 1, "] is ", cu_seqlens.back());
}

std::vector<int64_t> widen_boundaries(std::span<const int32_t> values) {
  return {values.begin(), values.end()};
}

void check_cu_seqlens(std::span<const int32_t> cu_seqlens, int64_t total_tokens,
                      std::string_view name) {
  check_cu_seqlens(std::span<const int64_t>(widen_boundaries(cu_seqlens)), total_tokens, name);
}

std::vector<int64_t> cu_seqlens_from_ends(std::span<const int32_t> ends, int64_t total_tokens,
                                          std::string_view name) {
  return cu_seqlens_from_ends(std::span<const int64_t>(widen_boundaries(ends)), total_tokens, name);
}

std::vector<int64_t> cu_seqlens_from_ends(std::span<const int64_t> ends, int64_t total_tokens,
                                          std::string_view name) {
  CPATTN_CHECK(!ends.empty(), name, " must hold at least one document end, got none");
  // Check in the caller's own indexing so that a message points at the entry they wrote.
  for (std::size_t i = 0; i < ends.size(); ++i) {
    CPATTN_CHECK(ends[i] >= 0, name, "[", i, "] must not be negative, got ", ends[i]);
    CPATTN_CHECK(ends[i] <= kMaxTokens, name, "[", i, "] = ", ends[i],
                 " exceeds the largest supported token count ", kMaxTokens);
    const int64_t prev = i == 0 ? 0 : ends[i - 1];
    CPATTN_CHECK(ends[i] > prev, name, " must be strictly increasing from 0 (no empty document), ",
                 "but ", name, "[", i, "] = ", ends[i], " follows ", prev);
  }
  CPATTN_CHECK(total_tokens == kUnknownTokens || ends.back() == total_tokens, name,
               " must end at the token count ", total_tokens, ", but its last entry ", name, "[",
               ends.size() - 1, "] is ", ends.back());
  std::vector<int64_t> cu(ends.size() + 1, 0);
  std::copy(ends.begin(), ends.end(), cu.begin() + 1);
  return cu;
}

std::vector<int64_t> ends_from_cu_seqlens(std::span<const int64_t> cu_seqlens) {
  if (cu_seqlens.empty()) return {};
  return {cu_seqlens.begin() + 1, cu_seqlens.end()};
}

std::vector<int64_t> cu_seqlens_from_lengths(std::span<const int64_t> lengths,
                                             std::string_view name) {
  CPATTN_CHECK(!lengths.empty(), name, " must hold at least one document, got none");
  std::vector<int64_t> cu(lengths.size() + 1, 0);
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    CPATTN_CHECK(lengths[i] >= 1, name, "[", i, "] must be >= 1 (no empty document), got ",
                 lengths[i]);
    CPATTN_CHECK(lengths[i] <= kMaxTokens - cu[i], name, " add up to more than the largest supported token count ",
                 kMaxTokens, " at ", name, "[", i, "]");
    cu[i + 1] = cu[i] + lengths[i];
  }
  return cu;
}

void check_cp_size(int cp, std::string_view name) {
  CPATTN_CHECK(cp >= 1, name, " must be >= 1, got ", cp);
  CPATTN_CHECK(cp <= kMaxCp, name, " must be <= ", kMaxCp, ", got ", cp);
}

std::vector<int64_t> pad_cu_seqlens(std::span<const int64_t> cu_seqlens, int cp) {
  check_cu_seqlens(cu_seqlens);
  check_cp_size(cp);
  std::vector<int64_t> padded(cu_seqlens.size(), 0);
  for (std::size_t i = 1; i < cu_seqlens.size(); ++i)
    padded[i] = padded[i - 1] + padded_length(cu_seqlens[i] - cu_seqlens[i - 1], cp);
  return padded;
}

}  // namespace cpattn
