// The model's forward and backward, written out by hand (llm.c style), and AdamW.
//
// Shapes: T = this rank's local tokens (padding included), D = dim, H = heads, KV = kv_heads,
// hd = head_dim, F = ffn_dim, V = vocab. Activations are row-major [T, ...]. A weight W that
// maps `in` features to `out` features is stored [in, out], so Y = X @ W.
//
// Padding rows (the planner's end-of-document padding) run through the token-wise layers like
// any row, but they take no part in attention (CpAttention gives them zero output and zero
// gradient) and have no label, so every gradient they produce is exactly zero: the result is
// that of the unpadded batch.
#include <cpattn/cp.hpp>
#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/train.hpp>

#include <cblas.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

// OpenBLAS's thread control, when the BLAS in use is OpenBLAS (weak: absent elsewhere).
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace cpattn::train {

void rethrow_agreed(Communicator& comm, const std::string& local_error) {
  const int cp = comm.size(), rank = comm.rank();
  int64_t flag = local_error.empty() ? 0 : cp - rank;  // the lowest failing rank wins
  comm.all_reduce<int64_t>(std::span(&flag, 1), ReduceOp::max);
  if (flag == 0) return;
  const int root = static_cast<int>(cp - flag);
  int64_t len = rank == root ? static_cast<int64_t>(local_error.size()) : 0;
  comm.broadcast<int64_t>(std::span(&len, 1), root);
  std::string msg(static_cast<std::size_t>(len), '\0');
  if (rank == root) msg = local_error;
  comm.broadcast<std::byte>(std::as_writable_bytes(std::span(msg)), root);
  throw Error(msg);
}

namespace {

// C[m, n] = beta * C + op(A) @ op(B); A is stored [m, k] ([k, m] when ta), B [k, n] ([n, k]
// when tb), all row-major and contiguous.
void matmul(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k, bool ta,
            bool tb, float beta) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, a,
              static_cast<int>(ta ? m : k), b, static_cast<int>(tb ? k : n), beta, c,
              static_cast<int>(n));
}

// out[t] = x[t] * rstd[t] * g, rstd[t] = 1 / sqrt(mean(x[t]^2) + eps). x, out: [T, D].
void rmsnorm_forward(float* out, float* rstd, const float* x, const float* g, int64_t T, int D,
                     float eps) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * D;
    float ss = 0.0f;
    for (int i = 0; i < D; ++i) ss += xt[i] * xt[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    rstd[t] = r;
    float* ot = out + t * D;
    for (int i = 0; i < D; ++i) ot[i] = xt[i] * r * g[i];
  }
}

// dx += d(out)/dx^T dout, dg += d(out)/dg^T dout.
//   dx_i = r g_i dout_i - x_i r^3 / D * sum_j g_j dout_j x_j
void rmsnorm_backward(float* dx, float* dg, const float* dout, const float* x, const float* rstd,
                      const float* g, int64_t T, int D) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * D;
    const float* dt = dout + t * D;
    float* dxt = dx + t * D;
    const float r = rstd[t];
    float dot = 0.0f;
    for (int i = 0; i < D; ++i) dot += g[i] * dt[i] * xt[i];
    const float c = r * r * r * dot / static_cast<float>(D);
    for (int i = 0; i < D; ++i) {
      dxt[i] += r * g[i] * dt[i] - xt[i] * c;
      dg[i] += dt[i] * xt[i] * r;
    }
  }
}

// Rotary embedding, half-split pairs (i, i + hd/2) rotated by angle pos * theta^(-2i/hd).
// x: [T, heads, hd]; cs: [T, hd/2] cosines then sines ([2, T, hd/2]). inverse: rotate back
// (the backward of a rotation is the opposite rotation).
void rope(float* x, const float* cos_t, const float* sin_t, int64_t T, int heads, int hd,
          bool inverse) {
  const int half = hd / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos_t + t * half;
    const float* s = sin_t + t * half;
    for (int h = 0; h < heads; ++h) {
      float* v = x + (t * heads + h) * hd;
      for (int i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        const float si = inverse ? -s[i] : s[i];
        v[i] = x1 * c[i] - x2 * si;
        v[i + half] = x1 * si + x2 * c[i];
      }
    }
  }
}

