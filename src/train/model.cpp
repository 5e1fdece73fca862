// The model's forward and backward (model.hpp), block by block over the layers of layers.hpp.
#include "model.hpp"

#include "layers.hpp"

#include <cpattn/error.hpp>

#include <algorithm>
#include <cmath>

namespace cpattn::train {

namespace {

// Deterministic normals (splitmix64 + Box-Muller), the same on every platform and rank.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  double normal() {
    const double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

// `slopes`: the ALiBi slopes when mc.alibi (CpAttention copies them).
CpAttnConfig attention_config(const Dims& d, const ModelConfig& mc, const RunOptions& ro,
                              std::span<const float> slopes) {
  CPATTN_CHECK(ro.attn_dtype == DType::f32 || ro.attn_dtype == DType::bf16,
               "RunOptions::attn_dtype must be fp32 or bf16, got ", to_string(ro.attn_dtype));
  CPATTN_CHECK(ro.threads >= 1, "RunOptions::threads must be >= 1, got ", ro.threads);
  return {.num_heads_q = d.H, .num_heads_k = d.KV, .head_dim_qk = d.hd, .head_dim_v = d.hd,
          .dtype = ro.attn_dtype,
          .options = {.mask = MaskType::causal, .num_threads = ro.threads, .window_size_left = mc.window_left,
                      .window_size_right = mc.window_right, .softcap = mc.softcap,
                      .alibi_slopes = mc.alibi ? slopes.data() : nullptr},
          .scheme = ro.cp_scheme,
          .cp_inner = ro.cp_inner,
          .split = ro.split};
}

// Rank `plan.rank`'s arrays of the batch in the split's order, from the plan (no second plan):
// padding tokens get kEndOfDocument, label kIgnoreIndex, loss mask 0 and positions continuing
// their document's.
TokenBatch local_batch(const PackedSequence& seq, const RankPlan& plan) {
  TokenBatch global{seq.tokens, seq.labels, seq.positions, std::vector<float>(seq.labels.size())};
  for (std::size_t i = 0; i < seq.labels.size(); ++i) global.loss_mask[i] = seq.labels[i] == kIgnoreIndex ? 0.0f : 1.0f;
  return get_batch_on_this_cp_rank(global, plan, kEndOfDocument);
}

}  // namespace

Dims model_dims(const ModelConfig& mc) {
  Dims d;
  d.D = mc.dim;
  d.H = mc.heads;
  d.KV = mc.kv_heads;
  d.L = mc.layers;
  d.V = mc.vocab;
  d.eps = mc.norm_eps;
  CPATTN_CHECK(d.L >= 1, "ModelConfig::layers must be >= 1, got ", d.L);
  CPATTN_CHECK(d.H >= 1 && d.KV >= 1 && d.H % d.KV == 0, "ModelConfig::heads (", d.H,
               ") must be a positive multiple of ModelConfig::kv_heads (", d.KV, ")");
  CPATTN_CHECK(d.D >= 2 && d.D % d.H == 0, "ModelConfig::dim (", d.D, ") must be a multiple of ModelConfig::heads (",
               d.H, ")");
  d.hd = d.D / d.H;
  CPATTN_CHECK(d.hd % 2 == 0 && d.hd <= 256,
               "the head dimension ModelConfig::dim / ModelConfig::heads must be even and <= 256, got ", d.hd);
  CPATTN_CHECK(d.V == kVocab, "ModelConfig::vocab must be ", kVocab, ", got ", d.V);
  CPATTN_CHECK(mc.window_left >= -1 && mc.window_right >= -1,
               "ModelConfig::window_left and window_right must be >= -1 (-1: unbounded), got ", mc.window_left, " and ",
               mc.window_right);
  CPATTN_CHECK(mc.softcap >= 0.0f && std::isfinite(mc.softcap), "ModelConfig::softcap must be finite and >= 0 (0: off), got ",
               mc.softcap);
  d.F = mc.ffn_dim();
  CPATTN_CHECK(d.F >= 1, "ModelConfig::ffn must be >= 1 (0: the default width), got ", d.F);
  CPATTN_CHECK(mc.experts >= 0, "ModelConfig::experts must be >= 0 (0: the dense MLP), got ", mc.experts);
  if (mc.moe()) (void)moe_config(mc);
  CPATTN_CHECK(mc.dropout >= 0.0f && mc.dropout < 1.0f, "ModelConfig::dropout must be in [0, 1) (0: off), got ",
               mc.dropout);
  CPATTN_CHECK(mc.dropout == 0.0f || !mc.moe(), "ModelConfig::dropout is the dense MLP's: a model with experts (",
               mc.experts, ") takes dropout 0");
  return d;
}

MoeConfig moe_config(const ModelConfig& mc) {
  CPATTN_CHECK(mc.experts >= 1, "ModelConfig::experts must be >= 1 for the MoE layer, got ", mc.experts);
  const MoeConfig c{.hidden = mc.dim, .ffn = mc.ffn_dim(), .num_experts = mc.experts, .top_k = mc.top_k,
                    .router = mc.router, .capacity_factor = mc.capacity_factor, .drop_policy = mc.drop_policy,
                    .aux_loss_coeff = mc.aux_loss_coeff, .bias_update_rate = mc.bias_update_rate};
  try {  // moe.hpp's rules, named by the fields ModelConfig shares with MoeConfig (experts: num_experts)
    moe_validate(c);
  } catch (const Error& e) {
    throw Error("ModelConfig: " + e.message());
  }
  return c;
}

ParamLayout param_layout(const Dims& d, const ModelConfig& mc, int first_expert, int local_experts, int64_t align) {
  CPATTN_CHECK(align >= 1, "param_layout: align must be >= 1, got ", align);
  ParamLayout p;
  if (mc.moe() && local_experts == 0) local_experts = mc.experts;
  CPATTN_CHECK(!mc.moe() || (first_expert >= 0 && local_experts >= 1 && first_expert + local_experts <= mc.experts),
               "param_layout: experts [", first_expert, ", ", first_expert + local_experts, ") are not within the ",
               mc.experts, " of the model");
  p.first_expert = first_expert;
  p.local_experts = mc.moe() ? local_experts : 0;
  const auto add = [&p](const std::string& name, std::vector<int64_t> shape, bool decay) {
    int64_t size = 1;
    for (const int64_t s : shape) size *= s;
    p.tensors.push_back({name, p.count, size, std::move(shape), decay});
    p.count += size;
    return p.tensors.back().offset;
  };
  const int D = d.D, q = d.H * d.hd, kv = d.KV * d.hd, F = d.F;
  p.wte = add("wte", {d.V, D}, true);
  for (int l = 0; l < d.L; ++l) {
    const std::string n = "layer" + std::to_string(l) + ".";
    ParamLayout::Block b{};
    b.ln1 = add(n + "ln1", {D}, false);
    b.wq = add(n + "wq", {D, q}, true);
    b.wk = add(n + "wk", {D, kv}, true);
    b.wv = add(n + "wv", {D, kv}, true);
    b.wo = add(n + "wo", {q, D}, true);
    b.ln2 = add(n + "ln2", {D}, false);
    if (mc.moe()) {
      const int E = mc.experts;
      b.router = add(n + "moe.router", {D, E}, true);
      if (mc.router == MoeRouter::sigmoid_bias) b.bias = add(n + "moe.bias", {E}, false);
    } else {
      b.w1 = add(n + "w1", {D, F}, true);
      b.w3 = add(n + "w3", {D, F}, true);
      b.w2 = add(n + "w2", {F, D}, true);
    }
    p.blocks.push_back(b);
  }
  p.lnf = add("lnf", {D}, false);
  p.lm_head = add("lm_head", {D, d.V}, true);
  p.replicated = p.count;
  if (!mc.moe()) {
    p.experts_begin = p.count;
    return p;
  }
  const auto round_up = [align](int64_t n) { return (n + align - 1) / align * align; };
  p.count = p.experts_begin = round_up(p.count);
  for (int l = 0; l < d.L; ++l) {  // the experts after everything replicated: one region that EP shards
    const std::string n = "layer" + std::to_string(l) + ".moe.";
    const int64_t X = p.local_experts;
    ParamLayout::Block& b = p.blocks[static_cast<std::size_t>(l)];
    b.w1 = add(n + "w1", {X, D, F}, true);
    b.w3 = add(n + "w3", {X, D, F}, true);
    b.w2 = add(n + "w2", {X, F, D}, true);
  }
  p.count = p.experts_begin + round_up(p.count - p.experts_begin);
  return p;
}

namespace {
// Calls f(global tensor, local tensor) for each expert tensor of the two layouts (the same
// model, all experts in `global`).
template <class F>
void for_expert_tensors(const ParamLayout& global, const ParamLayout& local, F&& f) {
  CPATTN_DASSERT(global.tensors.size() == local.tensors.size());
  for (std::size_t i = 0; i < global.tensors.size(); ++i)
    if (global.tensors[i].offset >= global.experts_begin) f(global.tensors[i], local.tensors[i]);
}
}  // namespace

void take_local_experts(const ParamLayout& global, const ParamLayout& local, std::span<const float> all,
                        std::span<float> mine) {
  std::copy_n(all.begin(), local.replicated, mine.begin());
  for_expert_tensors(global, local, [&](const ParamTensor& g, const ParamTensor& l) {
    const int64_t each = l.size / local.local_experts;
    std::copy_n(all.begin() + g.offset + local.first_expert * each, l.size, mine.begin() + l.offset);
  });
}

void put_gathered_experts(const ParamLayout& global, const ParamLayout& local, std::span<const float> mine,
                          std::span<const float> gathered, std::span<float> all) {
  std::copy_n(mine.begin(), local.replicated, all.begin());
  const int64_t region = local.count - local.experts_begin;
  const int64_t ranks = static_cast<int64_t>(gathered.size()) / std::max<int64_t>(region, 1);
  for_expert_tensors(global, local, [&](const ParamTensor& g, const ParamTensor& l) {
    for (int64_t r = 0; r < ranks; ++r)
      std::copy_n(gathered.begin() + r * region + (l.offset - local.experts_begin), l.size,
                  all.begin() + g.offset + r * l.size);
  });
}

void init_params(const ParamLayout& layout, const ModelConfig& mc, uint64_t seed, std::span<float> params) {
  Rng rng{seed};
  const double out_std = mc.init_std / std::sqrt(2.0 * mc.layers);  // residual projections (GPT-2)
  for (const ParamTensor& t : layout.tensors) {
    const bool norm = t.shape.size() == 1;
    const bool resid_out = t.name.ends_with(".wo") || t.name.ends_with(".w2");
    const double sd = resid_out ? out_std : mc.init_std;
    const float vec = t.name.ends_with(".bias") ? 0.0f : 1.0f;  // the router's selection bias starts at 0
    for (int64_t i = 0; i < t.size; ++i)
      params[t.offset + i] = norm ? vec : static_cast<float>(sd * rng.normal());
  }
}

namespace {
// This rank's experts under EP: [first, first + count) of `experts`, one block per EP rank;
// aligned to the all-reduce's chunks.
ParamLayout local_layout(const Dims& d, const ModelConfig& mc, const Communicator& ep, int chunks) {
  if (!mc.moe()) return param_layout(d, mc);
  CPATTN_CHECK(mc.experts % ep.size() == 0, "MeshConfig: ep = ", ep.size(), " must divide ModelConfig::experts = ",
               mc.experts);
  const int local = mc.experts / ep.size();
  return param_layout(d, mc, ep.rank() * local, local, chunks);
}
}  // namespace

Model::Model(Communicator& comm, const ModelConfig& mc, const RunOptions& ro, uint64_t seed, int reduce_ranks,
             Communicator* ep)
    : config(mc), run(ro), dims(model_dims(mc)),
      layout(local_layout(dims, mc, ep ? *ep : comm, reduce_ranks > 0 ? reduce_ranks : comm.size())),
      cp(comm.size()), cp_comm(&comm),
      attn(comm, attention_config(dims, mc, ro, mc.alibi ? alibi_slopes(dims.H) : std::vector<float>{})),
      ep_comm(ep ? ep : &comm) {
  const int64_t chunks = reduce_ranks > 0 ? reduce_ranks : cp;
  params.assign(layout.count, 0.0f);
  grads.assign((layout.count + chunks - 1) / chunks * chunks, 0.0f);
  if (config.moe()) {  // every expert drawn, the same on every rank whatever ep; this rank's kept
    const ParamLayout all = param_layout(dims, config);
    std::vector<float> full(static_cast<std::size_t>(all.count));
    init_params(all, config, seed, full);
    take_local_experts(all, layout, full, params);
  } else {
    init_params(layout, config, seed, params);
  }
  set_blas_threads(run.threads);
  acts.resid.resize(dims.L + 1);
  acts.blocks.resize(dims.L);
}

// ---- Batch setup --------------------------------------------------------------------------------

std::vector<int64_t> rope_positions(const RankPlan& plan, std::span<const int64_t> position_ids, bool local_offsets) {
  std::vector<int64_t> pos(position_ids.begin(), position_ids.end());
  if (local_offsets)
    for (const AttnTask& t : plan.work.tasks)  // rows of a document are consecutive on a rank
      for (int64_t i = 0; i < t.q_len; ++i) pos[t.q_row + i] = t.q_row + i - plan.docs[t.doc].local_begin;
  return pos;
}

uint64_t dropout_stream(uint64_t seed, int64_t step, int64_t micro) {
  Rng a{seed ^ 0x64726f706f7574ull};  // "dropout": apart from the initialization's stream
  Rng b{a.next() ^ static_cast<uint64_t>(step)};
  Rng c{b.next() ^ static_cast<uint64_t>(micro)};
  return c.next();
}

void prepare_batch(Model& m, const PackedSequence& seq, std::optional<uint64_t> dropout_seed) {
  const Dims& d = m.dims;
  const auto n = static_cast<int64_t>(seq.tokens.size());
  CPATTN_CHECK(n >= 1 && seq.labels.size() == seq.tokens.size() && seq.positions.size() == seq.tokens.size(),
               "PackedSequence: tokens, labels and positions must have the same non-zero length, got ",
               seq.tokens.size(), ", ", seq.labels.size(), " and ", seq.positions.size());
  CPATTN_CHECK(seq.cu_seqlens.size() >= 2 && seq.cu_seqlens.back() == n,
               "PackedSequence::cu_seqlens must end at the token count ", n);
  CPATTN_CHECK(n >= min_seq_len(m.cp), "PackedSequence: ", n, " tokens cannot give each of the ", m.cp,
               " ranks a chunk: a sequence needs at least min_seq_len(cp) = chunks_per_document(cp) = ", min_seq_len(m.cp),
               " tokens");
  Batch& b = m.batch;
  b.plan = m.attn.plan(seq.cu_seqlens);
  const RankPlan& plan = *b.plan;
  b.local = local_batch(seq, plan);
  b.T = plan.local_tokens;
  const int64_t T = b.T;
  for (std::size_t i = 0; i < b.local.tokens.size(); ++i) {
    CPATTN_CHECK(b.local.tokens[i] >= 0 && b.local.tokens[i] < d.V, "PackedSequence::tokens: token id ",
                 b.local.tokens[i], " outside the vocabulary [0, ", d.V, ")");
    CPATTN_CHECK(b.local.labels[i] == kIgnoreIndex || (b.local.labels[i] >= 0 && b.local.labels[i] < d.V),
                 "PackedSequence::labels: label ", b.local.labels[i], " outside the vocabulary [0, ", d.V, ")");
  }

  rope_tables(b.rope_cos, b.rope_sin, rope_positions(plan, b.local.position_ids, m.run.rope_local_offsets), d.hd,
              m.config.rope_theta);
  b.real_rows.clear();
  b.real_positions.clear();
  for (int64_t i = 0; i < T; ++i)
    if (const int64_t g = plan.real_token_index[static_cast<std::size_t>(i)]; g >= 0) {
      b.real_rows.push_back(i);
      b.real_positions.push_back(g);
    }
  b.dropout_seed = m.config.dropout > 0.0f ? dropout_seed : std::nullopt;
  b.row_doc.assign(static_cast<std::size_t>(T), -1);
  for (const int64_t i : b.real_rows) {  // the document of the row's global token
    const int64_t g = plan.real_token_index[static_cast<std::size_t>(i)];
    b.row_doc[static_cast<std::size_t>(i)] =
        std::upper_bound(plan.cu_seqlens.begin(), plan.cu_seqlens.end(), g) - plan.cu_seqlens.begin() - 1;
  }
  const int64_t mlp_rows = m.config.moe() ? 0 : T;  // the dense MLP's [T, F] tensors

  Activations& a = m.acts;
  for (auto& r : a.resid) r.resize(T * d.D);
  for (BlockActs& k : a.blocks) {
    k.xn1.resize(T * d.D);
    k.rstd1.resize(T);
    k.q.resize(T * d.H * d.hd);
    k.k.resize(T * d.KV * d.hd);
    k.v.resize(T * d.KV * d.hd);
    k.att.resize(T * d.H * d.hd);
    k.x_mid.resize(T * d.D);
    k.xn2.resize(T * d.D);
    k.rstd2.resize(T);
    k.a.resize(mlp_rows * d.F);
    k.b.resize(mlp_rows * d.F);
    k.h.resize(mlp_rows * d.F);
  }
  a.xf.resize(T * d.D);
  a.rstdf.resize(T);
  a.logits.resize(T * d.V);
}

// ---- Forward ------------------------------------------------------------------------------------

namespace {

// att = Attn(q, k, v) through the CP attention, in the run's attention dtype; the context and
// (bf16) the bf16 q and out stay in `a` for the backward.
void attention_forward(Model& m, BlockActs& a) {
  const Dims& d = m.dims;
  const int64_t T = m.batch.T;
  const DType t = m.run.attn_dtype;
  if (t == DType::f32) {
    a.attn = m.attn.forward({.plan = m.batch.plan,
                             .q = contiguous(a.q.data(), T, d.H, d.hd),
                             .k = contiguous(a.k.data(), T, d.KV, d.hd),
                             .v = contiguous(a.v.data(), T, d.KV, d.hd),
                             .out = contiguous(a.att.data(), T, d.H, d.hd)});
    return;
  }
  Scratch& s = m.scratch;
  a.q16.resize(a.q.size());
  a.o16.resize(a.att.size());
  s.k16.resize(a.k.size());
  s.v16.resize(a.v.size());
  from_float(a.q.data(), a.q.size(), t, a.q16.data());
  from_float(a.k.data(), a.k.size(), t, s.k16.data());
  from_float(a.v.data(), a.v.size(), t, s.v16.data());
  a.attn = m.attn.forward({.plan = m.batch.plan,
                           .q = contiguous(a.q16.data(), T, d.H, d.hd, t),
                           .k = contiguous(s.k16.data(), T, d.KV, d.hd, t),
                           .v = contiguous(s.v16.data(), T, d.KV, d.hd, t),
                           .out = contiguous(a.o16.data(), T, d.H, d.hd, t)});
  to_float(a.o16.data(), t, a.o16.size(), a.att.data());
}

// o.dq, o.dk, o.dv from scratch.datt through the CP attention backward; consumes the context.
void attention_backward(Model& m, BlockActs& a, BlockOutGrads& o) {
  const Dims& d = m.dims;
  const int64_t T = m.batch.T;
  const DType t = m.run.attn_dtype;
  Scratch& s = m.scratch;
  if (t == DType::f32) {
    m.attn.backward(a.attn, {.q = contiguous(a.q.data(), T, d.H, d.hd),
                             .out = contiguous(a.att.data(), T, d.H, d.hd),
                             .dout = contiguous(s.datt.data(), T, d.H, d.hd),
                             .dq = contiguous(o.dq.data(), T, d.H, d.hd),
                             .dk = contiguous(o.dk.data(), T, d.KV, d.hd),
                             .dv = contiguous(o.dv.data(), T, d.KV, d.hd)});
    return;
  }
  // dout -> bf16; dq/dk/dv come back in bf16.
  s.dout16.resize(s.datt.size());
  s.dq16.resize(o.dq.size());
  s.dk16.resize(o.dk.size());
  s.dv16.resize(o.dv.size());
  from_float(s.datt.data(), s.datt.size(), t, s.dout16.data());
  m.attn.backward(a.attn, {.q = contiguous(a.q16.data(), T, d.H, d.hd, t),
                           .out = contiguous(a.o16.data(), T, d.H, d.hd, t),
                           .dout = contiguous(s.dout16.data(), T, d.H, d.hd, t),
                           .dq = contiguous(s.dq16.data(), T, d.H, d.hd, t),
                           .dk = contiguous(s.dk16.data(), T, d.KV, d.hd, t),
                           .dv = contiguous(s.dv16.data(), T, d.KV, d.hd, t)});
  to_float(s.dq16.data(), t, o.dq.size(), o.dq.data());
  to_float(s.dk16.data(), t, o.dk.size(), o.dk.data());
  to_float(s.dv16.data(), t, o.dv.size(), o.dv.data());
}

// mlp_rows: T for the dense MLP, 0 with experts (whose gradients need none of dy, da, db).
void size_out_grads(BlockOutGrads& o, const Dims& d, int64_t mlp_rows, int64_t T) {
  o.dy.resize(mlp_rows * d.D);
  o.da.resize(mlp_rows * d.F);
  o.db.resize(mlp_rows * d.F);
  o.dx_mid.resize(T * d.D);
  o.dq.resize(T * d.H * d.hd);
  o.dk.resize(T * d.KV * d.hd);
  o.dv.resize(T * d.KV * d.hd);
}

// dW += input^T . gradient for every matrix of block l.
void add_weight_grads(Model& m, int l, const BlockOutGrads& o) {
  const Dims& d = m.dims;
  const int64_t T = m.batch.T;
  const int D = d.D, Q = d.H * d.hd, KV = d.KV * d.hd, F = d.F;
  const BlockTensors<float> g = m.layout.block<float>(m.grads.data(), l);
  const BlockActs& a = m.acts.blocks[l];
  if (!m.config.moe()) {  // the experts' gradients come from block_backward itself
    matmul(a.h.data(), o.dy.data(), g.w2, F, D, T, true, false, 1.0f);    // dw2 += h^T dy
    matmul(a.xn2.data(), o.da.data(), g.w1, D, F, T, true, false, 1.0f);  // dw1 += xn2^T da
    matmul(a.xn2.data(), o.db.data(), g.w3, D, F, T, true, false, 1.0f);  // dw3 += xn2^T db
  }
  matmul(a.att.data(), o.dx_mid.data(), g.wo, Q, D, T, true, false, 1.0f);  // dwo += att^T dx_mid
  matmul(a.xn1.data(), o.dq.data(), g.wq, D, Q, T, true, false, 1.0f);
  matmul(a.xn1.data(), o.dk.data(), g.wk, D, KV, T, true, false, 1.0f);
  matmul(a.xn1.data(), o.dv.data(), g.wv, D, KV, T, true, false, 1.0f);
}

// y = x_mid + MoE(xn2) on the real rows (padding rows get x_mid alone: they are not routed).
void moe_block_forward(Model& m, int l, BlockActs& a, float* y) {
  CPATTN_CHECK(m.moe != nullptr, "block_forward: a model with experts needs moe_begin_step before its forwards");
  const int64_t D = m.dims.D;
  const std::vector<int64_t>& rows = m.batch.real_rows;
  const auto R = static_cast<int64_t>(rows.size());
  a.moe_x.resize(static_cast<std::size_t>(R * D));
  for (int64_t i = 0; i < R; ++i)
    std::copy_n(a.xn2.begin() + rows[i] * D, D, a.moe_x.begin() + i * D);
  a.moe = m.moe->forward(m.moe_weights[l], a.moe_x, m.batch.real_positions);
  m.moe_aux += a.moe.aux_loss;
  m.moe_dropped += a.moe.routing.dropped;
  std::vector<int64_t>& load = m.moe_load[l];
  for (std::size_t e = 0; e < load.size(); ++e) load[e] += a.moe.routing.routed[e];
  std::copy(a.x_mid.begin(), a.x_mid.end(), y);
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < D; ++j) y[rows[i] * D + j] += a.moe.y[i * D + j];
}

// scratch.dxn = d(xn2) from dres = dy through the MoE layer; the router's and this rank's
// experts' gradients += into m.grads. Frees the forward's state.
void moe_block_backward(Model& m, int l, BlockActs& a) {
  const int64_t D = m.dims.D;
  Scratch& s = m.scratch;
  const std::vector<int64_t>& rows = m.batch.real_rows;
  const auto R = static_cast<int64_t>(rows.size());
  std::vector<float> dy(static_cast<std::size_t>(R * D));
  for (int64_t i = 0; i < R; ++i) std::copy_n(s.dres.begin() + rows[i] * D, D, dy.begin() + i * D);
  const MoeWeights& w = m.moe_weights[l];
  const MoeEpBackward b = m.moe->backward(w, a.moe_x, a.moe, dy);
  const BlockTensors<float> g = m.layout.block<float>(m.grads.data(), l);
  const auto add = [](float* into, const std::vector<float>& v) {
    for (std::size_t i = 0; i < v.size(); ++i) into[i] += v[i];
  };
  add(g.router, b.grads.router);
  add(g.w1, b.grads.w_gate);  // this rank's experts only: the layout holds no other
  add(g.w3, b.grads.w_up);
  add(g.w2, b.grads.w_down);
  std::fill(s.dxn.begin(), s.dxn.end(), 0.0f);
  for (int64_t i = 0; i < R; ++i) std::copy_n(b.grads.dx.begin() + i * D, D, s.dxn.begin() + rows[i] * D);
  a.moe = {};
  a.moe_x = {};
}

// Hidden dropout of block l's `site` (0: attention output, 1: MLP output) on x [T, D], when
// this batch drops.
void hidden_dropout(const Model& m, int l, int site, float* x) {
  const Batch& b = m.batch;
  dropout_rows(x, b.row_doc, b.local.position_ids, m.dims.D, m.config.dropout, *b.dropout_seed, 2 * l + site);
}

}  // namespace

