// Document boundaries of a packed (THD) batch and end-of-document padding (docs/design.md 1-2).
//
// Boundaries come in two spellings, both accepted at the API's edge:
//   cu_seqlens, offsets with a leading 0:  [0, e1, ..., T]   (FlashAttention, TransformerEngine)
//   ends, without the 0:                   [e1, ..., T]      (Ascend's actual_seq_qlen)
// Inside cpattn everything is cu_seqlens. Valid boundaries hold at least one document, are
// strictly increasing (no empty document) and end at the token count T when T is given.
//
// Padding: for context parallelism of size cp > 1 every document of length L is padded at its
// tail to P = ceil(L / (2*cp)) * 2*cp tokens, so that it splits into 2*cp equal chunks.
//   cu_seqlens = [0, 5, 16], cp = 2  ->  cu_seqlens_padded = [0, 8, 20]
// At cp = 1 there is one rank and one chunk per document (chunks_per_document(1) == 1): no
// padding, cu_seqlens_padded == cu_seqlens, as in a single-process FlashAttention varlen call.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace cpattn {

inline constexpr int64_t kUnknownTokens = -1;
// Limits that keep every token count and offset of a plan inside int64: 2^48 tokens, cp <=
// 65536. Work counts (pairs, and rect_work: a task's queries x keys) grow as the square of a
// document's length and can pass int64 below them (one document of about 3.04e9 tokens at
// cp = 1): the planner then fails with an error saying so (src/plan/plan_math.hpp).
inline constexpr int64_t kMaxTokens = int64_t{1} << 48;
inline constexpr int kMaxCp = 65536;

// Throws cpattn::Error naming `name`, the position and the values when `cu_seqlens` breaks
// a rule: fewer than 2 entries, first entry not 0, a negative entry, an entry not greater
// than the one before (an empty document), or a last entry other than `total_tokens`
// (unless total_tokens is kUnknownTokens).
void check_cu_seqlens(std::span<const int64_t> cu_seqlens, int64_t total_tokens = kUnknownTokens,
                      std::string_view name = "cu_seqlens");
// The same for int32 boundaries (what PyTorch and FlashAttention hand over): widened once to
// int64, then checked by the function above, with the same messages.
void check_cu_seqlens(std::span<const int32_t> cu_seqlens, int64_t total_tokens = kUnknownTokens,
                      std::string_view name = "cu_seqlens");

// Ends form -> cu_seqlens, validated as above (errors name `name` and its positions).
std::vector<int64_t> cu_seqlens_from_ends(std::span<const int64_t> ends,
                                          int64_t total_tokens = kUnknownTokens,
                                          std::string_view name = "ends");
std::vector<int64_t> cu_seqlens_from_ends(std::span<const int32_t> ends,
                                          int64_t total_tokens = kUnknownTokens,
                                          std::string_view name = "ends");

// int32 boundaries widened to int64 (no checks): the one conversion at the API's edge.
std::vector<int64_t> widen_boundaries(std::span<const int32_t> values);

// cu_seqlens -> ends form (drops the leading 0). Expects valid cu_seqlens.
std::vector<int64_t> ends_from_cu_seqlens(std::span<const int64_t> cu_seqlens);

// Document lengths -> cu_seqlens; every length must be >= 1.
std::vector<int64_t> cu_seqlens_from_lengths(std::span<const int64_t> lengths,
                                             std::string_view name = "lengths");

// How many chunks the split cuts every document into: 2*cp, except 1 at cp = 1 (one rank
// holds the whole document; nothing to balance, nothing to pad). Every part of the planner
// whose structure depends on the chunk count goes through this (and tasks_per_document in
// plan.hpp).
constexpr int64_t chunks_per_document(int cp) { return cp == 1 ? 1 : 2 * int64_t{cp}; }

// Smallest multiple of chunks_per_document(cp) that is >= len: 2*cp for cp > 1; len itself
// at cp = 1.
constexpr int64_t padded_length(int64_t len, int cp) {
  const int64_t m = chunks_per_document(cp);
  return (len + m - 1) / m * m;
}
static_assert(padded_length(3, 1) == 3 && padded_length(5, 2) == 8 && padded_length(7, 3) == 12);

// Checks 1 <= cp <= kMaxCp (naming `name`).
void check_cp_size(int cp, std::string_view name = "cp");

// cu_seqlens with every document padded at its tail to padded_length(L, cp).
std::vector<int64_t> pad_cu_seqlens(std::span<const int64_t> cu_seqlens, int cp);

}  // namespace cpattn
