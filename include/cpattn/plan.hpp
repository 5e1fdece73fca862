// The load-balancing planner (docs/design.md sections 3 and 4): pure functions of the document
// boundaries, cp and rank that return plain data. No MPI.
//
// Every document, padded to P = padded_length(L, cp), is cut into chunks_per_document(cp)
// chunks of c = P / chunks_per_document(cp) tokens: 2*cp chunks for cp > 1; rank r keeps
// chunk r (front) and chunk 2*cp-1-r (back) of every document, in document order, front
// before back. Worked example, cu_seqlens = [0, 16, 40], cp = 2:
//   rank 0 holds global tokens 0-3, 12-15, 16-21, 34-39; rank 1 holds 4-7, 8-11, 22-27, 28-33.
// After the K/V all-gather, rank s's local tokens sit at [s*T_loc, (s+1)*T_loc) of the
// rank-major gathered buffer. Rank r runs tasks_per_document(cp) attention tasks per
// document: for cp > 1 two, the front chunk's queries over chunks 0..r, the back chunk's over
// chunks 0..2*cp-1-r, each bottom-right aligned.
// For the example, in ends form: actual_seq_qlen = [4, 8, 14, 20] on both ranks,
// actual_seq_kvlen = [4, 20, 26, 50] on rank 0 and [8, 20, 32, 50] on rank 1.
//
// cp = 1 is the single-process varlen call: one chunk per document (c = L, no padding), ONE
// task per document (the whole document's queries over the whole document's keys), T_loc = T,
// the gather index the identity. For [0, 16, 40]: actual_seq_qlen = actual_seq_kvlen = [16, 40].
//
// Work (Workload, BalanceReport) counts real (query, key) pairs only: the CP layer runs every
// task with padding cut out (without_padding), so padding queries and padding keys do no work.
//
// That is the padded split (CpSplit::padded, the default, TransformerEngine's). The
// padding-free split (CpSplit::padding_free, docs/planner.md "The padding-free split") pads
// nothing: a document of L tokens is cut into 2*cp chunks of floor(L / 2cp) tokens, e = L % 2cp
// consecutive ones of which hold one more (the chunks [e0, e0 + e), e0 the front, middle or back
// choice with the most even work inside the document); chunks s and 2cp-1-s form slot s, and
// the slots go to the ranks by load: the slot with the most visible pairs to the rank with the
// fewest so far (ties: lower slot, lower rank). Chunks may be empty, local token counts differ
// between ranks, and rank s's rows sit at [rank_begin[s], rank_begin[s+1]) of the gathered
// buffer. Both splits are described by one chunk table (SplitLayout); at cp = 1 they are the same.
#pragma once

#include <cpattn/layout.hpp>
#include <cpattn/worklist.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cpattn {

// How documents are cut into chunks (see the top of this file).
enum class CpSplit {
  padded,        // pad to a multiple of 2*cp, 2*cp equal chunks, rank r keeps r and 2cp-1-r
  padding_free,  // no padding, chunk sizes differ by at most one, slots given out by load
};
std::string_view to_string(CpSplit s);  // "padded", "padding-free"

struct PlanOptions {
  CpSplit split = CpSplit::padded;
};

// One chunk of one document under a split.
struct DocChunk {
  int64_t pos = 0;        // first position in the document (padding positions count)
  int64_t len = 0;        // tokens, padding included; 0 for an empty padding-free chunk
  int64_t local_row = 0;  // its first row among its rank's local rows
  int rank = 0;           // the rank that holds it
};

// Where every chunk of every document lives: the same on every rank.
struct SplitLayout {
  CpSplit split = CpSplit::padded;
  int cp = 1;
  std::vector<DocChunk> chunks;     // [docs * chunks_per_document(cp)], document-major
  std::vector<int64_t> rank_begin;  // [cp + 1]: rank s's rows in the rank-major gathered buffer
  // The padding-free split's guarantee: every rank's visible pairs are within
  // (cp - 1) / cp * max_doc_spread of the mean, max_doc_spread being the largest difference
  // between two slots' visible pairs inside one document (0 for the padded split).
  int64_t max_doc_spread = 0;