void moe_begin_step(Model& m, int64_t step_groups) {
  if (!m.config.moe()) return;
  CPATTN_CHECK(step_groups >= 1, "moe_begin_step: a step has at least one routing group, got ", step_groups);
  MoeConfig c = moe_config(m.config);
  const int ep = m.ep_comm->size();
  c.aux_loss_coeff *= static_cast<double>(ep) / static_cast<double>(step_groups);
  m.moe = std::make_unique<MoeEpLayer>(*m.ep_comm, c, m.cp_comm);
  const int first = m.moe->first_expert(), local = m.moe->local_experts();
  const Dims& d = m.dims;
  const int64_t D = d.D, E = m.config.experts, each = static_cast<int64_t>(d.D) * d.F;
  m.moe_weights.resize(static_cast<std::size_t>(d.L));
  for (int l = 0; l < d.L; ++l) {
    const BlockTensors<const float> p = m.layout.block<const float>(m.params.data(), l);
    MoeWeights& w = m.moe_weights[static_cast<std::size_t>(l)];
    w.router.assign(p.router, p.router + D * E);
    if (p.bias)
      w.bias.assign(p.bias, p.bias + E);
    else
      w.bias.assign(static_cast<std::size_t>(E), 0.0f);
    w.first_expert = first;
    w.local_experts = local;
    CPATTN_CHECK(first == m.layout.first_expert && local == m.layout.local_experts, "moe_begin_step: the layer's "
                 "experts [", first, ", ", first + local, ") are not the ones the parameters hold");
    w.w_gate.assign(p.w1, p.w1 + local * each);
    w.w_up.assign(p.w3, p.w3 + local * each);
    w.w_down.assign(p.w2, p.w2 + local * each);
  }
  m.moe_aux = 0;
  m.moe_dropped = 0;
  m.moe_load.assign(static_cast<std::size_t>(d.L), std::vector<int64_t>(static_cast<std::size_t>(E), 0));
}

