// The helpers the CP schemes share (cp_internal.hpp).
#include "cp_internal.hpp"

#include <cpattn/cp_scheme.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/layout.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace cpattn::cp_detail {

void SchemeEnv::wait(CommRequest& r) {
  const auto t0 = Clock::now();
  comm.wait(r);
  stats.comm_s += seconds_since(t0);
}

void SchemeEnv::compute_moving(std::initializer_list<CommRequest*> in_flight, const std::function<void()>& compute) {
  struct Reset {  // `progress` is the step's only while it runs, thrown out of or not
    const std::function<void()>*& p;
    ~Reset() { p = nullptr; }
  };
  double polled = 0;
  const double total = run_with_progress([&] { test_first_active(comm, in_flight); }, polled,
                                         [&](const std::function<void()>* p) {
                                           const Reset reset{progress};
                                           progress = p;
                                           compute();
                                         });
  stats.compute_s += total - polled;
  stats.comm_s += polled;
}

int64_t overlap_doc_cut(const RankPlan& plan, const AttnOptions& o, bool small_first) {
  std::vector<double> work;
  work.reserve(plan.docs.size());
  for (const DocSplit& d : plan.docs)
    work.push_back(document_pairs(d.len, o.mask == MaskType::causal, o.window_size_left, o.window_size_right));
  return overlap_document_cut(work, small_first).cut;
}

WorkList keys_for_mask(const RankPlan& plan, MaskType mask) {
  if (mask == MaskType::causal) return plan.work;
  WorkList w;
  w.tasks = plan.work.tasks;
  const int64_t n = chunks_per_document(plan.cp);
  for (AttnTask& t : w.tasks) {
    t.run_begin = static_cast<int64_t>(w.runs.size());
    for (int64_t m = 0; m < n; ++m) {
      const DocChunk& c = plan.layout.chunks[t.doc * n + m];
      if (c.len == 0) continue;  // an empty padding-free chunk
      const int64_t row = plan.layout.gathered_row(c);
      if (static_cast<int64_t>(w.runs.size()) > t.run_begin && w.runs.back().row + w.runs.back().len == row)
        w.runs.back().len += c.len;
      else
        w.runs.push_back(KeyRun{.row = row, .len = c.len, .pos = c.pos});
    }
    t.run_end = static_cast<int64_t>(w.runs.size());
  }
  return w;
}

namespace {

// The key positions [first, last] that some query of `t` may see under `o`'s mask and window
// (windows are bounded by kMaxTokens: no overflow).
struct PosRange {
  int64_t first = 0, last = std::numeric_limits<int64_t>::max();
};
PosRange visible_positions(const AttnTask& t, const AttnOptions& o) {
  const int64_t q_last = t.q_pos + t.q_len - 1;
  PosRange p;
  if (o.window_size_left >= 0) p.first = t.q_pos - o.window_size_left;
  if (o.mask == MaskType::causal)
    p.last = q_last;
  else if (o.window_size_right >= 0)
    p.last = q_last + o.window_size_right;
  return p;
}

}  // namespace

WorkList work_on_block(const RankPlan& plan, const WorkList& keys, const AttnOptions& o, int block) {
  const int64_t lo = block * plan.local_tokens, hi = lo + plan.local_tokens;
  WorkList w;
  for (const AttnTask& t : keys.tasks) {
    const PosRange seen = visible_positions(t, o);
    AttnTask nt = t;
    nt.run_begin = static_cast<int64_t>(w.runs.size());
    for (int64_t r = t.run_begin; r < t.run_end; ++r) {
      const KeyRun& k = keys.runs[r];
      // The run's visible positions [p0, p1], then those of its rows inside the block.
      const int64_t p0 = std::max(k.pos, seen.first), p1 = std::min(k.pos + k.len - 1, seen.last);
      if (p0 > p1) continue;
      const int64_t a = std::max(k.row + (p0 - k.pos), lo), b = std::min(k.row + (p1 - k.pos) + 1, hi);
      if (a >= b) continue;  // none visible here
      w.runs.push_back(KeyRun{.row = a - lo, .len = b - a, .pos = k.pos + (a - k.row)});
    }
    nt.run_end = static_cast<int64_t>(w.runs.size());
    if (nt.run_end > nt.run_begin) w.tasks.push_back(nt);
  }
  return w;
}

std::vector<char> ranks_seeing_block(const RankPlan& plan, const AttnOptions& o, int block) {
  const int64_t n = chunks_per_document(plan.cp);
  std::vector<char> sees(static_cast<std::size_t>(plan.cp), 0);
  for (std::size_t d = 0; d < plan.docs.size(); ++d) {
    const int64_t real = plan.docs[d].len;  // positions past it are padding
    const DocChunk* chunks = plan.layout.chunks.data() + d * n;
    for (int64_t mq = 0; mq < n; ++mq) {
      const DocChunk& qc = chunks[mq];
      const int64_t q_len = std::min(qc.pos + qc.len, real) - qc.pos;
      if (q_len <= 0 || sees[qc.rank]) continue;  // no real query, or already known
      // The key positions some query of the chunk may see (as a task of these queries has
      // them); under a causal mask the task's keys end with its own chunk, which q_last does.
      const PosRange seen = visible_positions(AttnTask{.q_len = q_len, .q_pos = qc.pos}, o);
      for (int64_t mk = 0; mk < n && !sees[qc.rank]; ++mk) {
        const DocChunk& kc = chunks[mk];
        if (kc.rank != block) continue;
        const int64_t k_first = std::max(kc.pos, seen.first);
        const int64_t k_last = std::min(std::min(kc.pos + kc.len, real) - 1, seen.last);
        sees[qc.rank] = k_first <= k_last;
      }
    }
  }
  return sees;
}

void store_f32(const float* src, TensorView t) {
  const std::size_t es = dtype_size(t.dtype);
  for (int64_t i = 0; i < t.rows; ++i)
    for (int h = 0; h < t.heads; ++h)
      from_float(src + (i * t.heads + h) * t.dim, static_cast<std::size_t>(t.dim), t.dtype,
                 static_cast<std::byte*>(t.data) + t.offset(i, h) * es);
}

void pack_rows(ConstTensorView t, std::byte* dst) {
  const std::size_t es = dtype_size(t.dtype), row = static_cast<std::size_t>(t.dim) * es;
  for (int64_t i = 0; i < t.rows; ++i)
    for (int h = 0; h < t.heads; ++h, dst += row)
      std::memcpy(dst, static_cast<const std::byte*>(t.data) + t.offset(i, h) * es, row);
}

CommRequest start_block_shift(Communicator& comm, DType t, const std::vector<std::byte>& send, int dest,
                              std::vector<std::byte>& recv, int source) {
  if (t == DType::f32)
    return comm.start_shift<float>({reinterpret_cast<const float*>(send.data()), send.size() / 4}, dest,
                                   {reinterpret_cast<float*>(recv.data()), recv.size() / 4}, source);
  return comm.start_shift<uint16_t>({reinterpret_cast<const uint16_t*>(send.data()), send.size() / 2}, dest,
                                    {reinterpret_cast<uint16_t*>(recv.data()), recv.size() / 2}, source);
}

}  // namespace cpattn::cp_detail