float silu(float a) { return a / (1.0f + std::exp(-a)); }

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

struct LayerOffsets {
  int64_t ln1, wq, wk, wv, wo, ln2, w1, w3, w2;
};

// What one layer's forward keeps for its backward. Sizes in floats.
struct LayerActs {
  std::vector<float> xn1, rstd1;  // [T, D], [T]
  std::vector<float> q, k, v;     // [T, H*hd] (after RoPE), [T, KV*hd] (after RoPE), [T, KV*hd]
  std::vector<float> att;         // [T, H*hd]
  std::vector<float> x_mid;       // [T, D] residual after attention
  std::vector<float> xn2, rstd2;  // [T, D], [T]
  std::vector<float> a, b, h;     // [T, F] gate, up, silu(gate) * up
};

}  // namespace

struct Trainer::Impl {
  Communicator& comm;
  int cp = 1, rank = 0;
  ModelConfig mc;
  OptimConfig oc;
  RunOptions ro;
  int D = 0, H = 0, KV = 0, hd = 0, F = 0, V = 0, L = 0;

  std::vector<ParamTensor> tensors;
  std::vector<float> params, grads, m, v;  // grads padded to a multiple of cp
  int64_t n_params = 0;
  int64_t wte = 0, lnf = 0, head = 0;
  std::vector<LayerOffsets> lo;
  std::vector<std::unique_ptr<CpAttention>> attn;  // one per layer: each keeps its forward state
  int64_t step = 0;
  double grad_norm = 0;

  // Per batch.
  RankPlan plan;
  TokenBatch local;
  int64_t T = 0;
  std::vector<float> rope_cos, rope_sin;  // [T, hd/2]
  std::vector<std::vector<float>> resid;  // [L+1][T, D]: input of layer l; resid[L] the last output
  std::vector<LayerActs> acts;
  std::vector<float> xf, rstdf;           // [T, D], [T]
  std::vector<float> logits;              // [T, V]; after forward, probabilities of labeled rows
  std::vector<uint16_t> q16, k16, v16, o16;  // bf16 attention buffers
  // Backward scratch.
  std::vector<float> dres, dxn, dh, da, db, datt, dq, dk, dv;

  Impl(Communicator& c, const ModelConfig& model, const OptimConfig& optim, const RunOptions& options)
      : comm(c), cp(c.size()), rank(c.rank()), mc(model), oc(optim), ro(options) {}

  float* P(int64_t off) { return params.data() + off; }
  float* G(int64_t off) { return grads.data() + off; }

  int64_t add(const std::string& name, std::vector<int64_t> shape, bool decay) {
    int64_t size = 1;
    for (const int64_t s : shape) size *= s;
    tensors.push_back({name, n_params, size, std::move(shape), decay});
    n_params += size;
    return tensors.back().offset;
  }

