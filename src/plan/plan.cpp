#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <algorithm>
#include <cstring>

#include "plan_math.hpp"

namespace cpattn {

namespace {
void split_documents_into(std::span<const int64_t> cu_seqlens, int cp, std::vector<DocSplit>& docs) {
  check_cu_seqlens(cu_seqlens);
  check_cp_size(cp);
  docs.resize(cu_seqlens.size() - 1);
  int64_t padded_begin = 0;
  for (std::size_t d = 0; d < docs.size(); ++d) {
    DocSplit& s = docs[d];
    s.begin = cu_seqlens[d];
    s.len = cu_seqlens[d + 1] - cu_seqlens[d];
    s.padded_begin = padded_begin;
    s.padded_len = padded_length(s.len, cp);
    s.chunk = s.padded_len / chunks_per_document(cp);
    s.local_begin = padded_begin / cp;
    padded_begin += s.padded_len;
  }
}
}  // namespace

std::vector<DocSplit> split_documents(std::span<const int64_t> cu_seqlens, int cp) {
  std::vector<DocSplit> docs;
  split_documents_into(cu_seqlens, cp, docs);
  return docs;
}

RankPlan get_thd_load_balanced_cp_metadata(std::span<const int64_t> cu_seqlens, int cp, int rank) {
  RankPlan plan;
  get_thd_load_balanced_cp_metadata(cu_seqlens, cp, rank, plan);
  return plan;
}

RankPlan get_thd_load_balanced_cp_metadata(std::span<const int32_t> cu_seqlens, int cp, int rank) {
  const std::vector<int64_t> wide = widen_boundaries(cu_seqlens);
  return get_thd_load_balanced_cp_metadata(std::span<const int64_t>(wide), cp, rank);
}

void get_thd_load_balanced_cp_metadata(std::span<const int64_t> cu_seqlens, int cp, int rank,
                                       RankPlan& plan) {
  check_cp_size(cp);
  CPATTN_CHECK(rank >= 0 && rank < cp, "rank must be in [0, cp) = [0, ", cp, "), got ", rank);
  plan.cp = cp;
  plan.rank = rank;
  split_documents_into(cu_seqlens, cp, plan.docs);
  plan.cu_seqlens.assign(cu_seqlens.begin(), cu_seqlens.end());
  plan.cu_seqlens_padded.resize(plan.docs.size() + 1);
  plan.cu_seqlens_padded[0] = 0;
  for (std::size_t d = 0; d < plan.docs.size(); ++d)
    plan.cu_seqlens_padded[d + 1] = plan.docs[d].padded_begin + plan.docs[d].padded_len;
  plan.global_tokens = cu_seqlens.back();
  plan.global_tokens_padded = plan.cu_seqlens_padded.back();
  const int64_t t_loc = plan.global_tokens_padded / cp;
  plan.local_tokens = t_loc;
  plan.padding_tokens = 0;
  plan.workload = Workload{};

  const int halves = tasks_per_document(cp);
  const std::size_t num_tasks = static_cast<std::size_t>(halves) * plan.docs.size();
  // Task `half` reads chunks 0..task_chunk(half): (j + 1) * c keys.
  int64_t keys_per_chunk = 0;
  for (int half = 0; half < halves; ++half) keys_per_chunk += task_chunk(half, cp, rank) + 1;
  int64_t total_kv = 0;
  for (const DocSplit& s : plan.docs) total_kv += keys_per_chunk * s.chunk;

  plan.global_token_index.resize(t_loc);
  plan.real_token_index.resize(t_loc);
  plan.cu_seqlens_q.resize(num_tasks + 1);
  plan.cu_seqlens_kv.resize(num_tasks + 1);
  plan.cu_seqlens_q[0] = plan.cu_seqlens_kv[0] = 0;
  plan.kv_gather_index.resize(total_kv);
  plan.work.tasks.resize(num_tasks);
  plan.work.runs.clear();
  plan.work.runs.reserve(num_tasks * 2);
  plan.work_indexed.tasks.resize(num_tasks);
  plan.work_indexed.runs.resize(num_tasks);

  int64_t* gti = plan.global_token_index.data();
  int64_t* rti = plan.real_token_index.data();
  int64_t* kvi = plan.kv_gather_index.data();
  int64_t local = 0, kv_out = 0, padding = 0;
  std::size_t t = 0;
  for (std::size_t d = 0; d < plan.docs.size(); ++d) {
    const DocSplit& s = plan.docs[d];
    const int64_t c = s.chunk;
    for (int half = 0; half < halves; ++half, ++t) {
      const int64_t j = task_chunk(half, cp, rank);  // this task's chunk
      // The query rows: chunk j of the document, at its slot on this rank.
      const int64_t q_row = s.local_begin + half * c;
      CPATTN_DASSERT(q_row == local);
      for (int64_t i = 0; i < c; ++i) {
        const int64_t pos = j * c + i;
        gti[local + i] = s.padded_begin + pos;
        rti[local + i] = pos < s.len ? s.begin + pos : -1;
        padding += pos >= s.len;
      }
      local += c;
      // The keys: chunks 0..j, in sequence order, where the all-gather put them.
      const int64_t kv_len = (j + 1) * c;
      plan.cu_seqlens_q[t + 1] = plan.cu_seqlens_q[t] + c;
      plan.cu_seqlens_kv[t + 1] = plan.cu_seqlens_kv[t] + kv_len;
      const auto run_begin = static_cast<int64_t>(plan.work.runs.size());
      for (int64_t m = 0; m <= j; ++m) {
        const int64_t base = int64_t{chunk_owner(m, cp)} * t_loc + s.local_begin + (m < cp ? 0 : c);
        for (int64_t i = 0; i < c; ++i) kvi[kv_out + i] = base + i;
        kv_out += c;
        auto& runs = plan.work.runs;
        if (static_cast<int64_t>(runs.size()) > run_begin && runs.back().row + runs.back().len == base &&
            runs.back().pos + runs.back().len == m * c)  // adjacent in the buffer and in the document
          runs.back().len += c;
        else
          runs.push_back(KeyRun{.row = base, .len = c, .pos = m * c});
      }
      const AttnTask task{.q_row = q_row,
                          .q_len = c,
                          .q_pos = j * c,
                          .doc = static_cast<int64_t>(d),
                          .run_begin = run_begin,
                          .run_end = static_cast<int64_t>(plan.work.runs.size())};
      plan.work.tasks[t] = task;
      plan.work_indexed.tasks[t] = task;
      plan.work_indexed.tasks[t].run_begin = static_cast<int64_t>(t);
      plan.work_indexed.tasks[t].run_end = static_cast<int64_t>(t) + 1;
      plan.work_indexed.runs[t] = KeyRun{.row = plan.cu_seqlens_kv[t], .len = kv_len, .pos = 0};
      const Workload real = detail::real_task_work(j * c, c, kv_len, s.len);
      detail::checked_add(plan.workload.rect_work, real.rect_work);
      detail::checked_add(plan.workload.visible_pairs, real.visible_pairs);
    }
  }
  CPATTN_DASSERT(local == t_loc && kv_out == total_kv);
  plan.padding_tokens = padding;
  plan.actual_seq_qlen.assign(plan.cu_seqlens_q.begin() + 1, plan.cu_seqlens_q.end());
  plan.actual_seq_kvlen.assign(plan.cu_seqlens_kv.begin() + 1, plan.cu_seqlens_kv.end());
}

namespace {
void check_rows_args(const void* src, int64_t row_bytes, const void* dst) {
  CPATTN_CHECK(row_bytes > 0, "row_bytes must be > 0, got ", row_bytes);
  CPATTN_CHECK(src != nullptr && dst != nullptr, "row buffers must not be null");
}
}  // namespace

void take_local_rows(const void* global, int64_t row_bytes, const RankPlan& plan, void* local) {
  check_rows_args(global, row_bytes, local);
  const auto* src = static_cast<const std::byte*>(global);
  auto* dst = static_cast<std::byte*>(local);
  const auto n = static_cast<std::size_t>(row_bytes);
  for (int64_t i = 0; i < plan.local_tokens; ++i) {
    const int64_t g = plan.real_token_index[i];
    if (g >= 0)
      std::memcpy(dst + i * row_bytes, src + g * row_bytes, n);
    else
      std::memset(dst + i * row_bytes, 0, n);
  }
}

void put_local_rows(const void* local, int64_t row_bytes, const RankPlan& plan, void* global) {
  check_rows_args(local, row_bytes, global);
  const auto* src = static_cast<const std::byte*>(local);
  auto* dst = static_cast<std::byte*>(global);
  for (int64_t i = 0; i < plan.local_tokens; ++i) {
    const int64_t g = plan.real_token_index[i];
    if (g >= 0) std::memcpy(dst + g * row_bytes, src + i * row_bytes, static_cast<std::size_t>(row_bytes));
  }
}

TokenBatch get_batch_on_this_cp_rank(const TokenBatch& batch, std::span<const int64_t> cu_seqlens,
                                     int cp, int rank, int64_t pad_token_id) {
  check_cu_seqlens(cu_seqlens);
  CPATTN_CHECK(batch.tokens.size() == static_cast<std::size_t>(cu_seqlens.back()),
               "batch.tokens must hold cu_seqlens' last entry ", cu_seqlens.back(), " tokens, got ",
               batch.tokens.size());
  return get_batch_on_this_cp_rank(batch, get_thd_load_balanced_cp_metadata(cu_seqlens, cp, rank), pad_token_id);
}

TokenBatch get_batch_on_this_cp_rank(const TokenBatch& batch, const RankPlan& plan, int64_t pad_token_id) {
  const auto t = static_cast<std::size_t>(plan.global_tokens);
  CPATTN_CHECK(batch.tokens.size() == t && batch.labels.size() == t && batch.position_ids.size() == t &&
                   batch.loss_mask.size() == t,
               "batch's tokens, labels, position_ids and loss_mask must each hold the plan's global_tokens = ", t,
               " entries, got ", batch.tokens.size(), ", ", batch.labels.size(), ", ", batch.position_ids.size(),
               " and ", batch.loss_mask.size());
  const auto n = static_cast<std::size_t>(plan.local_tokens);
  TokenBatch out{std::vector<int64_t>(n), std::vector<int64_t>(n), std::vector<int64_t>(n), std::vector<float>(n)};
  // The tasks' query rows tile this rank's rows; row q_row + i holds position q_pos + i.
  for (const AttnTask& task : plan.work.tasks) {
    const DocSplit& s = plan.docs[task.doc];
    for (int64_t i = 0; i < task.q_len; ++i) {
      const auto row = static_cast<std::size_t>(task.q_row + i);
      const int64_t pos = task.q_pos + i;
      if (pos < s.len) {
        const auto g = static_cast<std::size_t>(s.begin + pos);
        out.tokens[row] = batch.tokens[g];
        out.labels[row] = batch.labels[g];
        out.position_ids[row] = batch.position_ids[g];
        out.loss_mask[row] = batch.loss_mask[g];
      } else {
        out.tokens[row] = pad_token_id;
        out.labels[row] = kIgnoreIndex;
        out.position_ids[row] = pos;
        out.loss_mask[row] = 0.0f;
      }
    }
  }
  return out;
}

}  // namespace cpattn

namespace cpattn {

WorkList without_padding(const RankPlan& plan, const WorkList& work) {
  WorkList out;
  out.tasks.reserve(work.tasks.size());
  out.runs.reserve(work.runs.size());
  for (const AttnTask& t : work.tasks) {
    CPATTN_CHECK(t.doc >= 0 && t.doc < static_cast<int64_t>(plan.docs.size()), "work task's doc ",
                 t.doc, " is not a document of the plan (", plan.docs.size(), " documents)");
    const int64_t len = plan.docs[t.doc].len;
    const int64_t q_len = std::min(t.q_len, len - t.q_pos);
    if (q_len <= 0) continue;
    AttnTask cut = t;
    cut.q_len = q_len;
    cut.run_begin = static_cast<int64_t>(out.runs.size());
    for (int64_t i = t.run_begin; i < t.run_end; ++i) {
      KeyRun r = work.runs[i];
      r.len = std::min(r.len, len - r.pos);
      if (r.len > 0) out.runs.push_back(r);
    }
    cut.run_end = static_cast<int64_t>(out.runs.size());
    out.tasks.push_back(cut);
  }
  return out;
}

}  // namespace cpattn
