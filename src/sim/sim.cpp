// The calibrated simulator (include/cpattn/sim.hpp, docs/simulate.md).
#include <cpattn/sim.hpp>

#include <cpattn/agreement.hpp>
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/memory.hpp>
#include <cpattn/plan.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>

namespace cpattn {

namespace {

// Rates (GFLOP/s, GB/s) from 1e-3 up: a subnormal one passed "> 0" and made the costs inf or
// NaN far from the profile field that caused them.
constexpr double kMinRate = 1e-3;
bool valid_rate(double x) { return std::isfinite(x) && x >= kMinRate; }

void check_link(const SimLink& l, const char* name) {
  CPATTN_CHECK(valid_rate(l.bandwidth_gbs), "profile.", name,
               ".bandwidth_gbs must be a finite number >= 0.001 (GB/s), got ", l.bandwidth_gbs);
  CPATTN_CHECK(std::isfinite(l.latency_us) && l.latency_us >= 0, "profile.", name,
               ".latency_us must be a finite number >= 0 (microseconds), got ", l.latency_us);
}

// ceil(a / b) for b > 0 and any a.
int64_t ceil_div(int64_t a, int64_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); }

// Which CP ranks sit on which node: CP index i of the CP group whose index 0 is world rank
// `offset` is world rank offset + tp * i (the mesh's tp-cp-dp-pp order, docs/mesh.md; offset =
// tp_i + tp cp (dp_i + dp pp_i)). The node of a CP index only grows with it, so the CP indices
// of one node form an interval: peers are counted per link class in closed form, never by a
// loop over the group (cp up to 65536, every rank of every prediction).
struct Topology {
  int tp = 1, rpn = 1;
  int64_t offset = 0;
  int64_t node(int64_t world_rank) const { return world_rank / rpn; }
  bool inter(int64_t a_world, int64_t b_world) const { return node(a_world) != node(b_world); }
  int64_t world(int i) const { return offset + int64_t{tp} * i; }
  // The CP indices on CP index i's node: [lo, hi).
  int64_t node_lo(int i) const { return ceil_div(node(world(i)) * rpn - offset, tp); }
  int64_t node_hi(int i) const { return ceil_div((node(world(i)) + 1) * rpn - offset, tp); }
  // How many CP indices j in [a, b), j != i, share CP index i's node.
  int64_t same_node(int i, int64_t a, int64_t b) const {
    const int64_t n = std::max<int64_t>(0, std::min(b, node_hi(i)) - std::max(a, node_lo(i)));
    return n - (a <= i && i < b);
  }
};

// Bytes to and from a peer, on its link class.
void add_bytes(SimBytes& b, bool inter, int64_t sent, int64_t received) {
  (inter ? b.sent_inter : b.sent_intra) += sent;
  (inter ? b.received_inter : b.received_intra) += received;
}
void add_bytes(SimBytes& a, const SimBytes& b) {
  a.sent_intra += b.sent_intra;
  a.sent_inter += b.sent_inter;
  a.received_intra += b.received_intra;
  a.received_inter += b.received_inter;
}
// a += times x b, in O(1) (a step's bytes are a layer's times layers and micro-batches).
void add_bytes(SimBytes& a, const SimBytes& b, int64_t times) {
  for (auto [x, y] : {std::pair{&a.sent_intra, b.sent_intra}, std::pair{&a.sent_inter, b.sent_inter},
                      std::pair{&a.received_intra, b.received_intra}, std::pair{&a.received_inter, b.received_inter}}) {
    int64_t prod = 0;
    CPATTN_CHECK(!__builtin_mul_overflow(y, times, &prod) && !__builtin_add_overflow(*x, prod, x),
                 "a step's bytes overflow int64 (", y, " bytes x ", times,
                 " times, added to the step's count): the layers and micro-batches are too many to count them");
  }
}

// The planner's side of a simulation: what depends on the batch, the CP size and the mask only.
struct Work {
  int64_t t_loc = 0;            // local tokens per CP rank (the padded split: equal)
  std::vector<int64_t> pairs;   // [cp] per-rank work (causal: the planner's visible pairs)
  std::vector<int64_t> prefix;  // [cp + 1] running sums of pairs: a group's work in O(1)
  int64_t total_pairs = 0;      // of the whole batch, real positions only
  int max_real_chunks = 0;      // the most chunks holding a real token, over documents
  // The overlapped all-gather's groups of documents (overlap_document_cut of the pairs under
  // the mask), per direction: the small group's share of the work (0: no cut) and its rows on
  // every rank (the padded split: padded_len / cp of each of its documents).
  double fwd_share = 0, bwd_share = 0;
  int64_t fwd_rows = 0, bwd_rows = 0;
};

// What every scheme's model needs about one simulation.
struct Ctx {
  const SimInput& in;
  std::shared_ptr<const Work> work;
  int cp = 1;
  int hq = 1, hk = 1;  // heads per TP rank
  int dqk = 1, dv = 1;
  int64_t es = 2;
  int64_t t_loc = 0;  // work->t_loc
  double fwd_rate = 0, bwd_rate = 0;  // FLOP/s
  Topology topo;

  int64_t world(int cp_index) const { return topo.world(cp_index); }
  // The overlapped all-gather's KV-head groups over `ranks` ranks of `kv_heads` KV heads each
  // (cp_overlap_groups: 1 without SimInput::overlap or with nothing to gather).
  int overlap_groups(int kv_heads, int ranks) const { return overlaps(ranks) ? overlap_kv_groups(kv_heads) : 1; }
  // Whether the all-gather over `ranks` ranks runs overlapped (by KV-head groups, or with one
  // group by groups of documents: its buffers either way).
  bool overlaps(int ranks) const { return in.overlap && ranks > 1; }
  const SimLink& link(bool inter) const { return inter ? in.profile.inter : in.profile.intra; }
  double send_time(int64_t bytes, bool inter) const {
    const SimLink& l = link(inter);
    return l.latency_us * 1e-6 + static_cast<double>(bytes) / (l.bandwidth_gbs * 1e9);
  }
  // A ring over the CP indices first, first + stride, ... (count ranks): whether any of its
  // links crosses nodes (the ring collectives run at their slowest link). Nodes grow with the
  // index, so some link crosses iff the first and the last member sit on different nodes.
  bool ring_inter(int first, int stride, int count) const {
    return count > 1 && topo.inter(world(first), world(first + (count - 1) * stride));
  }
};

// Work of CP rank r under mask none: every real query over its document's real keys.
std::vector<int64_t> pairs_no_mask(std::span<const int64_t> cu, int cp) {
  const SplitLayout layout = split_layout(cu, cp, CpSplit::padded);
  std::vector<int64_t> pairs(static_cast<std::size_t>(cp), 0);
  const int64_t n = chunks_per_document(cp);
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t len = cu[d + 1] - cu[d];
    for (int64_t m = 0; m < n; ++m) {
      const DocChunk& c = layout.chunks[d * n + m];
      pairs[c.rank] += std::clamp<int64_t>(len - c.pos, 0, c.len) * len;
    }
  }
  return pairs;
}

// The batch's attention pairs (real positions only) into `total`; false when the count
// overflows int64 (L^2 of a document longer than about 3e9 tokens, or their sum).
bool total_pairs(std::span<const int64_t> cu, MaskType mask, int64_t& total) {
  total = 0;
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t len = cu[d + 1] - cu[d];
    int64_t doc = 0;
    if (__builtin_mul_overflow(len, mask == MaskType::causal ? (len + 1) : len, &doc) ||
        __builtin_add_overflow(total, mask == MaskType::causal ? doc / 2 : doc, &total))
      return false;
  }
  return true;
}