  void build(uint64_t seed) {
    D = mc.dim;
    H = mc.heads;
    KV = mc.kv_heads;
    L = mc.layers;
    V = mc.vocab;
    CPATTN_CHECK(L >= 1, "--layers must be >= 1, got ", L);
    CPATTN_CHECK(H >= 1 && KV >= 1 && H % KV == 0, "--heads (", H,
                 ") must be a positive multiple of --kv-heads (", KV, ")");
    CPATTN_CHECK(D >= 2 && D % H == 0, "--dim (", D, ") must be a multiple of --heads (", H, ")");
    hd = D / H;
    CPATTN_CHECK(hd % 2 == 0 && hd <= 256, "head dimension --dim / --heads must be even and <= 256, got ",
                 hd);
    CPATTN_CHECK(V == kVocab, "vocab must be ", kVocab, ", got ", V);
    F = mc.ffn_dim();
    CPATTN_CHECK(F >= 1, "ffn width must be >= 1, got ", F);
    CPATTN_CHECK(ro.attn_dtype == DType::f32 || ro.attn_dtype == DType::bf16,
                 "attention dtype must be fp32 or bf16");
    CPATTN_CHECK(ro.threads >= 1, "--threads must be >= 1, got ", ro.threads);

    wte = add("wte", {V, D}, true);
    for (int l = 0; l < L; ++l) {
      const std::string p = "layer" + std::to_string(l) + ".";
      LayerOffsets o{};
      o.ln1 = add(p + "ln1", {D}, false);
      o.wq = add(p + "wq", {D, H * hd}, true);
      o.wk = add(p + "wk", {D, KV * hd}, true);
      o.wv = add(p + "wv", {D, KV * hd}, true);
      o.wo = add(p + "wo", {H * hd, D}, true);
      o.ln2 = add(p + "ln2", {D}, false);
      o.w1 = add(p + "w1", {D, F}, true);
      o.w3 = add(p + "w3", {D, F}, true);
      o.w2 = add(p + "w2", {F, D}, true);
      lo.push_back(o);
    }
    lnf = add("lnf", {D}, false);
    head = add("lm_head", {D, V}, true);

    params.assign(n_params, 0.0f);
    const int64_t padded = (n_params + cp - 1) / cp * cp;
    grads.assign(padded, 0.0f);
    m.assign(n_params, 0.0f);
    v.assign(n_params, 0.0f);
    Rng rng{seed};
    const double out_std = mc.init_std / std::sqrt(2.0 * L);  // residual projections (GPT-2)
    for (const ParamTensor& t : tensors) {
      const bool norm = t.shape.size() == 1;
      const bool resid_out = t.name.ends_with(".wo") || t.name.ends_with(".w2");
      const double sd = resid_out ? out_std : mc.init_std;
      for (int64_t i = 0; i < t.size; ++i)
        params[t.offset + i] = norm ? 1.0f : static_cast<float>(sd * rng.normal());
    }

    if (openblas_set_num_threads != nullptr) openblas_set_num_threads(ro.threads);
    for (int l = 0; l < L; ++l)
      attn.push_back(std::make_unique<CpAttention>(
          comm, CpAttnConfig{.num_heads_q = H, .num_heads_k = KV, .head_dim_qk = hd, .head_dim_v = hd,
                             .dtype = ro.attn_dtype, .mask = MaskType::causal,
                             .num_threads = ro.threads}));
    resid.resize(L + 1);
    acts.resize(L);
  }

  // ---- Batch setup ------------------------------------------------------------------------------