  int64_t rank_tokens(int rank) const { return rank_begin[rank + 1] - rank_begin[rank]; }
  int64_t gathered_row(const DocChunk& c) const { return rank_begin[c.rank] + c.local_row; }
};

// The chunk table alone, for every rank (what `cpattn plan --svg` draws). Throws
// cpattn::Error for invalid boundaries or cp.
void split_layout(std::span<const int64_t> cu_seqlens, int cp, CpSplit split, SplitLayout& layout);
SplitLayout split_layout(std::span<const int64_t> cu_seqlens, int cp, CpSplit split);

// One document under the split. Padded: the same on every rank. Padding-free: padded_begin =
// begin, padded_len = len, chunk = the smallest chunk, len / chunks_per_document(cp), and
// local_begin is this rank's (its front chunk's local row).
struct DocSplit {
  int64_t begin = 0;         // first token in the real (unpadded) batch
  int64_t len = 0;           // real tokens
  int64_t padded_begin = 0;  // first token in the padded batch
  int64_t padded_len = 0;    // padded_length(len, cp)
  int64_t chunk = 0;         // padded_len / chunks_per_document(cp)
  int64_t local_begin = 0;   // padded_begin / cp: where the front chunk starts on every rank
};

// Tasks per document on every rank: 2 (front and back chunk) for cp > 1, 1 at cp = 1.
constexpr int tasks_per_document(int cp) { return cp == 1 ? 1 : 2; }

// The chunk of a document that task `half` (0 = front, 1 = back; 0 only at cp = 1) of rank
// `rank` queries: r, or chunks_per_document(cp) - 1 - r.
constexpr int64_t task_chunk(int half, int cp, int rank) {
  return half == 0 ? int64_t{rank} : chunks_per_document(cp) - 1 - rank;
}

// Real work of one rank's attention under a causal mask, padding excluded (what the CP layer
// runs after without_padding; without a mask every task reads all its document's keys, which
// this does not count): per task, with q_real = its queries at positions below the document's
// real length and kv_real = its keys below it, rect_work = sum(q_real * kv_real) and
// visible_pairs = the exact number of real (query, key) pairs the causal mask leaves visible.
// Summed over ranks, visible_pairs is sum(L * (L + 1) / 2) over documents.
struct Workload {
  int64_t rect_work = 0;
  int64_t visible_pairs = 0;
};

// Everything rank `rank` needs for one batch: get_thd_load_balanced_cp_metadata's result.
struct RankPlan {
  int cp = 1;
  int rank = 0;
  CpSplit split = CpSplit::padded;
  int64_t global_tokens = 0;         // T, real tokens of the whole batch
  int64_t global_tokens_padded = 0;  // T_pad
  int64_t local_tokens = 0;          // T_loc = T_pad / cp, this rank's tokens (padding included);
                                     // padding-free: layout.rank_tokens(rank), differs by rank
  int64_t padding_tokens = 0;        // how many of this rank's tokens are padding
  std::vector<int64_t> cu_seqlens;         // [docs+1] the real boundaries
  std::vector<int64_t> cu_seqlens_padded;  // [docs+1]
  std::vector<DocSplit> docs;              // [docs]
  SplitLayout layout;                      // every rank's chunks (layout.rank_begin: T_loc of each)
  // [T_loc] for each local token, its index in the padded global batch ...
  std::vector<int64_t> global_token_index;
  // ... and in the real batch, or -1 for a padding token.
  std::vector<int64_t> real_token_index;
  // Per task (tasks_per_document(cp) per document: front, back; one at cp = 1), cumulative
  // with a leading 0: [tasks + 1]. An empty padding-free chunk is a task of 0 queries and 0
  // keys here, and no task of `work` / `work_indexed` (the kernels take no empty task).
  std::vector<int64_t> cu_seqlens_q;
  std::vector<int64_t> cu_seqlens_kv;
  // The same in the ends form (Ascend's actual_seq_qlen / actual_seq_kvlen): [tasks].
  std::vector<int64_t> actual_seq_qlen;
  std::vector<int64_t> actual_seq_kvlen;
  // [cu_seqlens_kv.back()] for each task, in task order, the rank-major gathered-buffer
  // positions of its keys in sequence order (the reference design's index_select index).
  std::vector<int64_t> kv_gather_index;
  // The same keys read in place: query rows are local rows, key runs are rows of the
  // rank-major gathered buffer [layout.rank_begin[cp]] (cp * T_loc when padded), adjacent
  // chunks merged into one run.
  WorkList work;
  // The same tasks over the copy that kv_gather_index selects (one run per task).
  WorkList work_indexed;
  Workload workload;
};