void block_forward(Model& m, int l, const float* x, float* y) {
  const Dims& d = m.dims;
  const int64_t T = m.batch.T;
  const int D = d.D, Q = d.H * d.hd, KV = d.KV * d.hd, F = d.F;
  const BlockTensors<const float> p = m.layout.block<const float>(m.params.data(), l);
  BlockActs& a = m.acts.blocks[l];
  const float* cos_t = m.batch.rope_cos.data();
  const float* sin_t = m.batch.rope_sin.data();
  // Attention block.
  rmsnorm_forward(a.xn1.data(), a.rstd1.data(), x, p.ln1, T, D, d.eps);
  matmul(a.xn1.data(), p.wq, a.q.data(), T, Q, D, false, false, 0.0f);   // q [T, H*hd]
  matmul(a.xn1.data(), p.wk, a.k.data(), T, KV, D, false, false, 0.0f);  // k [T, KV*hd]
  matmul(a.xn1.data(), p.wv, a.v.data(), T, KV, D, false, false, 0.0f);  // v [T, KV*hd]
  rope(a.q.data(), cos_t, sin_t, T, d.H, d.hd, false);
  rope(a.k.data(), cos_t, sin_t, T, d.KV, d.hd, false);
  attention_forward(m, a);  // att [T, H*hd]
  const bool drop = m.batch.dropout_seed.has_value();
  if (drop) {  // x_mid = x + dropout(att @ wo)
    matmul(a.att.data(), p.wo, a.x_mid.data(), T, D, Q, false, false, 0.0f);
    hidden_dropout(m, l, 0, a.x_mid.data());
    for (int64_t i = 0; i < T * D; ++i) a.x_mid[i] += x[i];
  } else {
    std::copy(x, x + T * D, a.x_mid.begin());
    matmul(a.att.data(), p.wo, a.x_mid.data(), T, D, Q, false, false, 1.0f);  // x_mid += att @ wo
  }
  // MLP block (or its mixture of experts).
  rmsnorm_forward(a.xn2.data(), a.rstd2.data(), a.x_mid.data(), p.ln2, T, D, d.eps);
  if (m.config.moe()) {
    moe_block_forward(m, l, a, y);
    return;
  }
  matmul(a.xn2.data(), p.w1, a.a.data(), T, F, D, false, false, 0.0f);  // gate [T, F]
  matmul(a.xn2.data(), p.w3, a.b.data(), T, F, D, false, false, 0.0f);  // up [T, F]
  swiglu_forward(a.h.data(), a.a.data(), a.b.data(), T * F);           // h [T, F]
  if (drop) {  // y = x_mid + dropout(h @ w2)
    matmul(a.h.data(), p.w2, y, T, D, F, false, false, 0.0f);
    hidden_dropout(m, l, 1, y);
    for (int64_t i = 0; i < T * D; ++i) y[i] += a.x_mid[i];
    return;
  }
  std::copy(a.x_mid.begin(), a.x_mid.end(), y);
  matmul(a.h.data(), p.w2, y, T, D, F, false, false, 1.0f);  // y = x_mid + h @ w2
}

