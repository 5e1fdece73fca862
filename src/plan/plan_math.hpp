// Closed forms for counting causal work, shared by the planner and the balance report.
#pragma once

#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>

#include <algorithm>
#include <cstdint>

namespace cpattn::detail {

// Visible (query, key) pairs when q_len queries at positions q_pos .. q_pos+q_len-1 attend
// causally to the keys at positions 0 .. kv_len-1: sum over i of min(q_pos + i + 1, kv_len).
constexpr int64_t visible_pairs_prefix(int64_t q_pos, int64_t q_len, int64_t kv_len) {
  // Queries whose causal prefix fits inside the keys see q_pos+i+1 keys; the rest see kv_len.
  const int64_t full = std::clamp<int64_t>(kv_len - q_pos, 0, q_len);
  const int64_t a = q_pos + 1, b = q_pos + full;  // arithmetic series a..b
  return (full > 0 ? (a + b) * full / 2 : 0) + (q_len - full) * kv_len;
}
static_assert(visible_pairs_prefix(0, 4, 4) == 10);   // 1+2+3+4
static_assert(visible_pairs_prefix(4, 4, 8) == 26);   // 5+6+7+8
static_assert(visible_pairs_prefix(0, 3, 2) == 5);    // 1+2+2 (keys end first)

// Work counts grow as the square of document lengths: a batch with documents of billions of
// tokens can overflow int64. These fail with a clear error instead.
inline int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  CPATTN_CHECK(!__builtin_mul_overflow(a, b, &r), "work count overflows int64 (", a, " * ", b,
               "): a document's attention work (its visible pairs, or a task's queries x keys, which grow as "
               "the square of its length) is too large to count");
  return r;
}
inline void checked_add(int64_t& acc, int64_t v) {
  CPATTN_CHECK(!__builtin_add_overflow(acc, v, &acc), "work count overflows int64 (", acc, " + ", v,
               "): the batch's attention pairs cannot be counted");
}
// visible_pairs_prefix with overflow checks, for any input the planner accepts.
inline int64_t checked_visible_pairs(int64_t q_pos, int64_t q_len, int64_t kv_len) {
  const int64_t full = std::clamp<int64_t>(kv_len - q_pos, 0, q_len);
  const int64_t a = q_pos + 1, b = q_pos + full;
  // (a + b) * full / 2 with one factor halved first: a + b and full are not both odd.
  const int64_t series = full == 0 ? 0 : (full % 2 == 0 ? checked_mul(a + b, full / 2) : checked_mul((a + b) / 2, full));
  int64_t total = series;
  checked_add(total, checked_mul(q_len - full, kv_len));
  return total;
}

// Real work of one task of a document with `len` real tokens: its queries at positions
// q_pos .. q_pos+q_len-1 over its keys at positions 0 .. kv_len-1, with the positions at or
// past `len` (padding) cut out of both, as without_padding cuts them. rect_work = real
// queries * real keys; visible_pairs = the causal pairs among real positions (a real query at
// p sees keys 0..p, all real, so clipping kv_len to len changes nothing for it).
inline Workload real_task_work(int64_t q_pos, int64_t q_len, int64_t kv_len, int64_t len) {
  const int64_t q_real = std::clamp<int64_t>(len - q_pos, 0, q_len);
  const int64_t kv_real = std::min(kv_len, len);
  if (q_real == 0) return {};
  return {.rect_work = checked_mul(q_real, kv_real),
          .visible_pairs = checked_visible_pairs(q_pos, q_real, kv_real)};
}

}  // namespace cpattn::detail