  void prepare(const PackedSequence& seq) {
    const auto n = static_cast<int64_t>(seq.tokens.size());
    CPATTN_CHECK(n >= 1 && seq.labels.size() == seq.tokens.size() && seq.positions.size() == seq.tokens.size(),
                 "packed sequence: tokens, labels and positions must have the same non-zero length");
    CPATTN_CHECK(seq.cu_seqlens.size() >= 2 && seq.cu_seqlens.back() == n,
                 "packed sequence: cu_seqlens must end at the token count ", n);
    CPATTN_CHECK(n >= min_seq_len(cp), "--seq-len ", n, " cannot give each of the ", cp,
                 " ranks a chunk: it must be at least 2 * cp = ", min_seq_len(cp));
    get_thd_load_balanced_cp_metadata(seq.cu_seqlens, cp, rank, plan);
    TokenBatch global{.tokens = seq.tokens, .labels = seq.labels, .position_ids = seq.positions,
                      .loss_mask = std::vector<float>(seq.tokens.size(), 1.0f)};
    for (std::size_t i = 0; i < seq.tokens.size(); ++i)
      if (seq.labels[i] == kIgnoreIndex) global.loss_mask[i] = 0.0f;
    local = get_batch_on_this_cp_rank(global, seq.cu_seqlens, cp, rank, kEndOfDocument);
    T = plan.local_tokens;
    CPATTN_DASSERT(static_cast<int64_t>(local.tokens.size()) == T);
    for (std::size_t i = 0; i < local.tokens.size(); ++i) {
      CPATTN_CHECK(local.tokens[i] >= 0 && local.tokens[i] < V, "token id ", local.tokens[i],
                   " outside the vocabulary [0, ", V, ")");
      CPATTN_CHECK(local.labels[i] == kIgnoreIndex || (local.labels[i] >= 0 && local.labels[i] < V),
                   "label ", local.labels[i], " outside the vocabulary [0, ", V, ")");
    }

    // Positions for RoPE: the global position in the document (the planner's position_ids), or,
    // for the test of that choice, the offset in this rank's local part of the document.
    std::vector<int64_t> pos = local.position_ids;
    if (ro.rope_local_offsets)
      for (const DocSplit& d : plan.docs)
        for (int64_t i = 0; i < 2 * d.chunk; ++i) pos[d.local_begin + i] = i;
    const int half = hd / 2;
    std::vector<double> inv_freq(half);
    for (int i = 0; i < half; ++i) inv_freq[i] = std::pow(static_cast<double>(mc.rope_theta), -2.0 * i / hd);
    rope_cos.resize(T * half);
    rope_sin.resize(T * half);
    for (int64_t t = 0; t < T; ++t)
      for (int i = 0; i < half; ++i) {
        const double ang = static_cast<double>(pos[t]) * inv_freq[i];
        rope_cos[t * half + i] = static_cast<float>(std::cos(ang));
        rope_sin[t * half + i] = static_cast<float>(std::sin(ang));
      }

    for (auto& r : resid) r.resize(T * D);
    for (LayerActs& a : acts) {
      a.xn1.resize(T * D);
      a.rstd1.resize(T);
      a.q.resize(T * H * hd);
      a.k.resize(T * KV * hd);
      a.v.resize(T * KV * hd);
      a.att.resize(T * H * hd);
      a.x_mid.resize(T * D);
      a.xn2.resize(T * D);
      a.rstd2.resize(T);
      a.a.resize(T * F);
      a.b.resize(T * F);
      a.h.resize(T * F);
    }
    xf.resize(T * D);
    rstdf.resize(T);
    logits.resize(T * V);
  }

  // ---- Forward ----------------------------------------------------------------------------------

  void attention_forward(int l, LayerActs& a, const std::span<const int64_t> cu) {
    CpForwardArgs args{.cu_seqlens = cu, .local_tokens = T};
    if (ro.attn_dtype == DType::f32) {
      args.q = a.q.data();
      args.k = a.k.data();
      args.v = a.v.data();
      args.out = a.att.data();
      attn[l]->forward(args);
      return;
    }
    q16.resize(a.q.size());
    k16.resize(a.k.size());
    v16.resize(a.v.size());
    o16.resize(a.att.size());
    from_float(a.q.data(), a.q.size(), ro.attn_dtype, q16.data());
    from_float(a.k.data(), a.k.size(), ro.attn_dtype, k16.data());
    from_float(a.v.data(), a.v.size(), ro.attn_dtype, v16.data());
    args.q = q16.data();
    args.k = k16.data();
    args.v = v16.data();
    args.out = o16.data();
    attn[l]->forward(args);
    to_float(o16.data(), ro.attn_dtype, o16.size(), a.att.data());
  }

