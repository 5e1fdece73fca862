// Document boundaries of a packed (THD) batch and end-of-document padding (DESIGN.md 1-2).
//
// Boundaries come in two spellings, both accepted at the API's edge:
//   cu_seqlens, offsets with a leading 0:  [0, e1, ..., T]   (FlashAttention, TransformerEngine)
//   ends, without the 0:                   [e1, ..., T]      (Ascend's actual_seq_qlen)
// Inside cpattn everything is cu_seqlens. Valid boundaries hold at least one document, are
// strictly increasing (no empty document) and end at the token count T when T is given.
//
// Padding: for context parallelism of size cp every document of length L is padded at its
// tail to P = ceil(L / (2*cp)) * 2*cp tokens, so that it splits into 2*cp equal chunks.
//   cu_seqlens = [0, 5, 16], cp = 2  ->  cu_seqlens_padded = [0, 8, 20]
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace cpattn {

inline constexpr int64_t kUnknownTokens = -1;
// Limits that keep every count and offset of a plan inside int64: 2^48 tokens, cp <= 65536.
inline constexpr int64_t kMaxTokens = int64_t{1} << 48;
inline constexpr int kMaxCp = 65536;

// Throws cpattn::Error naming `name`, the position and the values when `cu_seqlens` breaks
// a rule: fewer than 2 entries, first entry not 0, a negative entry, an entry not greater
// than the one before (an empty document), or a last entry other than `total_tokens`
// (unless total_tokens is kUnknownTokens).
void check_cu_seqlens(std::span<const int64_t> cu_seqlens, int64_t total_tokens = kUnknownTokens,
                      std::string_view name = "cu_seqlens");

// Ends form -> cu_seqlens, validated as above (errors name `name` and its positions).
std::vector<int64_t> cu_seqlens_from_ends(std::span<const int64_t> ends,
                                          int64_t total_tokens = kUnknownTokens,
                                          std::string_view name = "ends");

// cu_seqlens -> ends form (drops the leading 0). Expects valid cu_seqlens.
std::vector<int64_t> ends_from_cu_seqlens(std::span<const int64_t> cu_seqlens);

// Document lengths -> cu_seqlens; every length must be >= 1.
std::vector<int64_t> cu_seqlens_from_lengths(std::span<const int64_t> lengths,
                                             std::string_view name = "lengths");

// Smallest multiple of 2*cp that is >= len.
constexpr int64_t padded_length(int64_t len, int cp) {
  const int64_t m = 2 * int64_t{cp};
  return (len + m - 1) / m * m;
}

// Checks 1 <= cp <= kMaxCp (naming `name`).
void check_cp_size(int cp, std::string_view name = "cp");

// cu_seqlens with every document padded at its tail to padded_length(L, cp).
std::vector<int64_t> pad_cu_seqlens(std::span<const int64_t> cu_seqlens, int cp);

}  // namespace cpattn