Work plan_work(std::span<const int64_t> cu, int cp, MaskType mask) {
  Work w;
  // The planner's per-rank work (what `cpattn plan` reports).
  const BalanceReport rep = balance_report(cu, cp, CpSplit::padded);
  w.t_loc = rep.padded_tokens / cp;
  w.pairs.resize(static_cast<std::size_t>(cp));
  if (mask == MaskType::causal) {
    for (int r = 0; r < cp; ++r) w.pairs[r] = rep.ranks[r].balanced.visible_pairs;
  } else {
    w.pairs = pairs_no_mask(cu, cp);
  }
  w.prefix.assign(1, 0);
  for (const int64_t x : w.pairs) w.prefix.push_back(w.prefix.back() + x);
  CPATTN_CHECK(total_pairs(cu, mask, w.total_pairs),
               "work count overflows int64: documents are too long to count their attention pairs");
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t len = cu[d + 1] - cu[d];
    const int64_t chunk = padded_length(len, cp) / chunks_per_document(cp);
    w.max_real_chunks = std::max<int>(w.max_real_chunks, static_cast<int>((len + chunk - 1) / chunk));
  }
  std::vector<double> doc_work;
  for (std::size_t d = 0; d + 1 < cu.size(); ++d)
    doc_work.push_back(document_pairs(cu[d + 1] - cu[d], mask == MaskType::causal, -1, -1));
  const OverlapDocumentCut f = overlap_document_cut(doc_work, true), b = overlap_document_cut(doc_work, false);
  w.fwd_share = f.share;
  w.bwd_share = b.share;
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t rows = padded_length(cu[d + 1] - cu[d], cp) / cp;
    if (static_cast<int64_t>(d) < f.cut) w.fwd_rows += rows;
    if (b.cut > 0 && static_cast<int64_t>(d) >= b.cut) w.bwd_rows += rows;
  }
  return w;
}

// The Work of the simulated batch per (CP size, mask), planned once for all of one call's
// predictions (every scheme, the smaller CP sizes, the bandwidth sweep). Batches of the
// length sweep are other batches: planned each time, not kept.
class WorkCache {
 public:
  explicit WorkCache(std::span<const int64_t> cu) : cu_(cu) {}
  std::shared_ptr<const Work> get(std::span<const int64_t> cu, int cp, MaskType mask) {
    if (cu.data() != cu_.data() || cu.size() != cu_.size())
      return std::make_shared<const Work>(plan_work(cu, cp, mask));
    std::shared_ptr<const Work>& w = kept_[{cp, mask}];
    if (!w) w = std::make_shared<const Work>(plan_work(cu, cp, mask));
    return w;
  }

 private:
  std::span<const int64_t> cu_;
  std::map<std::pair<int, MaskType>, std::shared_ptr<const Work>> kept_;
};

Ctx make_ctx(const SimInput& in, WorkCache& cache) {
  const SimModel& m = in.model;
  Ctx c{.in = in, .work = cache.get(in.cu_seqlens, in.mesh.cp, m.mask), .topo = {}};
  c.cp = in.mesh.cp;
  c.hq = m.num_heads_q / in.mesh.tp;
  c.hk = m.num_heads_k / in.mesh.tp;
  c.dqk = m.head_dim_qk;
  c.dv = m.head_dim_v;
  c.es = static_cast<int64_t>(dtype_size(m.dtype));
  c.t_loc = c.work->t_loc;
  c.topo = {.tp = in.mesh.tp, .rpn = in.profile.ranks_per_node};
  const auto di = static_cast<std::size_t>(m.dtype);
  c.fwd_rate = in.profile.fwd_gflops[di] * 1e9;
  c.bwd_rate = in.profile.bwd_gflops[di] * 1e9;
  return c;
}

// Whether CP rank q's queries see any key of CP rank b's block (pass-Q sends a full partial
// only then). With the padded split, a document whose first n chunks hold real tokens lets
// rank q see block b iff b < n and q < n and (q's back chunk 2cp-1-q < n or b <= q) (mask
// none: b < n and q < n); the condition only grows with n, so the document with the most real
// chunks decides. Both ways round the pairs form intervals of CP indices:
// The ranks q whose queries see rank b's block, [lo, hi): q < n, and causal q >= min(b, 2cp - n).
std::pair<int64_t, int64_t> visible_queries(const Ctx& c, int b) {
  const int64_t n = c.work->max_real_chunks, cp = c.cp, hi = std::min(n, cp);
  if (b >= n) return {0, 0};
  if (c.in.model.mask == MaskType::none) return {0, hi};
  return {std::min<int64_t>(b, std::max<int64_t>(0, 2 * cp - n)), hi};
}
// The ranks b whose block rank q's queries see, [lo, hi): b < n, and causal (unless q's back
// chunk is real) b <= q.
std::pair<int64_t, int64_t> visible_blocks(const Ctx& c, int q) {
  const int64_t n = c.work->max_real_chunks, cp = c.cp, hi = std::min(n, cp);
  if (q >= n) return {0, 0};
  if (c.in.model.mask == MaskType::none || 2 * cp - 1 - q < n) return {0, hi};
  return {0, std::min<int64_t>(hi, int64_t{q} + 1)};
}

// A call's compute: the kernel's FLOPs at the profile's rate, and the scheme's overhead on that
// kernel time (MachineProfile::fwd_overhead / bwd_overhead; 0 prices the kernel alone).
void set_compute(const Ctx& c, CpScheme s, int64_t pairs, int heads, bool backward, SimCall& call) {
  const double kernel =
      attention_flops(pairs, heads, c.dqk, c.dv, backward) / (backward ? c.bwd_rate : c.fwd_rate);
  const auto& over = backward ? c.in.profile.bwd_overhead : c.in.profile.fwd_overhead;
  call.overhead_s = kernel * over[static_cast<std::size_t>(c.in.model.dtype)][static_cast<std::size_t>(s)];
  call.compute_s = kernel + call.overhead_s;
}

// The agreement before every call: a ring all-gather of kAgreementBlockBytes bytes over `count`
// ranks first, first + stride, ...
void agreement(const Ctx& c, int r, int first, int stride, int count, SimBytes& bytes, double& time) {
  if (count <= 1) return;
  const int me = (r - first) / stride;
  const int right = first + ((me + 1) % count) * stride, left = first + ((me + count - 1) % count) * stride;
  const int64_t n = (count - 1) * kAgreementBlockBytes;
  (c.topo.inter(c.world(r), c.world(right)) ? bytes.sent_inter : bytes.sent_intra) += n;
  (c.topo.inter(c.world(left), c.world(r)) ? bytes.received_inter : bytes.received_intra) += n;
  time += (count - 1) * c.send_time(kAgreementBlockBytes, c.ring_inter(first, stride, count));
}

// A ring collective (all-gather, reduce-scatter) or a chain of shifts on rank r: `steps`
// transfers of `block` bytes to the right neighbour, from the left one.
double ring_transfer(const Ctx& c, int r, int first, int stride, int count, int64_t steps, int64_t block,
                     SimBytes& bytes) {
  if (count <= 1 || steps == 0) return 0;
  const int me = (r - first) / stride;
  const int right = first + ((me + 1) % count) * stride, left = first + ((me + count - 1) % count) * stride;
  (c.topo.inter(c.world(r), c.world(right)) ? bytes.sent_inter : bytes.sent_intra) += steps * block;
  (c.topo.inter(c.world(left), c.world(r)) ? bytes.received_inter : bytes.received_intra) += steps * block;
  return static_cast<double>(steps) * c.send_time(block, c.ring_inter(first, stride, count));
}

// An all-to-all of equal blocks over the group of `count` CP ranks first, first + 1, ...:
// every peer's block posted at once, so each link class takes its own peers' messages.
double all_to_all(const Ctx& c, int r, int first, int count, int64_t block, SimBytes& bytes) {
  const int64_t same = c.topo.same_node(r, first, int64_t{first} + count);
  const int64_t peers[2] = {same, count - 1 - same};
  add_bytes(bytes, false, peers[0] * block, peers[0] * block);
  add_bytes(bytes, true, peers[1] * block, peers[1] * block);
  double t = 0;
  for (int k = 0; k < 2; ++k)
    if (peers[k] > 0) t = std::max(t, static_cast<double>(peers[k]) * c.send_time(block, k == 1));
  return t;
}