  // Returns this rank's loss sum (nats) and counts its scored tokens.
  double forward(const PackedSequence& seq, int64_t& scored) {
    prepare(seq);
    // Embedding: resid[0][t] = wte[token[t]].
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(resid[0].data() + t * D, P(wte) + local.tokens[t] * D, sizeof(float) * D);
    for (int l = 0; l < L; ++l) {
      const LayerOffsets& o = lo[l];
      LayerActs& a = acts[l];
      const float* x = resid[l].data();
      // Attention block.
      rmsnorm_forward(a.xn1.data(), a.rstd1.data(), x, P(o.ln1), T, D, mc.norm_eps);
      matmul(a.xn1.data(), P(o.wq), a.q.data(), T, H * hd, D, false, false, 0.0f);   // [T, H*hd]
      matmul(a.xn1.data(), P(o.wk), a.k.data(), T, KV * hd, D, false, false, 0.0f);  // [T, KV*hd]
      matmul(a.xn1.data(), P(o.wv), a.v.data(), T, KV * hd, D, false, false, 0.0f);  // [T, KV*hd]
      rope(a.q.data(), rope_cos.data(), rope_sin.data(), T, H, hd, false);
      rope(a.k.data(), rope_cos.data(), rope_sin.data(), T, KV, hd, false);
      attention_forward(l, a, seq.cu_seqlens);                                      // [T, H*hd]
      std::copy(x, x + T * D, a.x_mid.begin());
      matmul(a.att.data(), P(o.wo), a.x_mid.data(), T, D, H * hd, false, false, 1.0f);  // += att @ wo
      // MLP block.
      rmsnorm_forward(a.xn2.data(), a.rstd2.data(), a.x_mid.data(), P(o.ln2), T, D, mc.norm_eps);
      matmul(a.xn2.data(), P(o.w1), a.a.data(), T, F, D, false, false, 0.0f);  // gate [T, F]
      matmul(a.xn2.data(), P(o.w3), a.b.data(), T, F, D, false, false, 0.0f);  // up [T, F]
      for (int64_t i = 0; i < T * F; ++i) a.h[i] = silu(a.a[i]) * a.b[i];
      float* y = resid[l + 1].data();
      std::copy(a.x_mid.begin(), a.x_mid.end(), y);
      matmul(a.h.data(), P(o.w2), y, T, D, F, false, false, 1.0f);  // += h @ w2
    }
    rmsnorm_forward(xf.data(), rstdf.data(), resid[L].data(), P(lnf), T, D, mc.norm_eps);
    matmul(xf.data(), P(head), logits.data(), T, V, D, false, false, 0.0f);  // [T, V]
    // Cross-entropy on labeled rows; their logits become probabilities for the backward.
    double loss_sum = 0;
    scored = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t y = local.labels[t];
      if (y == kIgnoreIndex) continue;
      float* row = logits.data() + t * V;
      float mx = row[0];
      for (int j = 1; j < V; ++j) mx = std::max(mx, row[j]);
      double sum = 0;
      for (int j = 0; j < V; ++j) sum += std::exp(static_cast<double>(row[j] - mx));
      const double lse = static_cast<double>(mx) + std::log(sum);
      loss_sum += lse - static_cast<double>(row[y]);
      for (int j = 0; j < V; ++j) row[j] = static_cast<float>(std::exp(static_cast<double>(row[j]) - lse));
      ++scored;
    }
    return loss_sum;
  }

  // Global mean loss from this rank's sum and count (collective).
  double global_mean(double loss_sum, int64_t scored, int64_t& total) {
    std::array<double, 2> s{loss_sum, static_cast<double>(scored)};
    comm.all_reduce<double>(s, ReduceOp::sum);
    total = static_cast<int64_t>(s[1]);
    CPATTN_CHECK(total > 0, "the sequence has no token with a label");
    return s[0] / s[1];
  }

  // ---- Backward ---------------------------------------------------------------------------------

  void attention_backward(int l) {
    if (ro.attn_dtype == DType::f32) {
      attn[l]->backward({.dout = datt.data(), .dq = dq.data(), .dk = dk.data(), .dv = dv.data()});
      return;
    }
    // dout -> bf16; dq/dk/dv come back in bf16 (reuse the forward's buffers as scratch).
    o16.resize(datt.size());
    q16.resize(dq.size());
    k16.resize(dk.size());
    v16.resize(dv.size());
    from_float(datt.data(), datt.size(), ro.attn_dtype, o16.data());
    attn[l]->backward({.dout = o16.data(), .dq = q16.data(), .dk = k16.data(), .dv = v16.data()});
    to_float(q16.data(), ro.attn_dtype, dq.size(), dq.data());
    to_float(k16.data(), ro.attn_dtype, dk.size(), dk.data());
    to_float(v16.data(), ro.attn_dtype, dv.size(), dv.data());
  }

  // Gradients of (sum of this rank's row losses) / total into grads (overwritten).
  void backward(int64_t total) {
    std::fill(grads.begin(), grads.end(), 0.0f);
    dres.assign(T * D, 0.0f);
    dxn.resize(T * D);
    dh.resize(T * F);
    da.resize(T * F);
    db.resize(T * F);
    datt.resize(T * H * hd);
    dq.resize(T * H * hd);
    dk.resize(T * KV * hd);
    dv.resize(T * KV * hd);

    // dlogits = (p - onehot(y)) / total on labeled rows, 0 elsewhere (in place in logits).
    const float inv = 1.0f / static_cast<float>(total);
    for (int64_t t = 0; t < T; ++t) {
      float* row = logits.data() + t * V;
      const int64_t y = local.labels[t];
      if (y == kIgnoreIndex) {
        std::fill(row, row + V, 0.0f);
        continue;
      }
      row[y] -= 1.0f;
      for (int j = 0; j < V; ++j) row[j] *= inv;
    }
    matmul(xf.data(), logits.data(), G(head), D, V, T, true, false, 1.0f);   // dW = xf^T dlogits
    matmul(logits.data(), P(head), dxn.data(), T, D, V, false, true, 0.0f);  // dxf = dlogits W^T
    rmsnorm_backward(dres.data(), G(lnf), dxn.data(), resid[L].data(), rstdf.data(), P(lnf), T, D);

    for (int l = L - 1; l >= 0; --l) {
      const LayerOffsets& o = lo[l];
      LayerActs& a = acts[l];
      // MLP block: y = x_mid + h @ w2, dres is dy.
      matmul(a.h.data(), dres.data(), G(o.w2), F, D, T, true, false, 1.0f);  // dw2 = h^T dy
      matmul(dres.data(), P(o.w2), dh.data(), T, F, D, false, true, 0.0f);   // dh = dy w2^T
      for (int64_t i = 0; i < T * F; ++i) {
        const float s = 1.0f / (1.0f + std::exp(-a.a[i]));
        const float sl = a.a[i] * s;
        db[i] = dh[i] * sl;
        da[i] = dh[i] * a.b[i] * s * (1.0f + a.a[i] * (1.0f - s));
      }
      matmul(a.xn2.data(), da.data(), G(o.w1), D, F, T, true, false, 1.0f);
      matmul(a.xn2.data(), db.data(), G(o.w3), D, F, T, true, false, 1.0f);
      matmul(da.data(), P(o.w1), dxn.data(), T, D, F, false, true, 0.0f);
      matmul(db.data(), P(o.w3), dxn.data(), T, D, F, false, true, 1.0f);
      rmsnorm_backward(dres.data(), G(o.ln2), dxn.data(), a.x_mid.data(), a.rstd2.data(), P(o.ln2), T, D);
      // Attention block: x_mid = x + att @ wo, dres is d(x_mid).
      matmul(a.att.data(), dres.data(), G(o.wo), H * hd, D, T, true, false, 1.0f);
      matmul(dres.data(), P(o.wo), datt.data(), T, H * hd, D, false, true, 0.0f);
      attention_backward(l);
      rope(dq.data(), rope_cos.data(), rope_sin.data(), T, H, hd, true);
      rope(dk.data(), rope_cos.data(), rope_sin.data(), T, KV, hd, true);
      matmul(a.xn1.data(), dq.data(), G(o.wq), D, H * hd, T, true, false, 1.0f);
      matmul(a.xn1.data(), dk.data(), G(o.wk), D, KV * hd, T, true, false, 1.0f);
      matmul(a.xn1.data(), dv.data(), G(o.wv), D, KV * hd, T, true, false, 1.0f);
      matmul(dq.data(), P(o.wq), dxn.data(), T, D, H * hd, false, true, 0.0f);
      matmul(dk.data(), P(o.wk), dxn.data(), T, D, KV * hd, false, true, 1.0f);
      matmul(dv.data(), P(o.wv), dxn.data(), T, D, KV * hd, false, true, 1.0f);
      rmsnorm_backward(dres.data(), G(o.ln1), dxn.data(), resid[l].data(), a.rstd1.data(), P(o.ln1), T, D);
    }
    // Embedding: scatter-add (padding rows add exact zeros).
    for (int64_t t = 0; t < T; ++t) {
      float* g = G(wte) + local.tokens[t] * D;
      const float* d = dres.data() + t * D;
      for (int i = 0; i < D; ++i) g[i] += d[i];
    }
  }

  // Sum of the gradients over the CP group: reduce-scatter in a fixed order, then all-gather,
  // so that every rank ends with bitwise the same sum on every run.
  void all_reduce_grads() {
    if (cp == 1) return;
    const std::size_t chunk = grads.size() / static_cast<std::size_t>(cp);
    std::vector<float> mine(chunk);
    comm.reduce_scatter_sum(grads, mine);
    comm.all_gather<float>(mine, grads);
  }

  double norm() const {
    double ss = 0;
    for (int64_t i = 0; i < n_params; ++i) ss += static_cast<double>(grads[i]) * grads[i];
    return std::sqrt(ss);
  }

  double loss_and_grad(const PackedSequence& seq, int64_t& total) {
    int64_t scored = 0;
    const double local_sum = forward(seq, scored);
    const double loss = global_mean(local_sum, scored, total);
    backward(total);
    all_reduce_grads();
    grad_norm = norm();
    return loss;
  }

  double lr_at(int64_t s) const {
    if (oc.warmup > 0 && s < oc.warmup)
      return static_cast<double>(oc.lr) * static_cast<double>(s + 1) / oc.warmup;
    return oc.lr;
  }

  void adamw() {
    const float lr = static_cast<float>(lr_at(step));
    const float scale = oc.clip > 0 && grad_norm > oc.clip ? static_cast<float>(oc.clip / grad_norm) : 1.0f;
    const auto t = static_cast<double>(step + 1);
    const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(oc.beta1), t));
    const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(oc.beta2), t));
    for (const ParamTensor& pt : tensors) {
      const float wd = pt.decay ? oc.weight_decay : 0.0f;
      for (int64_t i = pt.offset; i < pt.offset + pt.size; ++i) {
        const float g = grads[i] * scale;
        m[i] = oc.beta1 * m[i] + (1.0f - oc.beta1) * g;
        v[i] = oc.beta2 * v[i] + (1.0f - oc.beta2) * g * g;
        const float mh = m[i] / bc1, vh = v[i] / bc2;
        params[i] -= lr * (mh / (std::sqrt(vh) + oc.eps) + wd * params[i]);
      }
    }
    ++step;
  }
};

