#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <new>

#include "plan_math.hpp"

namespace cpattn {

namespace {
void split_documents_into(std::span<const int64_t> cu_seqlens, int cp, CpSplit split, std::vector<DocSplit>& docs) {
  check_cu_seqlens(cu_seqlens);
  check_cp_size(cp);
  const bool padded = split == CpSplit::padded;
  docs.resize(cu_seqlens.size() - 1);
  int64_t padded_begin = 0;
  for (std::size_t d = 0; d < docs.size(); ++d) {
    DocSplit& s = docs[d];
    s.begin = cu_seqlens[d];
    s.len = cu_seqlens[d + 1] - cu_seqlens[d];
    s.padded_begin = padded_begin;
    s.padded_len = padded ? padded_length(s.len, cp) : s.len;
    s.chunk = s.padded_len / chunks_per_document(cp);
    s.local_begin = padded_begin / cp;  // the padded split's; the planner sets the padding-free one's
    padded_begin += s.padded_len;
  }
}

// This rank's chunks of document d, in document order (front, back; one at cp = 1). Both
// splits give every rank one slot s of every document, its chunks s and n-1-s (the padded
// split's s = rank), so the rank's front chunk is found among the first cp without a branch
// on the data (a search that stops at the match mispredicts about once per document).
int rank_chunks(const SplitLayout& layout, std::size_t d, int rank, std::array<int64_t, 2>& mine) {
  const int64_t n = chunks_per_document(layout.cp);
  if (n == 1) {
    mine[0] = 0;
    return 1;
  }
  const DocChunk* ch = layout.chunks.data() + d * n;
  int64_t s = 0;
  for (int64_t m = 0; m < layout.cp; ++m) s = ch[m].rank == rank ? m : s;
  CPATTN_DASSERT(ch[s].rank == rank && ch[n - 1 - s].rank == rank);
  mine = {s, n - 1 - s};
  return 2;
}

// Keys of a task over chunk j: the document up to the end of chunk j (none for an empty chunk).
int64_t task_keys(const DocChunk& c) { return c.len == 0 ? 0 : c.pos + c.len; }
}  // namespace

std::vector<DocSplit> split_documents(std::span<const int64_t> cu_seqlens, int cp) {
  std::vector<DocSplit> docs;
  split_documents_into(cu_seqlens, cp, CpSplit::padded, docs);
  return docs;
}

RankPlan get_thd_load_balanced_cp_metadata(std::span<const int64_t> cu_seqlens, int cp, int rank) {
  return get_thd_load_balanced_cp_metadata(cu_seqlens, cp, rank, PlanOptions{});
}

RankPlan get_thd_load_balanced_cp_metadata(std::span<const int32_t> cu_seqlens, int cp, int rank) {
  return get_thd_load_balanced_cp_metadata(cu_seqlens, cp, rank, PlanOptions{});
}

RankPlan get_thd_load_balanced_cp_metadata(std::span<const int64_t> cu_seqlens, int cp, int rank,
                                           const PlanOptions& options) {
  RankPlan plan;
  get_thd_load_balanced_cp_metadata(cu_seqlens, cp, rank, options, plan);
  return plan;
}

RankPlan get_thd_load_balanced_cp_metadata(std::span<const int32_t> cu_seqlens, int cp, int rank,
                                           const PlanOptions& options) {
  const std::vector<int64_t> wide = widen_boundaries(cu_seqlens);
  return get_thd_load_balanced_cp_metadata(std::span<const int64_t>(wide), cp, rank, options);
}

void get_thd_load_balanced_cp_metadata(std::span<const int64_t> cu_seqlens, int cp, int rank,
                                       RankPlan& plan) {
  get_thd_load_balanced_cp_metadata(cu_seqlens, cp, rank, PlanOptions{}, plan);
}

void get_thd_load_balanced_cp_metadata(std::span<const int64_t> cu_seqlens, int cp, int rank,
                                       const PlanOptions& options, RankPlan& plan) {
  check_cp_size(cp);
  CPATTN_CHECK(rank >= 0 && rank < cp, "rank must be in [0, cp) = [0, ", cp, "), got ", rank);
  // The documents' splits and the layout depend on the boundaries, cp and the split alone: a
  // plan of another rank of the batch it already holds (a caller planning every rank in turn
  // into one RankPlan, as `cpattn plan --json` does) keeps them, so that the loop over the ranks
  // costs O(documents) a rank instead of O(documents x cp). Any other batch builds them anew;
  // the documents are cleared when building them fails, so that a failure leaves nothing to
  // match (clearing the boundaries instead let an empty cu_seqlens match them next and skip its
  // checks), and the boundaries, copied first, stored last.
  const bool same_batch = plan.layout.cp == cp && plan.split == options.split && !plan.docs.empty() &&
                          std::ranges::equal(plan.cu_seqlens, cu_seqlens);
  plan.cp = cp;
  plan.rank = rank;
  plan.split = options.split;
  if (!same_batch) {
    try {
      // (copied first: the caller may pass the plan's own boundaries, which the swap replaces)
      std::vector<int64_t> boundaries(cu_seqlens.begin(), cu_seqlens.end());
      split_documents_into(cu_seqlens, cp, options.split, plan.docs);
      split_layout(cu_seqlens, cp, options.split, plan.layout);
      plan.cu_seqlens.swap(boundaries);
    } catch (...) {  // (the documents of this batch beside another's boundaries would match those next)
      plan.docs.clear();
      throw;
    }
  }
  cu_seqlens = plan.cu_seqlens;  // (the caller's span may have pointed into storage replaced above)
  const SplitLayout& layout = plan.layout;
  plan.cu_seqlens_padded.resize(plan.docs.size() + 1);
  plan.cu_seqlens_padded[0] = 0;
  for (std::size_t d = 0; d < plan.docs.size(); ++d)
    plan.cu_seqlens_padded[d + 1] = plan.docs[d].padded_begin + plan.docs[d].padded_len;
  plan.global_tokens = cu_seqlens.back();
  plan.global_tokens_padded = plan.cu_seqlens_padded.back();
  const int64_t t_loc = layout.rank_tokens(rank);
  plan.local_tokens = t_loc;
  plan.padding_tokens = 0;
  plan.workload = Workload{};

  const int64_t n = chunks_per_document(cp);
  const std::size_t num_tasks = static_cast<std::size_t>(tasks_per_document(cp)) * plan.docs.size();
  std::array<int64_t, 2> mine{};
  int64_t total_kv = 0, nonempty = 0;
  for (std::size_t d = 0; d < plan.docs.size(); ++d)
    for (int h = 0, found = rank_chunks(layout, d, rank, mine); h < found; ++h) {
      const DocChunk& c = layout.chunks[d * n + mine[h]];
      total_kv += task_keys(c);
      nonempty += c.len > 0;
    }

  try {  // (the index arrays grow with the tokens: a batch past memory is an error that says so)
    plan.global_token_index.resize(static_cast<std::size_t>(t_loc));
    plan.real_token_index.resize(static_cast<std::size_t>(t_loc));
    plan.kv_gather_index.resize(static_cast<std::size_t>(total_kv));
  } catch (const std::bad_alloc&) {
    // (in GiB, as format_bytes writes the memory checks' sizes: the planner sits below that layer)
    const double gib = 8.0 * (2.0 * static_cast<double>(t_loc) + static_cast<double>(total_kv)) / (1 << 30);
    detail::fail(__FILE__, __LINE__, "plan of rank ", rank, " of cp ", cp, " for ", plan.global_tokens, " tokens: its ",
                 t_loc, " token indices (x2) and ", total_kv, " key gather indices (", gib, " GiB) could not be allocated");
  }
  plan.cu_seqlens_q.resize(num_tasks + 1);
  plan.cu_seqlens_kv.resize(num_tasks + 1);
  plan.cu_seqlens_q[0] = plan.cu_seqlens_kv[0] = 0;
  plan.work.tasks.resize(nonempty);
  plan.work.runs.clear();
  plan.work.runs.reserve(nonempty * 2);
  plan.work_indexed.tasks.resize(nonempty);
  plan.work_indexed.runs.resize(nonempty);

  int64_t* gti = plan.global_token_index.data();
  int64_t* rti = plan.real_token_index.data();
  int64_t* kvi = plan.kv_gather_index.data();
  int64_t kv_out = 0, padding = 0;
  std::size_t t = 0, w = 0;  // tasks, and non-empty tasks (the work lists' entries)
  for (std::size_t d = 0; d < plan.docs.size(); ++d) {
    DocSplit& s = plan.docs[d];
    const DocChunk* ch = layout.chunks.data() + d * n;
    const int found = rank_chunks(layout, d, rank, mine);
    s.local_begin = ch[mine[0]].local_row;
    for (int h = 0; h < found; ++h, ++t) {
      const DocChunk& q = ch[mine[h]];
      const int64_t kv_len = task_keys(q);
      plan.cu_seqlens_q[t + 1] = plan.cu_seqlens_q[t] + q.len;
      plan.cu_seqlens_kv[t + 1] = plan.cu_seqlens_kv[t] + kv_len;
      if (q.len == 0) continue;
      // The query rows: the chunk, at its local rows. The loops' bounds and bases are locals:
      // read through the references, the stores into the int64 indices could alias them, and
      // the loops would neither vectorize nor keep them in registers.
      {
        const int64_t len = q.len, pos0 = q.pos, padded = s.padded_begin + pos0, real_len = s.len;
        const int64_t real = s.begin + pos0, real_n = std::clamp<int64_t>(real_len - pos0, 0, len);
        int64_t* g = gti + q.local_row;
        int64_t* r = rti + q.local_row;
        for (int64_t i = 0; i < len; ++i) g[i] = padded + i;
        for (int64_t i = 0; i < real_n; ++i) r[i] = real + i;
        for (int64_t i = real_n; i < len; ++i) r[i] = -1;
        padding += len - real_n;
      }
      // The keys: chunks 0..j, in sequence order, where the all-gather put them.
      const auto run_begin = static_cast<int64_t>(plan.work.runs.size());
      for (int64_t m = 0; m <= mine[h]; ++m) {
        const int64_t len = ch[m].len;
        if (len == 0) continue;
        const int64_t base = layout.gathered_row(ch[m]);
        int64_t* k = kvi + kv_out;
        for (int64_t i = 0; i < len; ++i) k[i] = base + i;
        kv_out += len;
        auto& runs = plan.work.runs;
        if (static_cast<int64_t>(runs.size()) > run_begin && runs.back().row + runs.back().len == base &&
            runs.back().pos + runs.back().len == ch[m].pos)  // adjacent in the buffer and in the document
          runs.back().len += ch[m].len;
        else
          runs.push_back(KeyRun{.row = base, .len = ch[m].len, .pos = ch[m].pos});
      }
      const AttnTask task{.q_row = q.local_row,
                          .q_len = q.len,
                          .q_pos = q.pos,
                          .doc = static_cast<int64_t>(d),
                          .run_begin = run_begin,
                          .run_end = static_cast<int64_t>(plan.work.runs.size())};
      plan.work.tasks[w] = task;
      plan.work_indexed.tasks[w] = task;
      plan.work_indexed.tasks[w].run_begin = static_cast<int64_t>(w);
      plan.work_indexed.tasks[w].run_end = static_cast<int64_t>(w) + 1;
      plan.work_indexed.runs[w] = KeyRun{.row = plan.cu_seqlens_kv[t], .len = kv_len, .pos = 0};
      ++w;
      const Workload real = detail::real_task_work(q.pos, q.len, kv_len, s.len);
      detail::checked_add(plan.workload.rect_work, real.rect_work);
      detail::checked_add(plan.workload.visible_pairs, real.visible_pairs);
    }
  }
  CPATTN_DASSERT(kv_out == total_kv && static_cast<int64_t>(w) == nonempty);
  plan.padding_tokens = padding;
  plan.actual_seq_qlen.assign(plan.cu_seqlens_q.begin() + 1, plan.cu_seqlens_q.end());
  plan.actual_seq_kvlen.assign(plan.cu_seqlens_kv.begin() + 1, plan.cu_seqlens_kv.end());
}

namespace {
// (a rank of a padding-free split may hold no token: its local buffer may then be null)
void check_rows_args(const void* global, int64_t row_bytes, const void* local, const RankPlan& plan) {
  CPATTN_CHECK(row_bytes > 0, "row_bytes must be > 0, got ", row_bytes);
  CPATTN_CHECK(global != nullptr && (local != nullptr || plan.local_tokens == 0),
               "row buffers must not be null (but the local one of a rank with no token)");
}
}  // namespace

void take_local_rows(const void* global, int64_t row_bytes, const RankPlan& plan, void* local) {
  check_rows_args(global, row_bytes, local, plan);
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
  check_rows_args(global, row_bytes, local, plan);
  const auto* src = static_cast<const std::byte*>(local);
  auto* dst = static_cast<std::byte*>(global);
  for (int64_t i = 0; i < plan.local_tokens; ++i) {
    const int64_t g = plan.real_token_index[i];
    if (g >= 0) std::memcpy(dst + g * row_bytes, src + i * row_bytes, static_cast<std::size_t>(row_bytes));
  }
}

TokenBatch get_batch_on_this_cp_rank(const TokenBatch& batch, std::span<const int64_t> cu_seqlens,
                                     int cp, int rank, int64_t pad_token_id, const PlanOptions& options) {
  check_cu_seqlens(cu_seqlens);
  CPATTN_CHECK(batch.tokens.size() == static_cast<std::size_t>(cu_seqlens.back()),
               "batch.tokens must hold cu_seqlens' last entry ", cu_seqlens.back(), " tokens, got ",
               batch.tokens.size());
  return get_batch_on_this_cp_rank(batch, get_thd_load_balanced_cp_metadata(cu_seqlens, cp, rank, options),
                                   pad_token_id);
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