// Why the heads per TP rank cannot be split over an all-to-all group of `inner` ranks (empty
// when they can): CpAttention's rule (cpattn/cp_scheme.hpp head_split_error).
std::string head_rule(const Ctx& c, int inner) {
  const std::string why = head_split_error(c.hq, c.hk, inner);
  return why.empty() ? why
                     : "per TP rank (SimModel::num_heads_q / SimMesh::tp query heads, SimModel::num_heads_k / "
                       "SimMesh::tp KV heads): " + why;
}

// The hybrid's default all-to-all group: the largest divisor of cp whose TP x group ranks fit a
// node and whose heads split.
int default_inner(const Ctx& c) {
  int best = 1;
  for (int i = 1; i <= c.cp; ++i) {
    if (c.cp % i == 0 && int64_t{c.topo.tp} * i <= c.topo.rpn && head_rule(c, i).empty()) best = i;
  }
  return best;
}

// ---- The schemes, one call on CP rank r -----------------------------------------------------

// One transfer and kernel call of the overlapped all-gather (CpAttention's units): the rows
// it moves of every rank and its share of the call's work.
struct SimUnit {
  int64_t rows = 0;
  double work = 0;
};
// The all-gather's units (overlap_units: one per KV-head group of overlap_groups, the
// forward's first group and the backward's last in two groups of documents where the batch has
// a cut; without overlap one unit of every row) and each one's share of the call's work. A
// group of documents holds the batch's share of the work on every rank (the balanced split's
// premise): Work::fwd_share for the forward's first, Work::bwd_share for the backward's last.
std::vector<SimUnit> sim_units(const Ctx& c, int groups, bool backward) {
  const double per = 1.0 / groups, share = !c.overlaps(c.cp) ? 0 : backward ? c.work->bwd_share : c.work->fwd_share;
  const int64_t rows = backward ? c.work->bwd_rows : c.work->fwd_rows;
  std::vector<SimUnit> units;
  for (const OverlapUnit& u : overlap_units(groups, share > 0, backward)) {
    const bool small = u.part == (backward ? 1 : 0);
    if (u.part < 0)
      units.push_back({c.t_loc, per});
    else
      units.push_back(small ? SimUnit{rows, per * share} : SimUnit{c.t_loc - rows, per * (1 - share)});
  }
  return units;
}

// The all-gather's units (sim_units), on rank r. Forward: the units' K/V travel one after the
// other (CpAttention chains each peer's sends), and unit u's call starts once its K/V are in
// and unit u - 1's call has ended; what the calls wait is exposed: without overlap (one unit)
// the whole gather, with it the first unit's transfer and what a later one takes beyond the
// calls before it. Backward: unit u's dK/dV leave when its call has ended and unit u - 1's
// have left; what the last takes past the last call is exposed. The rest is hidden. (Summed as
// waits, so that one unit gives its transfer exactly, not (transfer + compute) - compute.)
void allgather_calls(const Ctx& c, int r, SimCall& f, SimCall& b) {
  const int cp = c.cp, groups = c.overlap_groups(c.hk, cp);
  const int64_t hk_g = c.hk / groups;
  // A unit's K and V (forward, storage dtype) or dK and dV (backward, fp32) of `rows` rows.
  const auto transfer = [&](int64_t rows, int64_t es, SimBytes& bytes) {
    return ring_transfer(c, r, 0, 1, cp, cp - 1, rows * hk_g * c.dqk * es, bytes) +
           ring_transfer(c, r, 0, 1, cp, cp - 1, rows * hk_g * c.dv * es, bytes);
  };
  const auto account = [](SimCall& call, double moved, double exposed) {
    call.exposed_s += exposed;
    call.hidden_s += std::max(0.0, moved - exposed);
  };
  set_compute(c, CpScheme::allgather, c.work->pairs[r], c.hq, false, f);
  agreement(c, r, 0, 1, cp, f.agreement, f.exposed_s);
  double in = 0, end = 0, waited = 0;  // when the units' K/V are in; when the last call ends
  for (const SimUnit& u : sim_units(c, groups, false)) {
    in += transfer(u.rows, c.es, f.payload);
    waited += std::max(0.0, in - end);
    end = std::max(end, in) + f.compute_s * u.work;
  }
  account(f, in, waited);
  set_compute(c, CpScheme::allgather, c.work->pairs[r], c.hq, true, b);
  agreement(c, r, 0, 1, cp, b.agreement, b.exposed_s);
  const std::vector<SimUnit> units = sim_units(c, groups, true);
  double done = 0, sent = 0, moved = 0, exposed = 0;  // when the calls end; when the dK/dV are out
  for (std::size_t i = 0; i < units.size(); ++i) {
    done += b.compute_s * units[i].work;
    const double y = transfer(units[i].rows, 4, b.payload);
    moved += y;
    // past the last call: what the earlier units' dK/dV still take, then the last's own
    if (i + 1 == units.size()) exposed = std::max(0.0, sent - done) + y;
    sent = std::max(sent, done) + y;
  }
  account(b, moved, exposed);
}

// Partials of `part` bytes going home over a ring's steps: full to every rank of [to) but r,
// from every rank of [from) but r (empty messages otherwise; both sets are intervals of CP
// indices). Returns the slowest partial's transfer.
double partials_home(const Ctx& c, int r, std::pair<int64_t, int64_t> to, std::pair<int64_t, int64_t> from,
                     int64_t part, SimBytes& bytes) {
  const auto [to_lo, to_hi] = to;
  const auto [from_lo, from_hi] = from;
  const int64_t sends = std::max<int64_t>(0, to_hi - to_lo) - (to_lo <= r && r < to_hi);
  const int64_t receives = std::max<int64_t>(0, from_hi - from_lo) - (from_lo <= r && r < from_hi);
  const int64_t sends_intra = c.topo.same_node(r, to_lo, to_hi);
  const int64_t receives_intra = c.topo.same_node(r, from_lo, from_hi);
  add_bytes(bytes, false, sends_intra * part, receives_intra * part);
  add_bytes(bytes, true, (sends - sends_intra) * part, (receives - receives_intra) * part);
  double t = 0;
  if (sends_intra > 0) t = c.send_time(part, false);
  if (sends > sends_intra) t = std::max(t, c.send_time(part, true));
  return t;
}

// The overlap of a ring of `cp` steps: step s computes while the next block travels
// (transfer `xfer` per step, cp - 1 of them); compute is spread evenly over the steps.
void overlap_steps(int cp, double compute, double xfer, SimCall& call) {
  const double step = compute / cp;
  call.exposed_s += (cp - 1) * std::max(0.0, xfer - step);
  call.hidden_s += (cp - 1) * std::min(step, xfer);
}