Trainer::Trainer(Communicator& comm, const ModelConfig& model, const OptimConfig& optim,
                 const RunOptions& options, uint64_t seed)
    : impl_(std::make_unique<Impl>(comm, model, optim, options)) {
  impl_->build(seed);
}

Trainer::~Trainer() = default;

StepStats Trainer::step(const PackedSequence& seq) {
  Impl& s = *impl_;
  StepStats st;
  st.step = s.step;
  st.lr = s.lr_at(s.step);
  st.loss = s.loss_and_grad(seq, st.tokens);
  st.grad_norm = s.grad_norm;
  st.local_tokens = s.T;
  s.adamw();
  return st;
}

double Trainer::loss_and_grad(const PackedSequence& seq) {
  int64_t total = 0;
  return impl_->loss_and_grad(seq, total);
}

double Trainer::loss(const PackedSequence& seq) {
  int64_t scored = 0, total = 0;
  const double local_sum = impl_->forward(seq, scored);
  return impl_->global_mean(local_sum, scored, total);
}

std::span<float> Trainer::params() { return impl_->params; }
std::span<const float> Trainer::grads() const {
  return std::span<const float>(impl_->grads).first(static_cast<std::size_t>(impl_->n_params));
}
const std::vector<ParamTensor>& Trainer::tensors() const { return impl_->tensors; }
const ModelConfig& Trainer::model() const { return impl_->mc; }
int64_t Trainer::steps_done() const { return impl_->step; }
double Trainer::global_grad_norm() const { return impl_->grad_norm; }

