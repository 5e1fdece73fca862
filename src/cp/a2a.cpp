// The all-to-all level of the a2a and hybrid CP schemes (a2a.hpp, docs/cp.md).
#include "a2a.hpp"

#include <algorithm>
#include <chrono>
#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cstring>
#include <optional>
#include <string>

namespace cpattn::detail {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Which heads of a tensor member i of the group sends or receives: [first(i), first(i) + count).
struct HeadRange {
  const HeadSplit& split;
  bool kv;  // the KV heads (else the query heads)
  int count() const { return kv ? split.kv_loc() : split.hq_loc(); }
  int first(int i) const { return kv ? split.kv_lo(i) : i * split.hq_loc(); }
};

// send[i][j] = heads `r` of member i of row j of `src` ([T, heads, dim], possibly strided):
// the all-to-all's blocks, member-major, each [T, r.count(), dim].
void pack_heads(ConstTensorView src, HeadRange r, int inner, std::vector<std::byte>& send) {
  const std::size_t es = dtype_size(src.dtype);
  const std::size_t piece = static_cast<std::size_t>(src.dim) * es;
  send.resize(static_cast<std::size_t>(inner) * src.rows * r.count() * piece);
  std::byte* o = send.data();
  for (int i = 0; i < inner; ++i)
    for (int64_t j = 0; j < src.rows; ++j)
      for (int h = 0; h < r.count(); ++h, o += piece)
        std::memcpy(o, static_cast<const std::byte*>(src.data) + src.offset(j, r.first(i) + h) * es, piece);
}

// The inverse: heads `r` of member i of row j of `dst` = recv[i][j].
void unpack_heads(const std::vector<std::byte>& recv, HeadRange r, int inner, TensorView dst) {
  const std::size_t es = dtype_size(dst.dtype);
  const std::size_t piece = static_cast<std::size_t>(dst.dim) * es;
  const std::byte* in = recv.data();
  for (int i = 0; i < inner; ++i)
    for (int64_t j = 0; j < dst.rows; ++j)
      for (int h = 0; h < r.count(); ++h, in += piece)
        std::memcpy(static_cast<std::byte*>(dst.data) + dst.offset(j, r.first(i) + h) * es, in, piece);
}

// The same as unpack_heads, but added into fp32 [T, heads, dim] (replicated KV heads receive
// one part per replica; added in member order, so the sum is repeatable).
void add_heads(const std::vector<std::byte>& recv, HeadRange r, int inner, DType t, int64_t rows, int heads, int dim,
               std::vector<float>& acc, std::vector<float>& tmp) {
  const std::size_t piece = static_cast<std::size_t>(dim) * dtype_size(t);
  acc.assign(static_cast<std::size_t>(rows) * heads * dim, 0.0f);
  tmp.resize(static_cast<std::size_t>(dim));
  const std::byte* in = recv.data();
  for (int i = 0; i < inner; ++i)
    for (int64_t j = 0; j < rows; ++j)
      for (int h = 0; h < r.count(); ++h, in += piece) {
        to_float(in, t, tmp.size(), tmp.data());
        float* a = acc.data() + (j * heads + r.first(i) + h) * dim;
        for (int e = 0; e < dim; ++e) a[e] += tmp[e];
      }
}

// Rows between the all-to-all's member-major blocks and the group layout: block row k (member
// k / T, its local row k % T) is group row row_of[k]. dst[row_of[k]] = src[k] ...
void to_group(const std::vector<std::byte>& src, const std::vector<int64_t>& row_of, std::size_t row_bytes,
              std::vector<std::byte>& dst) {
  dst.resize(row_of.size() * row_bytes);
  for (std::size_t k = 0; k < row_of.size(); ++k)
    std::memcpy(dst.data() + row_of[k] * row_bytes, src.data() + k * row_bytes, row_bytes);
}
// ... and dst[k] = src[row_of[k]].
void from_group(const std::byte* src, const std::vector<int64_t>& row_of, std::size_t row_bytes,
                std::vector<std::byte>& dst) {
  dst.resize(row_of.size() * row_bytes);
  for (std::size_t k = 0; k < row_of.size(); ++k)
    std::memcpy(dst.data() + k * row_bytes, src + row_of[k] * row_bytes, row_bytes);
}

// The group layout's row of every member's local rows (docs: the cp-level split, the same on
// every rank): member i's front chunk of document d lands at offset i*c of the group's front
// coarse chunk, its back chunk at offset (inner-1-i)*c of the back coarse chunk, which start
// at inner * local_begin and inner * local_begin + inner * c.
std::vector<int64_t> group_rows(const RankPlan& p, int inner) {
  std::vector<int64_t> row_of(static_cast<std::size_t>(inner * p.local_tokens));
  const int64_t n = p.cp == 1 ? 1 : 2;  // chunks of a document a rank holds
  for (int i = 0; i < inner; ++i)
    for (const DocSplit& d : p.docs)
      for (int64_t off = 0; off < n * d.chunk; ++off) {
        const int64_t base = inner * d.local_begin;
        row_of[static_cast<std::size_t>(i * p.local_tokens + d.local_begin + off)] =
            off < d.chunk ? base + i * d.chunk + off : base + (2 * inner - 1 - i) * d.chunk + (off - d.chunk);
      }
  return row_of;
}

}  // namespace