void ring_calls(const Ctx& c, int r, SimCall& f, SimCall& b) {
  const int cp = c.cp;
  const int64_t kv_block = c.t_loc * c.hk * (c.dqk + c.dv) * c.es;  // K and V, in flight together
  const int64_t dkv_block = c.t_loc * c.hk * (c.dqk + c.dv) * 4;
  double t = 0;
  agreement(c, r, 0, 1, cp, f.agreement, t);
  f.exposed_s = t;
  set_compute(c, CpScheme::ring, c.work->pairs[r], c.hq, false, f);
  SimBytes dummy;
  const double kv_t = ring_transfer(c, r, 0, 1, cp, 1, kv_block, dummy);
  ring_transfer(c, r, 0, 1, cp, cp - 1, kv_block, f.payload);
  overlap_steps(cp, f.compute_s, kv_t, f);

  t = 0;
  agreement(c, r, 0, 1, cp, b.agreement, t);
  b.exposed_s = t;
  set_compute(c, CpScheme::ring, c.work->pairs[r], c.hq, true, b);
  // The blocks travel again; each step's partial dK/dV goes home to the block's owner under
  // the next step's compute, the last one exposed.
  if (cp == 1) return;
  ring_transfer(c, r, 0, 1, cp, cp - 1, kv_block, b.payload);
  const double part_t = partials_home(c, r, visible_blocks(c, r), visible_queries(c, r), dkv_block, b.payload);
  // cp - 1 shifts and cp - 1 partials: all but the last partial (sent after the last step,
  // exposed) travel under a later step, spread evenly over the cp - 1 overlapped steps.
  overlap_steps(cp, b.compute_s, kv_t + part_t * (cp - 2) / (cp - 1), b);
  b.exposed_s += part_t;
}

// Pass-Q: blocks of `block` bytes around the ring, partials of `part` bytes back to their owners.
void pass_q_call(const Ctx& c, int r, int64_t block, int64_t part, double compute, SimCall& call) {
  const int cp = c.cp;
  if (cp == 1) return;
  ring_transfer(c, r, 0, 1, cp, cp - 1, block, call.payload);
  SimBytes dummy;
  const double block_t = ring_transfer(c, r, 0, 1, cp, 1, block, dummy);
  // Over the cp - 1 steps, rank r hosts every other rank's queries once (a partial back to
  // each owner whose queries see r's block) and sends its own to every other rank (a partial
  // from each helper whose block they see).
  const double part_t = partials_home(c, r, visible_queries(c, r), visible_blocks(c, r), part, call.payload);
  // cp - 1 shifts and cp - 1 partials (step 0 is local): all but the last partial (sent after
  // the last step, exposed) travel under a later step, as the ring's backward counts them (this
  // counted cp partials, one too many).
  overlap_steps(cp, compute, block_t + part_t * (cp - 2) / (cp - 1), call);
  call.exposed_s += part_t;
}

void pass_q_calls(const Ctx& c, int r, SimCall& f, SimCall& b) {
  const int64_t n_lse = c.t_loc * c.hq;
  double t = 0;
  agreement(c, r, 0, 1, c.cp, f.agreement, t);
  f.exposed_s = t;
  set_compute(c, CpScheme::pass_q, c.work->pairs[r], c.hq, false, f);
  pass_q_call(c, r, n_lse * c.dqk * c.es, n_lse * (1 + c.dv) * 4, f.compute_s, f);
  t = 0;
  agreement(c, r, 0, 1, c.cp, b.agreement, t);
  b.exposed_s = t;
  set_compute(c, CpScheme::pass_q, c.work->pairs[r], c.hq, true, b);
  pass_q_call(c, r, n_lse * 4 + n_lse * (c.dqk + 2 * c.dv) * c.es, n_lse * c.dqk * 4, b.compute_s, b);
}

// a2a (inner = cp) and hybrid (inner < cp, the all-gather outer scheme over cp / inner groups).
void a2a_calls(const Ctx& c, CpScheme s, int r, int inner, const HeadSplit& h, SimCall& f, SimCall& b) {
  const int cp = c.cp, outer = cp / inner;
  const int first = r / inner * inner, member = r % inner;
  const int64_t t = c.t_loc, g = inner * t;
  // Work: the group's members' queries over their causal prefixes, hq_loc heads.
  int64_t pairs = 0;
  if (outer == 1) {
    pairs = c.work->total_pairs;
  } else {
    pairs = c.work->prefix[first + inner] - c.work->prefix[first];
  }
  double time = 0;
  agreement(c, r, 0, 1, cp, f.agreement, time);
  f.exposed_s = time;
  f.exposed_s += all_to_all(c, r, first, inner, t * h.hq_loc() * c.dqk * c.es, f.payload);  // q
  f.exposed_s += all_to_all(c, r, first, inner, t * h.kv_loc() * c.dqk * c.es, f.payload);  // k
  f.exposed_s += all_to_all(c, r, first, inner, t * h.kv_loc() * c.dv * c.es, f.payload);   // v
  if (outer > 1) {  // the outer layer's own agreement and K/V all-gather (counted in CpStats)
    double ot = 0;
    agreement(c, r, member, inner, outer, f.payload, ot);
    ot += ring_transfer(c, r, member, inner, outer, outer - 1, g * h.kv_loc() * c.dqk * c.es, f.payload);
    ot += ring_transfer(c, r, member, inner, outer, outer - 1, g * h.kv_loc() * c.dv * c.es, f.payload);
    f.exposed_s += ot;
  }
  f.exposed_s += all_to_all(c, r, first, inner, t * h.hq_loc() * c.dv * c.es, f.payload);  // out
  f.exposed_s += all_to_all(c, r, first, inner, t * h.hq_loc() * 4, f.payload);            // lse
  set_compute(c, s, pairs, h.hq_loc(), false, f);

  time = 0;
  agreement(c, r, 0, 1, cp, b.agreement, time);
  b.exposed_s = time;
  b.exposed_s += all_to_all(c, r, first, inner, t * h.hq_loc() * c.dv * c.es, b.payload);  // dout
  if (outer > 1) {
    double ot = 0;
    agreement(c, r, member, inner, outer, b.payload, ot);
    ot += ring_transfer(c, r, member, inner, outer, outer - 1, g * h.kv_loc() * c.dqk * 4, b.payload);
    ot += ring_transfer(c, r, member, inner, outer, outer - 1, g * h.kv_loc() * c.dv * 4, b.payload);
    b.exposed_s += ot;
  }
  b.exposed_s += all_to_all(c, r, first, inner, t * h.hq_loc() * c.dqk * c.es, b.payload);  // dq
  b.exposed_s += all_to_all(c, r, first, inner, t * h.kv_loc() * c.dqk * c.es, b.payload);  // dk
  b.exposed_s += all_to_all(c, r, first, inner, t * h.kv_loc() * c.dv * c.es, b.payload);   // dv
  set_compute(c, s, pairs, h.hq_loc(), true, b);
}