// ---- Checkpoints ------------------------------------------------------------------------------

namespace {

constexpr char kMagic[8] = {'C', 'P', 'A', 'T', 'T', 'N', 'T', 'R'};
constexpr int64_t kVersion = 1;

// The header: magic, then these int64 fields, then params, m, v (fp32, n_params each).
std::vector<int64_t> header_fields(const ModelConfig& mc, int64_t n_params, int64_t step,
                                   const DataPosition& d) {
  return {kVersion,     mc.vocab, mc.layers, mc.dim,  mc.heads, mc.kv_heads, mc.ffn_dim(),
          std::bit_cast<int32_t>(mc.rope_theta), n_params, step, d.doc, d.offset, d.epoch};
}
constexpr std::size_t kHeaderFields = 13;

}  // namespace

void Trainer::save(const std::string& path, const DataPosition& data) const {
  Impl& s = *impl_;
  on_every_rank(s.comm, [&] {
    if (s.rank != 0) return;
    const std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      CPATTN_CHECK(out.good(), "--save: cannot write '", tmp, "'");
      const std::vector<int64_t> h = header_fields(s.mc, s.n_params, s.step, data);
      out.write(kMagic, sizeof kMagic);
      out.write(reinterpret_cast<const char*>(h.data()), static_cast<std::streamsize>(h.size() * sizeof(int64_t)));
      for (const std::vector<float>* a : {&s.params, &s.m, &s.v})
        out.write(reinterpret_cast<const char*>(a->data()), static_cast<std::streamsize>(s.n_params * sizeof(float)));
      CPATTN_CHECK(out.good(), "--save: error while writing '", tmp, "'");
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    CPATTN_CHECK(!ec, "--save: cannot rename '", tmp, "' to '", path, "': ", ec.message());
  });
}