void embed_forward(Model& m) {
  embedding_forward(m.acts.resid[0].data(), m.params.data() + m.layout.wte, m.batch.local.tokens, m.dims.D);
}

double head_forward(Model& m, int64_t& scored) {
  const Dims& d = m.dims;
  const int64_t T = m.batch.T;
  Activations& a = m.acts;
  const float* P = m.params.data();
  rmsnorm_forward(a.xf.data(), a.rstdf.data(), a.resid[d.L].data(), P + m.layout.lnf, T, d.D, d.eps);
  matmul(a.xf.data(), P + m.layout.lm_head, a.logits.data(), T, d.V, d.D, false, false, 0.0f);  // [T, V]
  return cross_entropy_forward(a.logits.data(), m.batch.local.labels, d.V, scored);
}

double model_forward(Model& m, int64_t& scored) {
  embed_forward(m);  // resid[0] [T, D]
  for (int l = 0; l < m.dims.L; ++l) block_forward(m, l, m.acts.resid[l].data(), m.acts.resid[l + 1].data());
  return head_forward(m, scored);
}

// ---- Backward -----------------------------------------------------------------------------------

void block_backward(Model& m, int l, const float* x, bool defer_weights) {
  const Dims& d = m.dims;
  const int64_t T = m.batch.T;
  const int D = d.D, Q = d.H * d.hd, KV = d.KV * d.hd, F = d.F;
  const BlockTensors<const float> p = m.layout.block<const float>(m.params.data(), l);
  const BlockTensors<float> g = m.layout.block<float>(m.grads.data(), l);
  BlockActs& a = m.acts.blocks[l];
  Scratch& s = m.scratch;
  BlockOutGrads& o = defer_weights ? a.deferred : s.out;
  size_out_grads(o, d, m.config.moe() ? 0 : T, T);
  const float* cos_t = m.batch.rope_cos.data();
  const float* sin_t = m.batch.rope_sin.data();
  if (m.config.moe()) {  // y = x_mid + MoE(xn2): its weight gradients now, also when deferring
    moe_block_backward(m, l, a);
  } else {  // MLP block: y = x_mid + dropout(h @ w2), dres is dy.
    std::copy(s.dres.begin(), s.dres.end(), o.dy.begin());
    if (m.batch.dropout_seed) hidden_dropout(m, l, 1, o.dy.data());  // d(h @ w2): the same mask
    matmul(o.dy.data(), p.w2, s.dh.data(), T, F, D, false, true, 0.0f);  // dh = d(h @ w2) w2^T
    swiglu_backward(o.da.data(), o.db.data(), s.dh.data(), a.a.data(), a.b.data(), T * F);
    matmul(o.da.data(), p.w1, s.dxn.data(), T, D, F, false, true, 0.0f);   // dxn2 = da w1^T
    matmul(o.db.data(), p.w3, s.dxn.data(), T, D, F, false, true, 1.0f);   //      + db w3^T
  }
  rmsnorm_backward(s.dres.data(), g.ln2, s.dxn.data(), a.x_mid.data(), a.rstd2.data(), p.ln2, T, D);
  // Attention block: x_mid = x + dropout(att @ wo), dres is d(x_mid); o.dx_mid = d(att @ wo).
  std::copy(s.dres.begin(), s.dres.end(), o.dx_mid.begin());
  if (m.batch.dropout_seed) hidden_dropout(m, l, 0, o.dx_mid.data());
  matmul(o.dx_mid.data(), p.wo, s.datt.data(), T, Q, D, false, true, 0.0f);  // datt = d(att @ wo) wo^T
  attention_backward(m, a, o);                                             // dq, dk, dv
  rope(o.dq.data(), cos_t, sin_t, T, d.H, d.hd, true);
  rope(o.dk.data(), cos_t, sin_t, T, d.KV, d.hd, true);
  matmul(o.dq.data(), p.wq, s.dxn.data(), T, D, Q, false, true, 0.0f);   // dxn1 = dq wq^T
  matmul(o.dk.data(), p.wk, s.dxn.data(), T, D, KV, false, true, 1.0f);  //      + dk wk^T
  matmul(o.dv.data(), p.wv, s.dxn.data(), T, D, KV, false, true, 1.0f);  //      + dv wv^T
  rmsnorm_backward(s.dres.data(), g.ln1, s.dxn.data(), x, a.rstd1.data(), p.ln1, T, D);
  if (!defer_weights) add_weight_grads(m, l, o);
}