// Bytes of attention state per rank and layer: what a forward leaves for its backward (the
// caller's q, k, v, out and the scheme's context), and the backward's transient buffers. Past
// the caller's tensors these are cp_memory_estimate's context and buffers (the kernel's scratch
// left out) for the padded split in runs mode: tests/sim/test_sim_bytes.cpp holds them equal.
struct MemoryUse {
  double saved = 0, transient = 0;
};
// An all-gather's buffers past its context (cp_memory.cpp's gather_or_ring, runs mode): `rows`
// local rows of kv_row elements and hq query heads gathered into `gathered` rows over `ranks`
// ranks, in `groups` KV-head groups (overlap_groups), `overlapped` (Ctx::overlaps) or not.
double allgather_buffers(double rows, double gathered, int ranks, double kv_row, double hq, int groups, bool overlapped) {
  if (overlapped) {
    // fp32 dK/dV of every gathered row, one group's sums, the reduce-scatter's receive blocks
    // (ranks x rows), one group's lse (the forward receives and packs into its context).
    const double per = kv_row / groups;
    return gathered * kv_row * 4 + rows * per * 4 + ranks * rows * kv_row * 4 + rows * hq / groups * 4;
  }
  // fp32 dK/dV of every gathered row (the kernel writes them at their gathered rows), this
  // rank's sums.
  return gathered * kv_row * 4 + rows * kv_row * 4;
}
MemoryUse memory_use(const Ctx& c, CpScheme s, int inner, const HeadSplit& h) {
  const auto t = static_cast<double>(c.t_loc);
  const double es = static_cast<double>(c.es);
  const double kv_row = c.hk * (c.dqk + c.dv), q_row = c.hq * (c.dqk + c.dv);
  MemoryUse m;
  m.saved = t * (q_row + kv_row) * es + t * c.hq * 4;  // q, out, k, v; lse
  switch (s) {
    case CpScheme::allgather:
      m.saved += c.cp * t * kv_row * es;  // the gathered K/V (read in document order through a row map)
      m.transient = allgather_buffers(t, c.cp * t, c.cp, kv_row, c.hq, c.overlap_groups(c.hk, c.cp), c.overlaps(c.cp));
      break;
    case CpScheme::ring:
      m.saved += t * kv_row * es;                                // the local K/V copy
      // Double-buffered [K | V] blocks; partial dK/dV (two out, two back) and the sums, fp32;
      // the running fp32 out, lse and dQ (cp_memory.cpp's ring).
      m.transient = 2 * t * kv_row * es + 5 * t * kv_row * 4 + t * c.hq * (c.dqk + c.dv + 1) * 4.0;
      break;
    case CpScheme::pass_q: {
      m.saved += t * kv_row * es;
      // The double-buffered visiting block and the partials (two out, two back), each sized for
      // forward, then grown for backward as a std::vector grows; the owner's running result; the
      // fp32 dK/dV sums (cp_memory.cpp's pass_q).
      const auto grown = [](double first, double second) {
        return second <= first ? first : std::max(2 * first, second);
      };
      const double visit = grown(t * c.hq * c.dqk * es, t * c.hq * (4 + (c.dqk + 2 * c.dv) * es));
      const double part = grown(t * c.hq * (1 + c.dv) * 4, t * c.hq * c.dqk * 4.0);
      const double acc = t * c.hq * std::max(1 + c.dv, c.dqk) * 4.0;
      m.transient = 2 * visit + 4 * part + acc + t * kv_row * 4;
      break;
    }
    case CpScheme::a2a:
    case CpScheme::hybrid: {
      // This member's heads of its group's g rows, and the outer all-gather over cp / inner
      // groups of them (cp_memory.cpp's a2a over its gather_or_ring).
      const double g = inner * t, gathered = c.cp * t;  // group rows; the outer all-gather's rows
      const double hq_loc = h.hq_loc(), kv_loc = h.kv_loc(), dmax = std::max(c.dqk, c.dv);
      const double kv_row_loc = kv_loc * (c.dqk + c.dv);
      m.saved += g * hq_loc * (c.dqk + c.dv) * es + gathered * kv_row_loc * es + g * hq_loc * 4;
      // The largest all-to-all block, each way; the group layout's k, v, dk, dv, dout and dq; the
      // fp32 lse of the group's rows, the sum of replicated dK/dV and its one-row spare.
      const double block = std::max({t * c.hq * dmax * es, g * kv_loc * dmax * es, t * c.hq * 4.0});
      const double group_layout = (2 * g * kv_row_loc + g * hq_loc * (c.dqk + c.dv)) * es;
      m.transient = 2 * block + group_layout + g * hq_loc * 4 + t * c.hk * dmax * 4 + dmax * 4;
      // The outer all-gather over cp / inner groups of g rows (overlapped per KV-head group of
      // this member's heads when SimInput::overlap).
      const int outer = c.cp / inner;
      m.transient += allgather_buffers(g, gathered, outer, kv_row_loc, hq_loc, c.overlap_groups(h.kv_loc(), outer),
                                       c.overlaps(outer));
      break;
    }
  }
  return m;
}

// Expert imbalance of a skewed router: expert e gets a share 1/(e+1)^skew, EP rank k holds
// experts [k*E/ep, (k+1)*E/ep): max over mean of the ranks' shares.
double expert_imbalance(const SimModel& m, int ep) {
  if (m.experts == 0 || ep <= 1) return 1.0;
  std::vector<double> load(static_cast<std::size_t>(ep), 0.0);
  const int per = m.experts / ep;
  for (int e = 0; e < m.experts; ++e) load[e / per] += std::pow(1.0 / (e + 1), m.expert_skew);
  const double total = std::accumulate(load.begin(), load.end(), 0.0);
  return *std::max_element(load.begin(), load.end()) / (total / ep);
}

// Where the CP groups begin relative to the node boundaries: group (tp_i, dp_i, pp_i) starts at
// world rank tp_i + tp cp (dp_i + dp pp_i), and a group's link classes depend only on that
// rank modulo ranks_per_node, so each distinct residue once (one where the groups line up with
// the nodes; at most ranks_per_node).
std::vector<int64_t> cp_group_offsets(const SimMesh& m, int rpn) {
  std::vector<int64_t> out;
  std::vector<bool> seen(static_cast<std::size_t>(rpn), false);
  const int64_t groups = int64_t{m.dp} * m.pp, stride = int64_t{m.tp} * m.cp;
  for (int64_t k = 0; k < std::min<int64_t>(groups, rpn); ++k)
    for (int64_t t = 0; t < std::min<int64_t>(m.tp, rpn); ++t) {
      const int64_t residue = (t + stride % rpn * k) % rpn;
      if (!seen[static_cast<std::size_t>(residue)]) {
        seen[static_cast<std::size_t>(residue)] = true;
        out.push_back(residue);
      }
    }
  return out;
}

