#include <cpattn/check/batch.hpp>

#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/npy.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

namespace cpattn::check {

std::vector<int64_t> document_mix(int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(std::log(16.0), std::log(static_cast<double>(kDocumentMixLongest)));
  std::vector<int64_t> lengths;
  for (int64_t left = tokens; left > 0;) {
    const int64_t len = std::min<int64_t>(left, static_cast<int64_t>(std::exp(u(rng))));
    lengths.push_back(len);
    left -= len;
  }
  return lengths;
}

Tensor random_tensor(DType t, TensorShape s, std::mt19937_64& rng, float stddev) {
  std::normal_distribution<float> d(0.0f, stddev);
  Tensor r(t, s);
  for (std::size_t i = 0; i < r.size(); ++i) r.set(i, d(rng));
  return r;
}

Tensor random_tensor(DType t, TensorShape s, uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  return random_tensor(t, s, rng, stddev);
}

Batch random_batch(std::vector<int64_t> cu_seqlens, BatchShape shape, DType t, uint64_t seed) {
  check_cu_seqlens(cu_seqlens);
  Batch b;
  b.cu_seqlens = std::move(cu_seqlens);
  b.shape = shape;
  b.dtype = t;
  std::mt19937_64 rng(seed);
  b.q = random_tensor(t, b.q_shape(), rng);
  b.k = random_tensor(t, b.k_shape(), rng);
  b.v = random_tensor(t, b.v_shape(), rng);
  b.dout = random_tensor(t, b.out_shape(), rng);
  return b;
}

namespace {

// One of npy_batch's files, whole or its header alone; the reader's errors name `what` too.
NpyArray load_npy(const std::string& dir, const char* name, const std::string& what, bool header_only) {
  try {
    return header_only ? read_npy_header(dir + "/" + name) : read_npy(dir + "/" + name);
  } catch (const Error& e) {
    throw Error(what + ": " + e.message());
  }
}

// The batch's boundaries and shape from its files' types and shapes (npy_batch's rules).
NpyBatchInfo check_npy_batch(const NpyArray& q, const NpyArray& k, const NpyArray& v, const NpyArray& dout,
                             const NpyArray& cu, const std::string& w) {
  CPATTN_CHECK(cu.type == NpyType::i32 || cu.type == NpyType::i64,
               w, ": cu_seqlens.npy must hold int32 or int64");
  CPATTN_CHECK(cu.shape.size() == 1, w, ": cu_seqlens.npy must be 1-D, [documents + 1], got ", cu.shape.size(),
               " dimensions");
  NpyBatchInfo info;
  info.cu_seqlens = cu.as_int64();
  const std::pair<const NpyArray*, const char*> inputs[] = {{&q, "q.npy"}, {&k, "k.npy"}, {&v, "v.npy"},
                                                            {&dout, "dout.npy"}};
  for (const auto& [arr, name] : inputs) {
    CPATTN_CHECK(arr->type == NpyType::f32 || arr->type == NpyType::f16, w, ": ", name,
                 " must hold float32 or float16");
    CPATTN_CHECK(arr->shape.size() == 3, w, ": ", name, " must be [tokens, heads, head_dim], got ",
                 arr->shape.size(), " dimensions");
  }
  check_cu_seqlens(info.cu_seqlens, q.shape[0], w + " cu_seqlens.npy");
  info.shape.heads_q = static_cast<int>(q.shape[1]);
  info.shape.head_dim_qk = static_cast<int>(q.shape[2]);
  info.shape.heads_k = static_cast<int>(k.shape[1]);
  info.shape.head_dim_v = static_cast<int>(v.shape[2]);
  const BatchShape& s = info.shape;
  CPATTN_CHECK(k.shape[0] == q.shape[0] && v.shape[0] == q.shape[0] && dout.shape[0] == q.shape[0],
               w, ": q, k, v and dout must hold the same token count");
  CPATTN_CHECK(k.shape[2] == s.head_dim_qk && v.shape[1] == s.heads_k, w,
               ": k must be [T, Hkv, Dqk] and v [T, Hkv, Dv]");
  CPATTN_CHECK(dout.shape[1] == s.heads_q && dout.shape[2] == s.head_dim_v, w,
               ": dout must be [T, Hq, Dv]");
  return info;
}

}  // namespace

NpyBatchInfo npy_batch_info(const std::string& dir, std::string_view what) {
  const std::string w(what);
  // (in this order, as npy_batch reads them: a missing q.npy is the one named)
  const NpyArray q = load_npy(dir, "q.npy", w, true), k = load_npy(dir, "k.npy", w, true),
                 v = load_npy(dir, "v.npy", w, true), dout = load_npy(dir, "dout.npy", w, true);
  return check_npy_batch(q, k, v, dout, load_npy(dir, "cu_seqlens.npy", w, false), w);
}

Batch npy_batch(const std::string& dir, DType t, std::string_view what) {
  const std::string w(what);
  const NpyArray q = load_npy(dir, "q.npy", w, false), k = load_npy(dir, "k.npy", w, false),
                 v = load_npy(dir, "v.npy", w, false), dout = load_npy(dir, "dout.npy", w, false);
  NpyBatchInfo info = check_npy_batch(q, k, v, dout, load_npy(dir, "cu_seqlens.npy", w, false), w);
  Batch b;
  b.dtype = t;
  b.cu_seqlens = std::move(info.cu_seqlens);
  b.shape = info.shape;
  // Stored as `t`: a finite value past t's range would become inf silently.
  const auto stored = [&](const char* name, const NpyArray& arr, TensorShape shape) {
    const std::vector<float> values = arr.as_float();
    if (const std::optional<std::size_t> i = first_overflow(values.data(), values.size(), t)) {
      const auto row = static_cast<int64_t>(*i / static_cast<std::size_t>(shape.row_elements()));
      const auto in_row = static_cast<int64_t>(*i % static_cast<std::size_t>(shape.row_elements()));
      const ElementIndex at{row, static_cast<int>(in_row / shape.dim), static_cast<int>(in_row % shape.dim)};
      CPATTN_CHECK(false, w, ": ", describe_element(name, values[*i], row, at), ", finite in float32 but past ",
                   to_string(t), "'s range (it would become inf; store it as fp32)");
    }
    return Tensor::from(t, shape, values);
  };
  b.q = stored("q.npy", q, b.q_shape());
  b.k = stored("k.npy", k, b.k_shape());
  b.v = stored("v.npy", v, b.v_shape());
  b.dout = stored("dout.npy", dout, b.out_shape());
  return b;
}

Results single_process(const Batch& b, const AttnOptions& options) {
  const DType t = b.dtype;
  Tensor out(t, b.out_shape()), dq(t, b.q_shape()), dk(t, b.k_shape()), dv(t, b.v_shape());
  Results r;
  r.lse.resize(static_cast<std::size_t>(b.tokens() * b.shape.heads_q));
  const WorkList wl = varlen_worklist(b.cu_seqlens, b.cu_seqlens, options.mask);
  const AttnInputs in{.q = b.q.view(), .k = b.k.view(), .v = b.v.view(), .work = &wl,
                      .options = options};
  attention_forward({.in = in, .out = out.view(), .lse = r.lse.data()});
  attention_backward({.in = in, .out = out.view(), .lse = r.lse.data(), .dout = b.dout.view(),
                      .dq = dq.view(), .dk = dk.view(), .dv = dv.view()});
  r.out = out.values();
  r.dq = dq.values();
  r.dk = dk.values();
  r.dv = dv.values();
  return r;
}

Tensor local_rows(const Tensor& global, const RankPlan& plan) {
  Tensor l(global.dtype, {plan.local_tokens, global.shape.heads, global.shape.dim});
  take_local_rows(global.data(), global.shape.row_elements() * static_cast<int64_t>(dtype_size(global.dtype)),
                  plan, l.data());
  if (l.dtype != DType::f32) l.f = l.values();
  return l;
}

int64_t nonzero_padding_rows(ConstTensorView local, const RankPlan& plan) {
  return padding_rows_not_equal(local, plan, 0.0f);
}

int64_t padding_rows_not_equal(ConstTensorView local, const RankPlan& plan, float value) {
  CPATTN_CHECK(local.rows == plan.local_tokens, "check::padding_rows_not_equal: the view has ", local.rows,
               " rows, the plan ", plan.local_tokens, " local tokens");
  const std::size_t es = dtype_size(local.dtype);
  std::vector<float> row(static_cast<std::size_t>(local.dim));
  int64_t n = 0;
  for (int64_t i = 0; i < plan.local_tokens; ++i) {
    if (plan.real_token_index[i] >= 0) continue;
    bool equal = true;
    for (int h = 0; h < local.heads && equal; ++h) {
      to_float(static_cast<const std::byte*>(local.data) + local.offset(i, h) * static_cast<int64_t>(es),
               local.dtype, row.size(), row.data());
      equal = std::all_of(row.begin(), row.end(), [value](float x) { return x == value; });
    }
    n += equal ? 0 : 1;
  }
  return n;
}

}  // namespace cpattn::check