RankPlan a2a_outer_plan(const RankPlan& p, int inner) {
  CPATTN_CHECK(inner >= 1 && p.cp % inner == 0, "the a2a/hybrid scheme's all-to-all groups of ", inner,
               " ranks (cp_inner) must divide the plan's cp = ", p.cp);
  CPATTN_CHECK(p.split == CpSplit::padded, "the a2a and hybrid schemes take the padded split, the plan is ",
               to_string(p.split));
  RankPlan g = get_thd_load_balanced_cp_metadata(p.cu_seqlens_padded, p.cp / inner, p.rank / inner);
  g.cu_seqlens = p.cu_seqlens;
  g.global_tokens = p.global_tokens;
  for (std::size_t d = 0; d < g.docs.size(); ++d) g.docs[d].len = p.docs[d].len;
  g.padding_tokens = 0;
  for (std::size_t i = 0; i < g.global_token_index.size(); ++i) {
    const int64_t gi = g.global_token_index[i];
    const auto d = static_cast<std::size_t>(
        std::upper_bound(p.cu_seqlens_padded.begin(), p.cu_seqlens_padded.end(), gi) - p.cu_seqlens_padded.begin() - 1);
    const int64_t off = gi - p.cu_seqlens_padded[d];
    g.real_token_index[i] = off < p.docs[d].len ? p.cu_seqlens[d] + off : -1;
    g.padding_tokens += g.real_token_index[i] < 0;
  }
  return g;
}

struct A2aLevel::Impl {
  Communicator& comm;
  CpAttnConfig outer_cfg;  // the outer layer's: this member's heads
  HeadSplit split;
  DType dtype;
  int dqk, dv;
  int inner, member, group;
  std::optional<Communicator> inner_comm, outer_comm;  // split at the first forward
  std::unique_ptr<CpAttention> outer_attn;
  // The group layout's rows, of rows_plan (the last forward's or backward's), and the outer
  // layer's plan, of plan (the last forward's).
  std::shared_ptr<const RankPlan> rows_plan, plan;
  std::vector<int64_t> row_of;
  std::shared_ptr<const RankPlan> outer_plan;
  std::vector<std::byte> send, recv, k_g, v_g, dout_g, dq_g, dk_g, dv_g;
  std::vector<float> lse_g, acc, tmp;

  Impl(Communicator& c, const CpAttnConfig& cfg, int inner_size)
      : comm(c),
        outer_cfg(cfg),
        split(head_split(cfg.num_heads_q, cfg.num_heads_k, inner_size,
                         "CpAttention (" + std::string(to_string(cfg.scheme)) + ")")),
        dtype(cfg.dtype),
        dqk(cfg.head_dim_qk),
        dv(cfg.head_dim_v),
        inner(inner_size),
        member(c.rank() % inner_size),
        group(c.rank() / inner_size) {
    outer_cfg.num_heads_q = split.hq_loc();
    outer_cfg.num_heads_k = split.kv_loc();
    AttnOptions& o = outer_cfg.options;
    if (o.alibi_slopes) o.alibi_slopes += member * split.hq_loc();
    o.dropout_head_offset += member * split.hq_loc();  // drops what a run of every head drops
    outer_cfg.scheme = cfg.scheme == CpScheme::hybrid ? cfg.hybrid_outer : CpScheme::allgather;
    outer_cfg.cp_inner = 0;  // shared_memory is the caller's: the hybrid's outer all-gather takes it
    outer_cfg.check_finite = false;     // checked on the caller's tensors
    outer_cfg.plan_cache_capacity = 1;  // it is handed plans
  }

  bool poisoned() const {  // (connect may have split the inner group and failed on the outer one)
    return (inner_comm && inner_comm->poisoned()) || (outer_comm && outer_comm->poisoned());
  }

  HeadRange q_heads() const { return {split, false}; }
  HeadRange kv_heads() const { return {split, true}; }
  std::size_t row_bytes(int heads, int dim) const { return static_cast<std::size_t>(heads) * dim * dtype_size(dtype); }

  void connect(const std::function<void(CpAttention&)>& made) {
    if (outer_attn) return;
    inner_comm.emplace(comm.split(group, member));
    outer_comm.emplace(comm.split(member, group));
    outer_attn = std::make_unique<CpAttention>(*outer_comm, outer_cfg);
    made(*outer_attn);
  }