SchemePrediction predict(const Ctx& c, CpScheme scheme, int inner_req) {
  const SimInput& in = c.in;
  const SimMesh& mesh = in.mesh;
  const SimModel& model = in.model;
  SchemePrediction p;
  p.scheme = scheme;
  const int cp = c.cp;
  HeadSplit h;
  int inner = 0;
  if (scheme == CpScheme::a2a) {
    inner = cp;
  } else if (scheme == CpScheme::hybrid) {
    inner = inner_req > 0 ? inner_req : default_inner(c);
    p.cp_inner = inner;
  }
  if (inner > 0) {
    const std::string why = head_rule(c, inner);
    if (!why.empty()) {
      p.valid = false;
      p.reason = std::string(to_string(scheme)) + ": " + why;
      return p;
    }
    h = {.inner = inner, .hq = c.hq, .hkv = c.hk};
  }
  // Every CP group, by where its node boundaries fall (cp_group_offsets; one where the groups
  // line up with the nodes): the calls of the group whose slowest rank is slowest. (Group 0's
  // alone priced a group that crosses nodes as one that does not.)
  const auto slowest = [cp](const std::vector<SimCall>& f, const std::vector<SimCall>& b) {
    int slow = 0;
    for (int r = 1; r < cp; ++r)
      if (f[r].time_s() + b[r].time_s() > f[slow].time_s() + b[slow].time_s()) slow = r;
    return slow;
  };
  std::vector<SimCall> fs, bs;
  double worst = -1;
  for (const int64_t offset : cp_group_offsets(mesh, in.profile.ranks_per_node)) {
    Ctx g = c;
    g.topo.offset = offset;
    fs.assign(static_cast<std::size_t>(cp), SimCall{});
    bs.assign(static_cast<std::size_t>(cp), SimCall{});
    for (int r = 0; r < cp; ++r) {
      SimCall& f = fs[r];
      SimCall& b = bs[r];
      switch (scheme) {
        case CpScheme::allgather: allgather_calls(g, r, f, b); break;
        case CpScheme::ring: ring_calls(g, r, f, b); break;
        case CpScheme::pass_q: pass_q_calls(g, r, f, b); break;
        case CpScheme::a2a:
        case CpScheme::hybrid: a2a_calls(g, scheme, r, inner, h, f, b); break;
      }
    }
    const int s = slowest(fs, bs);
    if (fs[s].time_s() + bs[s].time_s() > worst) {
      worst = fs[s].time_s() + bs[s].time_s();
      p.cp_group_offset = offset;
      p.forward.swap(fs);
      p.backward.swap(bs);
    }
  }
  // The slowest CP rank sets the pace (every call ends in collectives over the group).
  const int slow = slowest(p.forward, p.backward);
  const SimCall& f = p.forward[slow];
  const SimCall& b = p.backward[slow];

  // Per layer and micro-batch: attention, TP's all-reduces, EP's dispatch and combine.
  const int hidden = model.hidden > 0 ? model.hidden : model.num_heads_q * model.head_dim_v;
  const int64_t act = c.t_loc * hidden * c.es;  // one activation of one micro-batch on a CP rank
  double tp_time = 0;
  SimBytes tp_bytes;
  const int64_t world = int64_t{mesh.tp} * mesh.cp * mesh.dp * mesh.pp;
  const int rpn = in.profile.ranks_per_node;
  if (mesh.tp > 1) {  // Megatron: two all-reduces forward (attention, MLP), two backward; ring
    // (a TP group crosses nodes where it is larger than one, or where the node size is no
    // multiple of tp and the mesh spans nodes: a group then straddles the first boundary)
    const bool inter = mesh.tp > rpn || (rpn % mesh.tp != 0 && world > rpn);
    const int64_t piece = act / mesh.tp;
    const double one = 2.0 * (mesh.tp - 1) * c.send_time(piece, inter);
    tp_time = 2 * one;  // per direction
    add_bytes(tp_bytes, inter, 4 * 2 * (mesh.tp - 1) * piece, 4 * 2 * (mesh.tp - 1) * piece);
  }
  p.expert_imbalance = expert_imbalance(model, mesh.ep);
  double ep_time = 0;
  SimBytes ep_bytes;
  if (model.experts > 0 && mesh.ep > 1) {
    // Dispatch and combine, forward and backward: each an all-to-all of the rank's routed tokens;
    // the busiest rank receives imbalance x the mean. EP ranks are tp apart (etp = tp).
    const int64_t block = c.t_loc * model.top_k * hidden * c.es / mesh.ep;
    // EP rank j is world rank j * tp: those below ranks_per_node share rank 0's node. (The
    // group of world rank 0 alone: one that straddles a node boundary elsewhere is not priced.)
    const int64_t same = std::min<int64_t>(mesh.ep, (int64_t{in.profile.ranks_per_node} + mesh.tp - 1) / mesh.tp) - 1;
    const int64_t peers[2] = {same, mesh.ep - 1 - same};
    for (int k = 0; k < 2; ++k) {
      const auto recv = static_cast<int64_t>(std::ceil(static_cast<double>(block) * p.expert_imbalance));
      add_bytes(ep_bytes, k == 1, 4 * peers[k] * block, 4 * peers[k] * recv);
      if (peers[k] > 0) ep_time = std::max(ep_time, 2.0 * static_cast<double>(peers[k]) * c.send_time(recv, k == 1));
    }
  }
  // The schedule's unit of work is a model chunk: a stage's layers, or with interleaved 1F1B a
  // V-th of them (each chunk's activation then crosses to the next stage: V sends per micro-batch).
  const int chunks = mesh.chunks();
  const double layers_per_chunk = static_cast<double>(model.layers) / static_cast<double>(int64_t{mesh.pp} * chunks);
  const double fwd = layers_per_chunk * (f.time_s() + tp_time + ep_time);
  const double bwd = layers_per_chunk * (b.time_s() + tp_time + ep_time);
  // Stage s's rank r sends to rank r + tp cp dp of stage s + 1: some such pair crosses a node
  // boundary whenever the mesh spans nodes, and the slowest link paces the uniform transfer.
  // (It read intra when tp cp dp < ranks_per_node, though pairs across the first boundary cross.)
  const bool pp_inter = world > rpn;
  const double transfer = mesh.pp > 1 ? c.send_time(act, pp_inter) : 0.0;
  const Schedule sched = rewrite_errors(  // named by the fields (the CLI's flags) that set the schedule
      [&] {
        return make_schedule(
            {.stages = mesh.pp, .micro = mesh.micro, .schedule = mesh.schedule, .virtual_stages = chunks});
      },
      [](const std::string& m) {
        return "SimMesh::schedule with SimMesh::pp stages, SimMesh::micro micro-batches and SimMesh::virtual_stages "
               "chunks: " + m;
      });
  const Simulation sim = simulate(sched, uniform_costs(mesh.pp, fwd, bwd, 0.0, transfer));
  p.step_s = sim.makespan;
  p.bubble_fraction = sim.bubble_fraction;
  // Per action kind, how many the busiest stage runs (fill-drain runs no backward), each a chunk's.
  int n_f = 0, n_b = 0;
  for (const Action& a : sched.actions[0]) (a.kind == ActionKind::forward ? n_f : n_b) += a.kind != ActionKind::weight;
  p.compute_s = layers_per_chunk * (n_f * f.compute_s + n_b * b.compute_s);
  p.hidden_comm_s = layers_per_chunk * (n_f * f.hidden_s + n_b * b.hidden_s);
  p.exposed_comm_s = n_f * (fwd - layers_per_chunk * f.compute_s) + n_b * (bwd - layers_per_chunk * b.compute_s);
  p.bubble_s = std::max(0.0, p.step_s - p.compute_s - p.exposed_comm_s);
  const auto layers_i = static_cast<int64_t>(std::llround(layers_per_chunk));
  // Bytes are the busiest CP rank's (the most sent + received over the step), which need not
  // be the slowest one (pass-Q's partials, the hybrid's node boundaries).
  const auto call_bytes = [](const SimCall& x) {
    return x.payload.sent() + x.payload.received() + x.agreement.sent() + x.agreement.received();
  };
  int busy = 0;
  for (int r = 1; r < cp; ++r)
    if (n_f * call_bytes(p.forward[r]) + n_b * call_bytes(p.backward[r]) >
        n_f * call_bytes(p.forward[busy]) + n_b * call_bytes(p.backward[busy]))
      busy = r;
  add_bytes(p.step_bytes, p.forward[busy].payload, n_f * layers_i);
  add_bytes(p.step_bytes, p.forward[busy].agreement, n_f * layers_i);
  add_bytes(p.step_bytes, p.backward[busy].payload, n_b * layers_i);
  add_bytes(p.step_bytes, p.backward[busy].agreement, n_b * layers_i);
  SimBytes per_layer;
  add_bytes(per_layer, tp_bytes);
  add_bytes(per_layer, ep_bytes);
  add_bytes(p.step_bytes, per_layer, int64_t{mesh.micro} * chunks * layers_i);  // (every chunk's layers)
  if (mesh.pp > 1) {
    // The busiest stage's: a middle one sends each chunk's activation down and its gradient up
    // (2 V per micro-batch); at pp = 2 there is none, and each stage sends 2 V - 1 (the model's
    // first chunk receives no activation, its last sends none). This counted 2 V at pp = 2.
    const int64_t per_micro = mesh.pp == 2 ? 2 * int64_t{chunks} - 1 : 2 * int64_t{chunks};
    const int64_t pp_bytes = int64_t{mesh.micro} * per_micro * act;
    add_bytes(p.step_bytes, pp_inter, pp_bytes, pp_bytes);
  }
  const MemoryUse mem = memory_use(c, scheme, inner, h);
  int in_flight = 1;
  for (const int a : sim.peak_activations) in_flight = std::max(in_flight, a);
  p.peak_memory_gb = (layers_per_chunk * in_flight * mem.saved + mem.transient) / 1e9;  // (chunk activations)
  p.fits_memory = p.peak_memory_gb <= in.profile.memory_gb;
  return p;
}

void check_input(const SimInput& in) {
  check_machine_profile(in.profile);
  check_sim_mesh(in.mesh, in.model);
  check_cu_seqlens(in.cu_seqlens);
  const auto di = static_cast<std::size_t>(in.model.dtype);
  CPATTN_CHECK(valid_rate(in.profile.fwd_gflops[di]) && valid_rate(in.profile.bwd_gflops[di]),
               "profile has no compute rate for dtype ", to_string(in.model.dtype), ": profile.compute.fwd.",
               to_string(in.model.dtype), " and profile.compute.bwd.", to_string(in.model.dtype),
               " must be >= 0.001 (GFLOP/s), got ", in.profile.fwd_gflops[di], " and ", in.profile.bwd_gflops[di]);
}