DataPosition Trainer::load(const std::string& path) {
  Impl& s = *impl_;
  DataPosition d;
  on_every_rank(s.comm, [&] {
    std::ifstream in(path, std::ios::binary);
    CPATTN_CHECK(in.good(), "--resume: cannot read '", path, "'");
    char magic[8] = {};
    std::vector<int64_t> h(kHeaderFields);
    in.read(magic, sizeof magic);
    CPATTN_CHECK(in.good() && std::memcmp(magic, kMagic, sizeof kMagic) == 0, "--resume: '", path,
                 "' is not a cpattn training checkpoint");
    in.read(reinterpret_cast<char*>(h.data()), static_cast<std::streamsize>(h.size() * sizeof(int64_t)));
    CPATTN_CHECK(in.good() && h[0] == kVersion, "--resume: '", path, "' has an unknown version");
    const std::vector<int64_t> want = header_fields(s.mc, s.n_params, 0, {});
    const char* names[] = {"version", "vocab", "layers", "dim", "heads", "kv-heads", "ffn", "rope theta", "parameters"};
    for (std::size_t i = 1; i < 9; ++i)
      CPATTN_CHECK(h[i] == want[i], "--resume: '", path, "' holds a model with ", names[i], " = ", h[i],
                   ", this run has ", want[i]);
    std::vector<float> p(s.n_params), m(s.n_params), v(s.n_params);
    for (std::vector<float>* a : {&p, &m, &v})
      in.read(reinterpret_cast<char*>(a->data()), static_cast<std::streamsize>(s.n_params * sizeof(float)));
    CPATTN_CHECK(in.good(), "--resume: '", path, "' is truncated");
    s.params = std::move(p);
    s.m = std::move(m);
    s.v = std::move(v);
    s.step = h[9];
    d = {h[10], h[11], h[12]};
  });
  return d;
}

}  // namespace cpattn::train
