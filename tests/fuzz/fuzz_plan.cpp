// Fuzzes boundary validation and the planner: any input either raises cpattn::Error or gives
// a plan that keeps docs/design.md's invariants. Input: 2 bytes (cp, rank), then int64 boundaries
// (ends form when the first byte is odd).
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#define FUZZ_ASSERT(cond) \
  do {                    \
    if (!(cond)) std::abort(); \
  } while (0)

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int cp = data[0] % 20 - 2;  // includes invalid values
  const int rank = data[1] % 24 - 2;
  std::vector<int64_t> values((size - 2) / 8);
  if (!values.empty()) std::memcpy(values.data(), data + 2, values.size() * 8);
  // Keep token counts small enough to plan quickly; large and negative values still come by.
  for (int64_t& v : values)
    if (v > (1 << 16) || v < -(1 << 16)) v %= (1 << 16);
  try {
    const std::vector<int64_t> cu = (data[0] & 1) ? cpattn::cu_seqlens_from_ends(values) : values;
    const cpattn::RankPlan p = cpattn::get_thd_load_balanced_cp_metadata(cu, cp, rank);
    FUZZ_ASSERT(p.local_tokens * cp == p.global_tokens_padded);
    FUZZ_ASSERT(p.cu_seqlens_kv.back() == static_cast<int64_t>(p.kv_gather_index.size()));
    for (const int64_t g : p.kv_gather_index) FUZZ_ASSERT(g >= 0 && g < cp * p.local_tokens);
    FUZZ_ASSERT(p.work.tasks.size() == cpattn::tasks_per_document(cp) * p.docs.size());
    FUZZ_ASSERT(cp > 1 || (p.padding_tokens == 0 && p.local_tokens == p.global_tokens));
    const cpattn::WorkList w = cpattn::without_padding(p, p.work);
    // The workload counts real pairs only: the rectangle of the work with padding cut out.
    int64_t rect = 0;
    for (const cpattn::AttnTask& t : w.tasks) {
      FUZZ_ASSERT(t.q_len >= 1 && t.run_end > t.run_begin);
      for (int64_t i = t.run_begin; i < t.run_end; ++i) rect += t.q_len * w.runs[i].len;
    }
    FUZZ_ASSERT(rect == p.workload.rect_work);
    const cpattn::BalanceReport b = cpattn::balance_report(cu, cp);
    FUZZ_ASSERT(b.ranks[rank].balanced.visible_pairs == p.workload.visible_pairs);
    FUZZ_ASSERT(b.ranks[rank].balanced.rect_work == p.workload.rect_work);
    FUZZ_ASSERT(b.imbalance_balanced >= 1.0);
  } catch (const cpattn::Error&) {
  }
  return 0;
}