SchemePrediction predict_checked(const SimInput& in, CpScheme scheme, WorkCache& cache) {
  return predict(make_ctx(in, cache), scheme, in.mesh.cp_inner);
}

// The same batch with every document's length scaled by f (at least 1 token).
std::vector<int64_t> scaled(std::span<const int64_t> cu, double f) {
  std::vector<int64_t> out{0};
  for (std::size_t d = 0; d + 1 < cu.size(); ++d)
    out.push_back(out.back() + std::max<int64_t>(1, std::llround(static_cast<double>(cu[d + 1] - cu[d]) * f)));
  return out;
}

// Step time at CP size `cp` (cp_inner clipped to a divisor of it for the hybrid); +inf when
// the mesh cannot take that size (check_sim_mesh: e.g. mesh.ep no longer dividing
// tp x cp x dp) or the scheme cannot run it.
double step_at(SimInput in, CpScheme s, int cp, WorkCache& cache) {
  in.mesh.cp = cp;
  if (in.mesh.cp_inner > 0) in.mesh.cp_inner = std::gcd(in.mesh.cp_inner, cp);
  try {
    check_sim_mesh(in.mesh, in.model);
  } catch (const Error&) {
    return std::numeric_limits<double>::infinity();
  }
  const SchemePrediction p = predict_checked(in, s, cache);
  return p.valid ? p.step_s : std::numeric_limits<double>::infinity();
}

// The scale x in [1/256, 256] (geometric bisection) where cp / 2 stops being slower than cp,
// varying the batch's lengths (`length`) or both links' bandwidth; 0 when no crossing.
double breakeven(const SimInput& in, CpScheme s, bool length, WorkCache& cache) {
  const int cp = in.mesh.cp;
  if (cp < 2 || cp % 2 != 0) return 0;
  std::vector<int64_t> cu;
  const auto smaller_wins = [&](double x) {
    SimInput v = in;
    if (length) {
      cu = scaled(in.cu_seqlens, x);
      v.cu_seqlens = cu;
    } else {
      v.profile.intra.bandwidth_gbs *= x;
      v.profile.inter.bandwidth_gbs *= x;
    }
    return step_at(v, s, cp / 2, cache) < step_at(v, s, cp, cache);
  };
  double lo = -8, hi = 8;  // log2 of the scale
  if (length) {
    // Cap the upward scale at the largest (in steps of 2^(1/4)) whose documents' attention
    // pairs still count in int64: long documents (16M tokens) overflow well below 256x.
    int64_t pairs = 0;
    while (hi > 0 && !total_pairs(scaled(in.cu_seqlens, std::exp2(hi)), in.model.mask, pairs)) hi -= 0.25;
  }
  const bool at_lo = smaller_wins(std::exp2(lo)), at_hi = smaller_wins(std::exp2(hi));
  if (at_lo == at_hi) return 0;
  for (int it = 0; it < 12; ++it) {
    const double mid = (lo + hi) / 2;
    (smaller_wins(std::exp2(mid)) == at_lo ? lo : hi) = mid;
  }
  return std::exp2((lo + hi) / 2);
}

}  // namespace

double attention_flops(int64_t pairs, int heads, int head_dim_qk, int head_dim_v, bool backward) {
  const double per = backward ? 2.0 * (3.0 * head_dim_qk + 2.0 * head_dim_v) : 2.0 * (head_dim_qk + head_dim_v);
  return static_cast<double>(pairs) * heads * per;
}

void check_machine_profile(const MachineProfile& p) {
  for (const DType t : {DType::f32, DType::f16, DType::bf16}) {
    const auto i = static_cast<std::size_t>(t);
    CPATTN_CHECK(std::isfinite(p.fwd_gflops[i]) && p.fwd_gflops[i] >= 0, "profile.compute.fwd.", to_string(t),
                 " must be a finite number >= 0 (GFLOP/s; 0 = unknown), got ", p.fwd_gflops[i]);
    CPATTN_CHECK(std::isfinite(p.bwd_gflops[i]) && p.bwd_gflops[i] >= 0, "profile.compute.bwd.", to_string(t),
                 " must be a finite number >= 0 (GFLOP/s; 0 = unknown), got ", p.bwd_gflops[i]);
  }
  for (const DType t : {DType::f32, DType::f16, DType::bf16})
    for (const CpScheme s : kCpSchemes)
      for (const bool bwd : {false, true}) {
        const double x = (bwd ? p.bwd_overhead : p.fwd_overhead)[static_cast<std::size_t>(t)][static_cast<std::size_t>(s)];
        CPATTN_CHECK(std::isfinite(x) && x >= 0, "profile.cp_overhead.", bwd ? "bwd." : "fwd.", to_string(t), ".",
                     to_string(s), " must be a finite number >= 0 (a fraction of the kernel time), got ", x);
      }
  check_link(p.intra, "intra_node");
  check_link(p.inter, "inter_node");
  CPATTN_CHECK(p.ranks_per_node >= 1, "profile.ranks_per_node must be >= 1, got ", p.ranks_per_node);
  CPATTN_CHECK(std::isfinite(p.memory_gb) && p.memory_gb > 0, "profile.memory_gb must be a finite number > 0 "
               "(GB per rank), got ", p.memory_gb);
}

