// The pass-Q scheme (pass_q.hpp, docs/cp.md).
#include "pass_q.hpp"

#include <cpattn/dtype.hpp>
#include <cpattn/merge.hpp>

#include <algorithm>
#include <functional>
#include <limits>

namespace cpattn::cp_detail {

namespace {

constexpr int kTagPartial = 11;  // the partials' start_send/start_recv stream (shifts have their own)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The kernels' inputs of one step: the visiting queries over this rank's K/V, in the storage
// dtype (fp16/bf16 run the path's own products, as one process and the other schemes do; they
// ran as fp32 copies, slower on the bf16 and AMX paths and rounded otherwise than a single
// process, which `cpattn run`'s check of bf16 with dropout failed on an AMX CPU).
AttnInputs step_inputs(const SchemeEnv& env, ConstTensorView q, ConstTensorView k, ConstTensorView v,
                       const WorkList& work, uint64_t seed) {
  AttnOptions o = env.cfg.options;
  o.seed = seed;  // dropout is keyed by document and positions: the owner's plan gives both
  return {.q = q, .k = k, .v = v, .work = &work, .options = o, .progress = env.progress};
}

}  // namespace

// One partial per direction is in flight per buffer: a buffer is reused two steps later, after
// its send or receive completed.
void run_home_ring(SchemeEnv& env, HomeRingBuffers& b, std::span<const WorkList> visiting,
                   std::span<const char> returns, std::size_t n_part, bool own_in_place,
                   const std::function<void(int, const std::byte*, float*)>& compute,
                   const std::function<void(const float*)>& take) {
  Communicator& comm = env.comm;
  const int cp = comm.size(), r = comm.rank();
  const int right = (r + 1) % cp, left = (r + cp - 1) % cp;
  b.visit[1].resize(b.visit[0].size());
  for (int i = 0; i < 2; ++i) {
    b.part[i].resize(n_part);
    b.back[i].resize(n_part);
  }
  const auto timed_take = [&](const float* part) {
    const auto t0 = Clock::now();
    take(part);
    env.stats.compute_s += seconds_since(t0);
  };
  CommRequest sent[2], got[2];
  const auto take_back = [&](int s) {  // the partial of step s, received into back[s % 2]
    env.wait(got[s % 2]);
    if (returns[s]) timed_take(b.back[s % 2].data());
  };
  for (int s = 0; s < cp; ++s) {
    const int cur = s % 2, nxt = 1 - cur;
    auto t0 = Clock::now();
    CommRequest rq;
    if (s + 1 < cp) rq = start_block_shift(comm, env.cfg.dtype, b.visit[cur], right, b.visit[nxt], left);
    if (s >= 1)
      got[cur] = comm.start_recv<float>(std::span(b.back[cur]).first(returns[s] ? n_part : 0), (r + s) % cp,
                                        kTagPartial);
    env.stats.comm_s += seconds_since(t0);
    env.wait(sent[cur]);  // part[cur]'s send of step s - 2
    const bool any = !visiting[s].tasks.empty();
    if (any)  // skipped when no pair of the visiting block is visible here; the transfers move along inside
      env.compute_moving({&rq, &got[cur], &sent[nxt], &got[nxt]}, [&] {
        compute(s, b.visit[cur].data(), s == 0 && own_in_place ? nullptr : b.part[cur].data());
      });
    if (s == 0) {
      if (any && !own_in_place) timed_take(b.part[0].data());
    } else {
      t0 = Clock::now();
      sent[cur] = comm.start_send<float>(std::span<const float>(b.part[cur]).first(any ? n_part : 0),
                                         (r - s + cp) % cp, kTagPartial);
      env.stats.comm_s += seconds_since(t0);
    }
    if (s >= 2) take_back(s - 1);
    env.wait(rq);
  }
  if (cp >= 2) take_back(cp - 1);
  env.wait(sent[0]);
  env.wait(sent[1]);
}

PassQWork pass_q_work(const RankPlan& plan, const AttnOptions& o) {
  const MaskType mask = o.mask;
  const int cp = plan.cp, r = plan.rank;
  const WorkList mine = without_padding(plan, keys_for_mask(plan, mask));
  PassQWork w;
  for (int s = 0; s < cp; ++s) {
    const int src = (r - s + cp) % cp;
    if (src == r) {
      w.visiting.push_back(work_on_block(plan, mine, o, r));
    } else {  // the owner's plan, made here: every rank can plan every rank
      const RankPlan p = get_thd_load_balanced_cp_metadata(plan.cu_seqlens, cp, src);
      w.visiting.push_back(work_on_block(p, without_padding(p, keys_for_mask(p, mask)), o, r));
    }
    w.returns.push_back(!work_on_block(plan, mine, o, (r + s) % cp).tasks.empty());
  }
  return w;
}

std::size_t HomeRingBuffers::bytes() const {
  std::size_t n = visit[0].capacity() + visit[1].capacity();
  for (const std::vector<float>* f : {&part[0], &part[1], &back[0], &back[1]}) n += f->capacity() * sizeof(float);
  return n;
}

std::size_t PassQBuffers::bytes() const {
  std::size_t n = HomeRingBuffers::bytes();
  for (const std::vector<float>* f : {&acc, &dk, &dv}) n += f->capacity() * sizeof(float);
  return n;
}

void pass_q_forward(SchemeEnv& env, PassQBuffers& b, const PassQWork& w, uint64_t seed, ConstTensorView q,
                    ConstTensorView k, ConstTensorView v, TensorView out, std::span<float> lse) {
  const CpAttnConfig& c = env.cfg;
  const int64_t t = q.rows;
  const std::size_t n_lse = static_cast<std::size_t>(t) * c.num_heads_q;
  const std::size_t n_part = n_lse + n_lse * c.head_dim_v;  // [lse | out], fp32
  auto t0 = Clock::now();
  b.visit[0].resize(n_lse * c.head_dim_qk * dtype_size(c.dtype));
  pack_rows(q, b.visit[0].data());
  b.acc.assign(n_part, 0.0f);
  std::fill_n(b.acc.begin(), n_lse, kNegInf);  // nothing merged yet: every part empty
  env.stats.compute_s += seconds_since(t0);
  // A step's part is fp32 [lse | out]: fp32 storage writes it; fp16/bf16 accumulate into the
  // empty part (lse -inf, out 0), the kernels' fp32 running result.
  const OutMode mode = c.dtype == DType::f32 ? OutMode::write : OutMode::accumulate;
  const auto compute = [&](int s, const std::byte* block, float* part) {
    std::fill_n(part, n_lse, kNegInf);  // rows without a task stay empty parts
    std::fill(part + n_lse, part + n_part, 0.0f);
    attention_forward({.in = step_inputs(env, contiguous(block, t, c.num_heads_q, c.head_dim_qk, c.dtype), k, v,
                                         w.visiting[s], seed),
                       .out = contiguous(part + n_lse, t, c.num_heads_q, c.head_dim_v),
                       .lse = part,
                       .out_mode = mode});
  };
  const auto take = [&](const float* part) {
    const float* lse_parts[2] = {b.acc.data(), part};
    const float* out_parts[2] = {b.acc.data() + n_lse, part + n_lse};
    merge_partial_softmax({.num_parts = 2, .rows = t, .num_heads = c.num_heads_q, .head_dim = c.head_dim_v,
                           .lse_parts = lse_parts, .out_parts = out_parts, .lse = b.acc.data(),
                           .out = b.acc.data() + n_lse});
  };
  run_home_ring(env, b, w.visiting, w.returns, n_part, false, compute, take);
  t0 = Clock::now();
  store_f32(b.acc.data() + n_lse, out);  // padding rows: 0 (no task writes them)
  std::copy_n(b.acc.begin(), n_lse, lse.begin());
  env.stats.compute_s += seconds_since(t0);
}

void pass_q_backward(SchemeEnv& env, PassQBuffers& b, const PassQWork& w, uint64_t seed,
                     const CpBackwardArgs& a, ConstTensorView k, ConstTensorView v, std::span<const float> lse) {
  const CpAttnConfig& c = env.cfg;
  const int64_t t = a.q.rows;
  const std::size_t es = dtype_size(c.dtype);
  const std::size_t n_lse = static_cast<std::size_t>(t) * c.num_heads_q;
  const std::size_t q_bytes = n_lse * c.head_dim_qk * es, o_bytes = n_lse * c.head_dim_v * es;
  const std::size_t n_dq = n_lse * c.head_dim_qk;
  auto t0 = Clock::now();
  // The visiting block: [lse (fp32) | q | out | dout], lse first so that it stays aligned.
  b.visit[0].resize(n_lse * sizeof(float) + q_bytes + 2 * o_bytes);
  std::byte* p = b.visit[0].data();
  std::copy_n(reinterpret_cast<const std::byte*>(lse.data()), n_lse * sizeof(float), p);
  pack_rows(a.q, p + n_lse * sizeof(float));
  pack_rows(a.out, p + n_lse * sizeof(float) + q_bytes);
  pack_rows(a.dout, p + n_lse * sizeof(float) + q_bytes + o_bytes);
  b.dk.assign(static_cast<std::size_t>(k.rows) * k.heads * k.dim, 0.0f);
  b.dv.assign(static_cast<std::size_t>(v.rows) * v.heads * v.dim, 0.0f);
  b.acc.assign(n_dq, 0.0f);
  env.stats.compute_s += seconds_since(t0);
  // A step's dq is fp32: fp32 storage writes it; fp16/bf16 add into the zeroed part (its
  // storage dtype would round it before the steps' sum).
  const GradMode mode = c.dtype == DType::f32 ? GradMode::accumulate : GradMode::accumulate_all;
  const auto compute = [&](int s, const std::byte* block, float* dq) {
    const std::byte* at = block + n_lse * sizeof(float);
    std::fill_n(dq, n_dq, 0.0f);
    // dK/dV of this rank's keys add up over the steps in order 0..cp-1: deterministic.
    attention_backward({.in = step_inputs(env, contiguous(at, t, c.num_heads_q, c.head_dim_qk, c.dtype), k, v,
                                          w.visiting[s], seed),
                        .out = contiguous(at + q_bytes, t, c.num_heads_q, c.head_dim_v, c.dtype),
                        .lse = reinterpret_cast<const float*>(block),
                        .dout = contiguous(at + q_bytes + o_bytes, t, c.num_heads_q, c.head_dim_v, c.dtype),
                        .dq = contiguous(dq, t, c.num_heads_q, c.head_dim_qk),
                        .dk = contiguous(b.dk.data(), t, c.num_heads_k, c.head_dim_qk),
                        .dv = contiguous(b.dv.data(), t, c.num_heads_k, c.head_dim_v),
                        .grad_mode = mode});
  };
  const auto take = [&](const float* dq) {
    for (std::size_t i = 0; i < n_dq; ++i) b.acc[i] += dq[i];
  };
  run_home_ring(env, b, w.visiting, w.returns, n_dq, false, compute, take);
  t0 = Clock::now();
  store_f32(b.acc.data(), a.dq);  // padding rows: 0 (no task has a padding query)
  from_float(b.dk.data(), b.dk.size(), c.dtype, a.dk.data);
  from_float(b.dv.data(), b.dv.size(), c.dtype, a.dv.data);
  env.stats.compute_s += seconds_since(t0);
}

}  // namespace cpattn::cp_detail
