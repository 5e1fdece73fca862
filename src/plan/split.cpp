// The chunk tables of both splits (plan.hpp, docs/planner.md "The padding-free split").
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <algorithm>
#include <numeric>

#include "plan_math.hpp"

namespace cpattn {

std::string_view to_string(CpSplit s) { return s == CpSplit::padding_free ? "padding-free" : "padded"; }

namespace {

// Chunk m of a document of `len` tokens cut into n chunks of b = len / n tokens, the chunks
// [e0, e0 + len % n) holding one more.
struct EvenCut {
  int64_t b = 0, e = 0, e0 = 0;
  int64_t pos(int64_t m) const { return m * b + std::clamp<int64_t>(m - e0, 0, e); }
  int64_t len(int64_t m) const { return b + (m >= e0 && m < e0 + e ? 1 : 0); }
};

// Slot s (chunks s and n-1-s) visible pairs under `cut`, into `work`; returns max - min.
// Plain arithmetic: every count is at most the document's L(L+1)/2, which even_cut checks.
// The front chunks, then the back ones: no branch on the chunk's half.
int64_t slot_work(const EvenCut& cut, int cp, std::span<int64_t> work) {
  const int64_t n = 2 * int64_t{cp};
  int64_t pos = 0;
  for (int64_t m = 0; m < cp; ++m) {  // chunk m: c queries at pos.. see pos + 1 .. pos + c keys
    const int64_t c = cut.len(m);
    work[m] = c * pos + c * (c + 1) / 2;
    pos += c;
  }
  for (int64_t m = cp; m < n; ++m) {
    const int64_t c = cut.len(m);
    work[n - 1 - m] += c * pos + c * (c + 1) / 2;
    pos += c;
  }
  int64_t lo = work[0], hi = work[0];
  for (int s = 1; s < cp; ++s) {
    lo = std::min(lo, work[s]);
    hi = std::max(hi, work[s]);
  }
  return hi - lo;
}

// The extra tokens at the front, the middle or the back of the document, whichever leaves
// the slots' work most even (ties: the earlier candidate); `work` gets that cut's slot work
// (`scratch` holds a candidate's meanwhile).
EvenCut even_cut(int64_t len, int cp, std::span<int64_t> work, std::span<int64_t> scratch, int64_t& spread) {
  const int64_t n = 2 * int64_t{cp};
  (void)detail::checked_visible_pairs(0, len, len);  // the document's pairs fit: so do its chunks'
  EvenCut best{.b = len / n, .e = len % n, .e0 = 0};
  spread = slot_work(best, cp, work);
  if (best.e == 0) return best;
  for (const int64_t e0 : {(n - best.e) / 2, n - best.e}) {
    EvenCut c = best;
    c.e0 = e0;
    const int64_t s = slot_work(c, cp, scratch);
    if (s < spread) {
      spread = s;
      best = c;
      std::copy(scratch.begin(), scratch.end(), work.begin());
    }
  }
  return best;
}

void padded_layout(std::span<const int64_t> cu, int cp, SplitLayout& out) {
  const int64_t n = chunks_per_document(cp);
  int64_t local = 0;  // the same on every rank
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t c = padded_length(cu[d + 1] - cu[d], cp) / n;
    DocChunk* ch = out.chunks.data() + d * n;
    for (int64_t m = 0; m < n; ++m)
      ch[m] = DocChunk{.pos = m * c, .len = c, .local_row = local + (m < cp ? 0 : c), .rank = chunk_owner(m, cp)};
    local += n == 1 ? c : 2 * c;
  }
  for (int s = 0; s <= cp; ++s) out.rank_begin[s] = s * local;
}

// Sorts `idx` by `before`, a strict total order (so the result does not depend on idx's order):
// by insertion from idx's order up to 64 entries (no call, and the ranks' order changes little
// from one document to the next at small cp), std::sort above (the insertion sort's O(cp^2) per
// document planned 24 documents at cp = 65536 in seconds; the pairing nearly reverses the order).
template <class Before>
void sort_indices(std::vector<int>& idx, Before before) {
  if (idx.size() > 64) {
    std::sort(idx.begin(), idx.end(), before);
    return;
  }
  for (std::size_t i = 1; i < idx.size(); ++i) {
    const int x = idx[i];
    std::size_t j = i;
    for (; j > 0 && before(x, idx[j - 1]); --j) idx[j] = idx[j - 1];
    idx[j] = x;
  }
}

void padding_free_layout(std::span<const int64_t> cu, int cp, SplitLayout& out) {
  const int64_t n = chunks_per_document(cp);
  const auto k = static_cast<std::size_t>(cp);
  const std::size_t docs = cu.size() - 1;
  // The cut, the slots' work and their order depend on the document's length alone, and a
  // batch of many documents repeats lengths: each length up to `kMemo` is worked out once
  // (issue 15: the cuts and the slots' sort were half of the planning time of 10,000
  // documents at cp = 8). Longer documents, few in any batch, are worked out each time, and
  // so is every new length once the memo holds kMemoSlots slots (3 MiB at most, whatever cp
  // is: the simulator plans cp = 65536; 16384 lengths at cp <= 16 fit).
  constexpr int64_t kMemo = 1 << 14;
  constexpr std::size_t kMemoSlots = std::size_t{1} << 18;
  int64_t longest = 0;
  for (std::size_t d = 0; d < docs; ++d) longest = std::max(longest, cu[d + 1] - cu[d]);
  std::vector<int32_t> memo_of_len(static_cast<std::size_t>(std::min(longest, kMemo - 1) + 1), -1);
  // Per length seen: its cut, its slots' work and the slots heaviest first (ties: the lower slot).
  std::vector<EvenCut> memo;
  std::vector<int64_t> memo_work;  // [memo.size() * cp]
  std::vector<int> memo_slots;     // [memo.size() * cp]
  // Per-document scratch of cp entries.
  std::vector<int64_t> load(k, 0), rows(k, 0), work(k), tmp(k);
  std::vector<int> slots(k), ranks(k), rank_of_slot(k);
  std::iota(ranks.begin(), ranks.end(), 0);
  for (std::size_t d = 0; d < docs; ++d) {
    const int64_t len = cu[d + 1] - cu[d];
    const int32_t* known = len < kMemo ? &memo_of_len[static_cast<std::size_t>(len)] : nullptr;
    EvenCut cut;
    const int64_t* w = nullptr;
    const int* order = nullptr;
    if (known && *known >= 0) {
      const auto i = static_cast<std::size_t>(*known);
      cut = memo[i];
      w = memo_work.data() + i * k;
      order = memo_slots.data() + i * k;
    } else {
      int64_t spread = 0;
      cut = even_cut(len, cp, work, tmp, spread);
      out.max_doc_spread = std::max(out.max_doc_spread, spread);
      std::iota(slots.begin(), slots.end(), 0);
      sort_indices(slots, [&](int a, int b) { return work[a] > work[b] || (work[a] == work[b] && a < b); });
      w = work.data();
      order = slots.data();
      if (known && memo_work.size() + k <= kMemoSlots) {
        memo_of_len[static_cast<std::size_t>(len)] = static_cast<int32_t>(memo.size());
        memo.push_back(cut);  // its spread is in max_doc_spread already
        memo_work.insert(memo_work.end(), work.begin(), work.end());
        memo_slots.insert(memo_slots.end(), slots.begin(), slots.end());
      }
    }
    // The heaviest slot to the least-loaded rank: after every document the ranks' loads then
    // differ by at most the largest spread so far (the sorted pairing never widens a gap).
    // Sorted from the last document's order (ties by index: the same result from any order).
    sort_indices(ranks, [&](int a, int b) { return load[a] < load[b] || (load[a] == load[b] && a < b); });
    for (std::size_t i = 0; i < k; ++i) {
      rank_of_slot[order[i]] = ranks[i];
      detail::checked_add(load[ranks[i]], w[order[i]]);
    }
    DocChunk* ch = out.chunks.data() + d * n;
    for (int64_t m = 0; m < n; ++m) {  // in document order: a rank's front chunk, then its back
      const int r = rank_of_slot[m < cp ? m : n - 1 - m];
      ch[m] = DocChunk{.pos = cut.pos(m), .len = cut.len(m), .local_row = rows[r], .rank = r};
      rows[r] += ch[m].len;
    }
  }
  out.rank_begin[0] = 0;
  for (int s = 0; s < cp; ++s) out.rank_begin[s + 1] = out.rank_begin[s] + rows[s];
}

}  // namespace

void split_layout(std::span<const int64_t> cu_seqlens, int cp, CpSplit split, SplitLayout& layout) {
  check_cu_seqlens(cu_seqlens);
  check_cp_size(cp);
  CPATTN_CHECK(split == CpSplit::padded || split == CpSplit::padding_free,
               "split must be padded or padding_free, got ", static_cast<int>(split));
  layout.split = split;
  layout.cp = cp;
  layout.max_doc_spread = 0;
  layout.chunks.resize((cu_seqlens.size() - 1) * static_cast<std::size_t>(chunks_per_document(cp)));
  layout.rank_begin.resize(static_cast<std::size_t>(cp) + 1);
  // At cp = 1 both splits are one unpadded chunk per document.
  if (split == CpSplit::padded || cp == 1)
    padded_layout(cu_seqlens, cp, layout);
  else
    padding_free_layout(cu_seqlens, cp, layout);
}

SplitLayout split_layout(std::span<const int64_t> cu_seqlens, int cp, CpSplit split) {
  SplitLayout layout;
  split_layout(cu_seqlens, cp, split, layout);
  return layout;
}

}  // namespace cpattn