void check_sim_mesh(const SimMesh& m, const SimModel& model) {
  CPATTN_CHECK(m.tp >= 1 && m.cp >= 1 && m.dp >= 1 && m.pp >= 1 && m.ep >= 1 && m.micro >= 1,
               "mesh sizes must be >= 1: SimMesh::tp ", m.tp, ", SimMesh::cp ", m.cp, ", SimMesh::dp ", m.dp,
               ", SimMesh::pp ", m.pp, ", SimMesh::ep ", m.ep, ", SimMesh::micro ", m.micro);
  CPATTN_CHECK(m.cp <= 65536, "SimMesh::cp must be <= 65536, got ", m.cp);
  CPATTN_CHECK(int64_t{m.tp} * m.cp * m.dp * m.pp <= (int64_t{1} << 20), "SimMesh::tp x SimMesh::cp x SimMesh::dp x "
               "SimMesh::pp = ", int64_t{m.tp} * m.cp * m.dp * m.pp, " ranks must be <= 2^20");
  CPATTN_CHECK(m.cp_inner >= 0 && (m.cp_inner == 0 || m.cp % m.cp_inner == 0), "SimMesh::cp_inner = ", m.cp_inner,
               " must divide SimMesh::cp = ", m.cp, " (cp = cp_inner x cp_outer; 0 picks one)");
  CPATTN_CHECK(m.virtual_stages >= 0 && m.virtual_stages <= 1024, "SimMesh::virtual_stages must be in 0..1024 "
               "(0: 2 with interleaved, else 1), got ", m.virtual_stages);
  CPATTN_CHECK(m.virtual_stages <= 1 || m.schedule == PipelineSchedule::interleaved, "SimMesh::virtual_stages = ",
               m.virtual_stages, " needs the interleaved schedule (SimMesh::schedule), not ",
               pipeline_schedule_name(m.schedule));
  CPATTN_CHECK(model.layers >= 1 && model.layers % (int64_t{m.pp} * m.chunks()) == 0, "SimModel::layers = ",
               model.layers, " must be >= 1 and a multiple of SimMesh::pp = ", m.pp, " x SimMesh::virtual_stages = ",
               m.chunks(), m.virtual_stages == 0 && m.chunks() > 1 ? " (its default with interleaved)" : "",
               " (equal stages and chunks)");
  CPATTN_CHECK(model.num_heads_q >= 1 && model.num_heads_k >= 1 && model.num_heads_q % model.num_heads_k == 0,
               "SimModel::num_heads_q = ", model.num_heads_q, " must be a multiple of SimModel::num_heads_k = ",
               model.num_heads_k);
  // (so that a row's and a context's sizes stay within int: 16777216 heads wrapped a K/V row to 0)
  CPATTN_CHECK(model.num_heads_q <= 65536, "SimModel::num_heads_q must be <= 65536, got ", model.num_heads_q);
  CPATTN_CHECK(model.num_heads_k % m.tp == 0, "SimModel::num_heads_k = ", model.num_heads_k,
               " must be divisible by SimMesh::tp = ", m.tp, " (each TP rank holds whole KV heads)");
  CPATTN_CHECK(model.head_dim_qk >= 1 && model.head_dim_qk <= 256 && model.head_dim_v >= 1 && model.head_dim_v <= 256,
               "SimModel::head_dim_qk and SimModel::head_dim_v must be in [1, 256], got ", model.head_dim_qk, " and ",
               model.head_dim_v);
  CPATTN_CHECK(model.hidden >= 0, "SimModel::hidden must be >= 0 (0: heads x head_dim_v), got ", model.hidden);
  CPATTN_CHECK(model.mask == MaskType::causal || model.mask == MaskType::none, "SimModel::mask must be causal or none");
  CPATTN_CHECK(model.experts >= 0, "SimModel::experts must be >= 0, got ", model.experts);
  if (model.experts > 0) {
    CPATTN_CHECK(model.experts % m.ep == 0, "SimMesh::ep = ", m.ep, " must divide SimModel::experts = ",
                 model.experts, " (each EP rank holds experts / ep experts)");
    CPATTN_CHECK(model.top_k >= 1 && model.top_k <= model.experts, "SimModel::top_k must be in [1, "
                 "SimModel::experts = ", model.experts, "], got ", model.top_k);
    CPATTN_CHECK(std::isfinite(model.expert_skew) && model.expert_skew >= 0, "SimModel::expert_skew must be >= 0, got ",
                 model.expert_skew);
  } else {
    CPATTN_CHECK(m.ep == 1, "SimMesh::ep = ", m.ep, " needs SimModel::experts (a dense model has no expert "
                 "parallelism)");
  }
  CPATTN_CHECK((int64_t{m.tp} * m.cp * m.dp) % m.ep == 0, "SimMesh::ep = ", m.ep,
               " must divide SimMesh::tp x SimMesh::cp x SimMesh::dp = ", int64_t{m.tp} * m.cp * m.dp,
               " (the ranks of a pipeline stage)");
}

namespace {

// simulate_scheme, checked, with the caller's plans.
SchemePrediction simulate_one(const SimInput& in, CpScheme scheme, WorkCache& cache) {
  SchemePrediction p = predict_checked(in, scheme, cache);
  if (!p.valid) return p;
  // The best power-of-two CP up to mesh.cp, and the crossings.
  double best = p.step_s;
  for (int c = 1; c < in.mesh.cp; c *= 2) {
    const double t = step_at(in, scheme, c, cache);
    if (t < best) {
      best = t;
      p.faster_smaller_cp = c;
    }
  }
  if (in.find_breakeven) {
    p.breakeven_length_scale = breakeven(in, scheme, true, cache);
    p.breakeven_bandwidth_scale = breakeven(in, scheme, false, cache);
  }
  return p;
}

}  // namespace

SchemePrediction simulate_scheme(const SimInput& in, CpScheme scheme) {
  check_input(in);
  WorkCache cache(in.cu_seqlens);
  return simulate_one(in, scheme, cache);
}

SimReport simulate_step(const SimInput& in) {
  check_input(in);
  SimReport rep;
  WorkCache cache(in.cu_seqlens);
  const Ctx c = make_ctx(in, cache);
  const std::vector<int64_t>& pairs = c.work->pairs;
  rep.tokens = in.cu_seqlens.back();
  rep.padded_tokens = c.t_loc * c.cp;
  rep.visible_pairs = pairs;
  const double mean = std::accumulate(pairs.begin(), pairs.end(), 0.0) / c.cp;
  rep.imbalance = mean > 0 ? static_cast<double>(*std::max_element(pairs.begin(), pairs.end())) / mean : 1.0;
  double best = std::numeric_limits<double>::infinity();
  for (const CpScheme s : kCpSchemes) {
    rep.schemes.push_back(simulate_one(in, s, cache));
    const SchemePrediction& p = rep.schemes.back();
    if (p.valid && p.step_s < best) {
      best = p.step_s;
      rep.best = s;
    }
  }
  return rep;
}

int64_t sim_lengths_documents(int64_t tokens, double mean) {
  if (tokens < 1 || !std::isfinite(mean) || mean < 1) return 1;
  const double docs = static_cast<double>(tokens) / mean * 1.25 + 64;
  return docs >= static_cast<double>(tokens) ? tokens : static_cast<int64_t>(docs);
}

uint64_t sim_memory_bytes(int64_t documents, int cp) {
  const auto d = static_cast<uint64_t>(std::max<int64_t>(documents, 1));
  const auto c = static_cast<uint64_t>(std::clamp(cp, 1, 65536));
  // The chunk table of one planning (split_layout; pairs_no_mask's the same), one at a time.
  const uint64_t chunks = saturating_mul(saturating_mul(d, 2 * c), sizeof(DocChunk));
  // The length sweep's scaled boundaries and total_pairs' copy of them.
  const uint64_t scaled = saturating_mul(saturating_add(d, 1), 2 * sizeof(int64_t));
  // Per CP size kept (cp and every power of two below it): pairs and prefix; balance_report's ranks.
  uint64_t sizes = 2;
  for (uint64_t x = 1; x < c; x *= 2) ++sizes;
  const uint64_t work = sizes * (2 * c + 1) * sizeof(int64_t) + c * sizeof(RankBalance);
  // Every scheme's prediction kept and one more being made: forward and backward calls per rank.
  const uint64_t calls = (std::size(kCpSchemes) + 1) * 2 * c * sizeof(SimCall);
  return saturating_add(saturating_add(chunks, scaled), work + calls);
}

std::vector<int64_t> sim_lengths(std::string_view distribution, int64_t tokens, double mean, double sigma,
                                 uint64_t seed) {
  CPATTN_CHECK(tokens >= 1, "sim_lengths: tokens must be >= 1, got ", tokens);
  CPATTN_CHECK(std::isfinite(mean) && mean >= 1, "sim_lengths: mean must be >= 1, got ", mean);
  CPATTN_CHECK(std::isfinite(sigma) && sigma >= 0 && sigma <= 100,
               "sim_lengths: sigma must be in [0, 100] (a lognormal's log-space spread), got ", sigma);
  CPATTN_CHECK(distribution == "fixed" || distribution == "uniform" || distribution == "lognormal",
               "sim_lengths: distribution must be one of fixed, uniform, lognormal, got '", distribution, "'");
  std::mt19937_64 rng(seed);
  std::vector<int64_t> cu{0};
  while (cu.back() < tokens) {
    double len = mean;
    if (distribution == "uniform") {
      len = static_cast<double>(
          std::uniform_int_distribution<int64_t>(1, std::max<int64_t>(1, std::llround(std::min(2 * mean - 1, 1e18))))(rng));
    } else if (distribution == "lognormal") {
      len = std::lognormal_distribution<double>(std::log(mean) - sigma * sigma / 2, sigma)(rng);
    }
    // (clamped as a double first: llround of a value past int64, or of a NaN, is undefined, and
    // gave 1 or INT64_MIN here)
    if (!(len >= 1.0)) len = 1.0;
    const int64_t l = std::llround(std::min(len, static_cast<double>(tokens - cu.back())));
    cu.push_back(cu.back() + l);
  }
  return cu;
}

}  // namespace cpattn