// The reference design's metadata function, for real (unpadded) cu_seqlens, cp >= 1 and
// 0 <= rank < cp. Throws cpattn::Error naming the argument on invalid input.
RankPlan get_thd_load_balanced_cp_metadata(std::span<const int64_t> cu_seqlens, int cp, int rank);
// The same for int32 boundaries (PyTorch's and FlashAttention's cu_seqlens dtype): widened to
// int64 once, then planned as above; the plan is the one the int64 spelling gives.
RankPlan get_thd_load_balanced_cp_metadata(std::span<const int32_t> cu_seqlens, int cp, int rank);
// The same into an existing plan, reusing its storage: a planner called for every batch then
// touches no fresh memory (first-touch page faults are most of a fresh plan's cost).
void get_thd_load_balanced_cp_metadata(std::span<const int64_t> cu_seqlens, int cp, int rank,
                                       RankPlan& plan);
// Any split (the three above are CpSplit::padded).
void get_thd_load_balanced_cp_metadata(std::span<const int64_t> cu_seqlens, int cp, int rank,
                                       const PlanOptions& options, RankPlan& plan);
RankPlan get_thd_load_balanced_cp_metadata(std::span<const int64_t> cu_seqlens, int cp, int rank,
                                           const PlanOptions& options);
RankPlan get_thd_load_balanced_cp_metadata(std::span<const int32_t> cu_seqlens, int cp, int rank,
                                           const PlanOptions& options);

// The per-document split alone (no per-token arrays): cheap, the same for every rank. The
// padded split's (the padding-free split's chunks: split_layout).
std::vector<DocSplit> split_documents(std::span<const int64_t> cu_seqlens, int cp);

// Which rank holds chunk j of a document under the padded split (a front chunk when j < cp,
// else a back chunk); the padding-free split's owners are in SplitLayout::chunks.
constexpr int chunk_owner(int64_t j, int cp) {
  return static_cast<int>(j < cp ? j : chunks_per_document(cp) - 1 - j);
}

// The tasks of `work` (plan.work, plan.work_indexed, or any list over the plan's tasks)
// without padding: each task's query rows and key runs cut at its document's real length,
// tasks left with no real query dropped. No padding token then takes part in attention in
// either direction, so padding rows get no output and exactly zero gradient.
WorkList without_padding(const RankPlan& plan, const WorkList& work);

// ---- Rows of THD tensors between the global batch and a rank -------------------------------

// local[i] = global[plan.real_token_index[i]] for real tokens, zero bytes for padding.
// `row_bytes` is the size of one token's row (heads * head_dim * element size).
void take_local_rows(const void* global, int64_t row_bytes, const RankPlan& plan, void* local);
// The inverse: global[plan.real_token_index[i]] = local[i] for real tokens; padding dropped.
void put_local_rows(const void* local, int64_t row_bytes, const RankPlan& plan, void* global);

// ---- The data side: Megatron's get_batch_on_this_cp_rank for THD batches ---------------------

inline constexpr int64_t kIgnoreIndex = -100;  // label of a token the loss skips

// Per-token arrays of a packed batch, all of the same length.
struct TokenBatch {
  std::vector<int64_t> tokens;        // token ids
  std::vector<int64_t> labels;        // next-token labels; kIgnoreIndex is not scored
  std::vector<int64_t> position_ids;  // position of each token in its document
  std::vector<float> loss_mask;       // 1 where the loss counts the token, else 0
};