  // (Each key is cleared first: a failure leaves nothing half made to be taken for p's.)
  void rows_for(const std::shared_ptr<const RankPlan>& p) {
    if (rows_plan == p) return;
    rows_plan = nullptr;
    row_of = group_rows(*p, inner);
    rows_plan = p;
  }
  const RankPlan& prepare(const std::shared_ptr<const RankPlan>& p) {
    rows_for(p);
    if (plan != p) {
      plan = nullptr;
      outer_plan = std::make_shared<const RankPlan>(a2a_outer_plan(*p, inner));
      plan = p;
    }
    return *outer_plan;
  }

  // Equal blocks of `block` bytes to and from every member.
  void exchange(std::size_t block, CpStats& stats) {
    const auto t0 = Clock::now();
    const std::vector<int64_t> counts(static_cast<std::size_t>(inner), static_cast<int64_t>(block));
    recv.resize(block * inner);
    try {
      inner_comm->all_to_all_v<std::byte>(send, counts, recv, counts);
    } catch (...) {
      inner_comm->keep_if_poisoned(send, recv);
      throw;
    }
    stats.comm_s += seconds_since(t0);
  }

  // Heads `r` of a [T, heads, dim] tensor of this rank into the group layout [inner*T, r.count(), dim].
  void scatter_heads(ConstTensorView src, HeadRange r, std::vector<std::byte>& dst, CpStats& stats) {
    auto t0 = Clock::now();
    pack_heads(src, r, inner, send);
    stats.compute_s += seconds_since(t0);
    exchange(send.size() / inner, stats);
    t0 = Clock::now();
    to_group(recv, row_of, row_bytes(r.count(), src.dim), dst);
    stats.compute_s += seconds_since(t0);
  }

  // The inverse: the group layout's rows (`row` bytes each) back to their members, received
  // into recv as [inner][T] blocks of this rank's rows.
  void gather_heads(const std::byte* src, std::size_t row, CpStats& stats) {
    const auto t0 = Clock::now();
    from_group(src, row_of, row, send);
    stats.compute_s += seconds_since(t0);
    exchange(send.size() / inner, stats);
  }

  // Adds the outer layer's seconds and counts since `before`; returns its transfers' time in
  // flight under its compute since then (comm_total_s - comm_s: the caller's hidden time).
  double add_outer(const CpStats& before, CpStats& stats) const {
    const CpStats& now = outer_attn->stats();
    stats.compute_s += now.compute_s - before.compute_s;
    stats.comm_s += now.comm_s - before.comm_s;
    stats.shared_forwards += now.shared_forwards - before.shared_forwards;
    stats.shared_backwards += now.shared_backwards - before.shared_backwards;
    stats.shared_packs += now.shared_packs - before.shared_packs;
    if (stats.shared_memory_off.empty()) stats.shared_memory_off = now.shared_memory_off;
    return (now.comm_total_s - now.comm_s) - (before.comm_total_s - before.comm_s);
  }

  double forward(const CpForwardArgs& a, const std::shared_ptr<const RankPlan>& p, uint64_t seed,
                 std::vector<float>& lse, A2aContext& ctx, CpStats& stats) {
    prepare(p);  // (CpAttention connected and prepared before its agreement: a no-op then)
    const int64_t t = p->local_tokens, g = inner * t;
    const int hq = split.hq_loc(), hk = split.kv_loc();
    scatter_heads(a.q, q_heads(), ctx.q, stats);
    scatter_heads(a.k, kv_heads(), k_g, stats);
    scatter_heads(a.v, kv_heads(), v_g, stats);
    ctx.out.resize(static_cast<std::size_t>(g) * row_bytes(hq, dv));
    lse_g.resize(static_cast<std::size_t>(g) * hq);
    const CpStats before = outer_attn->stats();
    try {
      ctx.outer = outer_attn->forward({.plan = outer_plan,
                                       .q = contiguous(ctx.q.data(), g, hq, dqk, dtype),
                                       .k = contiguous(k_g.data(), g, hk, dqk, dtype),
                                       .v = contiguous(v_g.data(), g, hk, dv, dtype),
                                       .out = contiguous(ctx.out.data(), g, hq, dv, dtype),
                                       .lse = lse_g.data(),
                                       .dropout_seed = seed});
    } catch (...) {  // the outer layer keeps its own buffers; the ones it was handed are ours
      outer_comm->keep_if_poisoned(ctx.q, k_g, v_g, ctx.out, lse_g);
      throw;
    }
    const double hidden = add_outer(before, stats);
    gather_heads(ctx.out.data(), row_bytes(hq, dv), stats);
    unpack_heads(recv, q_heads(), inner, a.out);
    gather_heads(reinterpret_cast<const std::byte*>(lse_g.data()), hq * sizeof(float), stats);
    lse.resize(static_cast<std::size_t>(t) * split.hq);
    unpack_heads(recv, q_heads(), inner, contiguous(lse.data(), t, split.hq, 1));
    return hidden;
  }

