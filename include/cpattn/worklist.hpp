// The work list: how the planner tells the attention kernels which keys each query sees.
//
// A task is a run of consecutive query rows of one document, and its keys are a list of runs
// of consecutive rows of the key/value tensors. Every row carries its position in its
// document (counted from the document's first token, padding included), and with a causal
// mask key position kp is visible to query position qp iff kp <= qp. Without a mask every
// key of the task is visible.
//
// Example: the usual varlen call with cu_seqlens_q = [0, 2, 5], cu_seqlens_k = [0, 4, 7]
// (bottom-right aligned: the queries are the last rows of their documents) is
//   tasks = {q_row 0, q_len 2, q_pos 2, doc 0, runs [0,1)},
//           {q_row 2, q_len 3, q_pos 0, doc 1, runs [1,2)}
//   runs  = {row 0, len 4, pos 0}, {row 4, len 3, pos 0}
// and CP rank 0 of docs/design.md section 4 has, for its back chunk of document 0, one task whose
// runs are chunks 0, 1, 2 and 3 read in place from the rank-major gathered buffer.
//
// The kernels are given no other notion of documents or ranks: a task's query rows must not
// overlap another task's (each output row is written once), its runs must be in increasing
// position order without overlap, and `doc` with the positions keys dropout, so that any
// split of the same batch into tasks drops the same (query, key) pairs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace cpattn {

struct KeyRun {
  int64_t row = 0;  // first row in k/v (and in dk/dv), in rows of the key tensors
  int64_t len = 0;  // number of rows, >= 1
  int64_t pos = 0;  // position of the first row in its document
};

struct AttnTask {
  int64_t q_row = 0;      // first row in q/out/lse/dq
  int64_t q_len = 0;      // number of query rows, >= 1
  int64_t q_pos = 0;      // position of the first query row in its document
  int64_t doc = 0;        // global document index (dropout key), >= 0
  int64_t run_begin = 0;  // this task's keys are runs [run_begin, run_end) of WorkList::runs
  int64_t run_end = 0;
};

struct WorkList {
  std::vector<AttnTask> tasks;
  std::vector<KeyRun> runs;
};

// The key rows that `w`'s tasks' runs name, as sorted spans [first, second) with gaps between
// them: a call reads no other row of K/V, and with AttnBwdParams::named_rows_only writes no
// other row of dK/dV. Usually the runs come in row order (no sort).
inline std::vector<std::pair<int64_t, int64_t>> named_key_rows(const WorkList& w) {
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const AttnTask& t : w.tasks)
    for (int64_t r = t.run_begin; r < t.run_end; ++r) {
      const KeyRun& run = w.runs[static_cast<std::size_t>(r)];
      spans.emplace_back(run.row, run.row + run.len);
    }
  if (!std::is_sorted(spans.begin(), spans.end())) std::sort(spans.begin(), spans.end());
  std::size_t n = 0;  // merged in place
  for (const auto& s : spans)
    if (n > 0 && s.first <= spans[n - 1].second)
      spans[n - 1].second = std::max(spans[n - 1].second, s.second);
    else
      spans[n++] = s;
  spans.resize(n);
  return spans;
}

}  // namespace cpattn