// Rank `rank`'s local arrays in the split's order. Padding tokens get `pad_token_id`, label
// kIgnoreIndex, loss mask 0 and positions continuing the document's (L, L+1, ...); real tokens
// keep every value they had.
TokenBatch get_batch_on_this_cp_rank(const TokenBatch& batch, std::span<const int64_t> cu_seqlens,
                                     int cp, int rank, int64_t pad_token_id = 0,
                                     const PlanOptions& options = {});

// The same from a plan made for this rank (no second plan): the local rows of `plan`'s tasks,
// for a batch of plan.global_tokens tokens.
TokenBatch get_batch_on_this_cp_rank(const TokenBatch& batch, const RankPlan& plan, int64_t pad_token_id = 0);

// ---- Balance report ----------------------------------------------------------------------------

struct RankBalance {
  int rank = 0;
  int64_t local_tokens = 0;
  int64_t padding_tokens = 0;
  int64_t tasks = 0;              // chunks with tokens (an empty padding-free chunk is no task)
  Workload balanced;              // the report's split, real pairs only (as RankPlan::workload)
  int64_t contiguous_tokens = 0;  // the plain split: tokens [r*T/cp, (r+1)*T/cp) of the real batch
  Workload contiguous;
};

struct BalanceReport {
  int cp = 1;
  CpSplit split = CpSplit::padded;
  int64_t real_tokens = 0;
  int64_t padded_tokens = 0;
  int64_t padding_tokens() const { return padded_tokens - real_tokens; }
  double padding_percent() const;  // of the real tokens
  std::vector<RankBalance> ranks;
  // max / mean of real visible pairs over ranks (1.0 is perfect balance). The balanced split
  // is exactly 1.0 when no document needs padding; with padding (which the last chunks, rank
  // 0's first, hold) it is at most sum(P*(P+1)) / sum(L*(L+1)) over documents.
  // The padding-free split: at most imbalance_bound = 1 + (cp - 1) * max_doc_spread / (total
  // real pairs) (SplitLayout::max_doc_spread); the padded split: the bound above.
  double imbalance_balanced = 1.0;
  double imbalance_contiguous = 1.0;
  double imbalance_bound = 1.0;
  // No split of these boundaries into ranks does better than this: some rank holds at least
  // ceil(pairs / cp) pairs, and the one holding the longest document's last token at least L.
  double imbalance_lower_bound = 1.0;
};

BalanceReport balance_report(std::span<const int64_t> cu_seqlens, int cp, CpSplit split = CpSplit::padded);
BalanceReport balance_report(std::span<const int32_t> cu_seqlens, int cp,
                             CpSplit split = CpSplit::padded);  // widened once

// ---- The metadata cache ----------------------------------------------------------------------

// A bounded LRU of RankPlans keyed by the boundaries' content, cp and rank. A lookup hashes
// the boundaries and, on a hash match, compares them in full, so it can never return a plan
// for other boundaries. Thread-safe. Entries are shared: a plan stays valid for as long as a
// caller holds it, even after eviction or clear().
class PlanCache {
 public:
  explicit PlanCache(std::size_t capacity = 8);

  std::shared_ptr<const RankPlan> get(std::span<const int64_t> cu_seqlens, int cp, int rank,
                                      CpSplit split = CpSplit::padded);
  // int32 boundaries, widened once and keyed by the widened values: the int32 and int64
  // spellings of the same boundaries share one entry.
  std::shared_ptr<const RankPlan> get(std::span<const int32_t> cu_seqlens, int cp, int rank,
                                      CpSplit split = CpSplit::padded);

  std::size_t capacity() const { return capacity_; }
  std::size_t size() const;
  int64_t hits() const;
  int64_t misses() const;
  void clear();  // drops every entry and zeroes the counters

 private:
  struct Entry {
    uint64_t hash;
    int cp;
    int rank;
    CpSplit split;
    std::shared_ptr<const RankPlan> plan;
  };
  std::size_t capacity_;
  mutable std::mutex mutex_;
  std::vector<Entry> entries_;  // most recently used last; capacity is small
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

// 64-bit hash of boundaries (what the cache keys by).
uint64_t hash_boundaries(std::span<const int64_t> cu_seqlens);

}  // namespace cpattn