  // dK or dV of the group layout ([inner*T, kv_loc, dim]) back to this rank's tokens, every
  // replica's part added (fp32), rounded once into `dst`.
  void return_kv_grad(const std::vector<std::byte>& grad, TensorView dst, CpStats& stats) {
    gather_heads(grad.data(), row_bytes(split.kv_loc(), dst.dim), stats);
    const auto t0 = Clock::now();
    add_heads(recv, kv_heads(), inner, dtype, dst.rows, dst.heads, dst.dim, acc, tmp);
    from_float(acc.data(), acc.size(), dtype, dst.data);
    stats.compute_s += seconds_since(t0);
  }

  double backward(A2aContext& ctx, const std::shared_ptr<const RankPlan>& p, const CpBackwardArgs& a,
                  CpStats& stats) {
    rows_for(p);  // (another forward, of another batch, may have run since this context's)
    const int64_t g = inner * p->local_tokens;
    const int hq = split.hq_loc(), hk = split.kv_loc();
    scatter_heads(a.dout, q_heads(), dout_g, stats);
    dq_g.resize(static_cast<std::size_t>(g) * row_bytes(hq, dqk));
    dk_g.resize(static_cast<std::size_t>(g) * row_bytes(hk, dqk));
    dv_g.resize(static_cast<std::size_t>(g) * row_bytes(hk, dv));
    const CpStats before = outer_attn->stats();
    try {
      outer_attn->backward(ctx.outer, {.q = contiguous(ctx.q.data(), g, hq, dqk, dtype),
                                       .out = contiguous(ctx.out.data(), g, hq, dv, dtype),
                                       .dout = contiguous(dout_g.data(), g, hq, dv, dtype),
                                       .dq = contiguous(dq_g.data(), g, hq, dqk, dtype),
                                       .dk = contiguous(dk_g.data(), g, hk, dqk, dtype),
                                       .dv = contiguous(dv_g.data(), g, hk, dv, dtype)});
    } catch (...) {
      outer_comm->keep_if_poisoned(ctx.q, ctx.out, dout_g, dq_g, dk_g, dv_g);
      throw;
    }
    const double hidden = add_outer(before, stats);
    gather_heads(dq_g.data(), row_bytes(hq, dqk), stats);
    unpack_heads(recv, q_heads(), inner, a.dq);
    return_kv_grad(dk_g, a.dk, stats);
    return_kv_grad(dv_g, a.dv, stats);
    return hidden;
  }
};

A2aLevel::A2aLevel(Communicator& comm, const CpAttnConfig& cfg, int inner)
    : m_(std::make_unique<Impl>(comm, cfg, inner)) {}
A2aLevel::~A2aLevel() = default;

void A2aLevel::connect(const std::function<void(CpAttention&)>& made) { m_->connect(made); }
const RankPlan& A2aLevel::prepare(const std::shared_ptr<const RankPlan>& plan) { return m_->prepare(plan); }
bool A2aLevel::poisoned() const { return m_->poisoned(); }
double A2aLevel::forward(const CpForwardArgs& a, const std::shared_ptr<const RankPlan>& plan, uint64_t seed,
                         std::vector<float>& lse, A2aContext& ctx, CpStats& stats) {
  return m_->forward(a, plan, seed, lse, ctx, stats);
}
double A2aLevel::backward(A2aContext& ctx, const std::shared_ptr<const RankPlan>& plan, const CpBackwardArgs& a,
                          CpStats& stats) {
  return m_->backward(ctx, plan, a, stats);
}

std::size_t A2aLevel::buffer_bytes() const {
  std::size_t b = m_->outer_attn ? m_->outer_attn->stats().peak_buffer_bytes : 0;
  for (const auto* v : {&m_->send, &m_->recv, &m_->k_g, &m_->v_g, &m_->dout_g, &m_->dq_g, &m_->dk_g, &m_->dv_g})
    b += v->capacity();
  for (const auto* v : {&m_->lse_g, &m_->acc, &m_->tmp}) b += v->capacity() * sizeof(float);
  return b;
}
int64_t A2aLevel::bytes_sent() const {
  return (m_->inner_comm ? m_->inner_comm->bytes_sent() : 0) + (m_->outer_comm ? m_->outer_comm->bytes_sent() : 0);
}
int64_t A2aLevel::bytes_received() const {
  return (m_->inner_comm ? m_->inner_comm->bytes_received() : 0) +
         (m_->outer_comm ? m_->outer_comm->bytes_received() : 0);
}

}  // namespace cpattn::detail