void block_weight_backward(Model& m, int l) {
  BlockOutGrads& o = m.acts.blocks[l].deferred;
  add_weight_grads(m, l, o);
  o = {};  // the deferred gradients are spent: free them
}

void size_backward_scratch(Model& m) {
  const Dims& d = m.dims;
  const int64_t T = m.batch.T;
  Scratch& s = m.scratch;
  s.dres.resize(T * d.D);
  s.dxn.resize(T * d.D);
  s.dh.resize((m.config.moe() ? 0 : T) * d.F);
  s.datt.resize(T * d.H * d.hd);
}

void head_backward(Model& m, int64_t total) {
  const Dims& d = m.dims;
  const int64_t T = m.batch.T;
  Activations& a = m.acts;
  Scratch& s = m.scratch;
  const float* P = m.params.data();
  float* G = m.grads.data();
  cross_entropy_backward(a.logits.data(), m.batch.local.labels, d.V, total);  // dlogits [T, V]
  matmul(a.xf.data(), a.logits.data(), G + m.layout.lm_head, d.D, d.V, T, true, false, 1.0f);  // dW = xf^T dlogits
  matmul(a.logits.data(), P + m.layout.lm_head, s.dxn.data(), T, d.D, d.V, false, true, 0.0f);  // dxf = dlogits W^T
  std::fill(s.dres.begin(), s.dres.end(), 0.0f);
  rmsnorm_backward(s.dres.data(), G + m.layout.lnf, s.dxn.data(), a.resid[d.L].data(), a.rstdf.data(),
                   P + m.layout.lnf, T, d.D);
}

void embed_backward(Model& m) {
  // Scatter-add (padding rows add exact zeros).
  embedding_backward(m.grads.data() + m.layout.wte, m.scratch.dres.data(), m.batch.local.tokens, m.dims.D);
}

void model_backward(Model& m, int64_t total) {
  std::fill(m.grads.begin(), m.grads.end(), 0.0f);
  size_backward_scratch(m);
  head_backward(m, total);
  for (int l = m.dims.L - 1; l >= 0; --l) block_backward(m, l, m.acts.resid[l].data());
  embed_backward(m);
}

}  // namespace cpattn::train
