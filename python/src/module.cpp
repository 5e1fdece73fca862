// cpattn._cpattn: the binding module under the cpattn Python package (docs/python.md).
//
// Tensors arrive as DLPack arrays (torch tensors, NumPy arrays) and become cpattn views of the
// same memory: nothing is copied, outputs are written into the caller's storage. This module
// checks what only it can see (dtype, device, rank of the array, strides); the library checks
// the rest (shapes against each other, options, cu_seqlens) and its cpattn::Error surfaces as
// ValueError with the library's message. Every kernel and collective runs with the GIL
// released, so other Python threads run meanwhile.
#include <cpattn/attention.hpp>
#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/version.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>


#include <algorithm>
#include <cstdint>
#include <memory>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace cpattn::python {
namespace {

using Array = nb::ndarray<>;  // any dtype, device and strides: checked here, with names

std::string dtype_name(const nb::dlpack::dtype& t) {
  const char* kind = t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float)    ? "float"
                     : t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                     : t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int)    ? "int"
                     : t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt)   ? "uint"
                                                                                      : "other";
  return kind + std::to_string(t.bits);
}

void check_cpu(const Array& a, const char* name) {
  if (a.device_type() != nb::device::cpu::value)
    throw nb::value_error((std::string(name) + " must be a CPU tensor (cpattn runs on the CPU)").c_str());
}

bool is_16_bit(const Array& a, nb::dlpack::dtype_code code) {
  return a.dtype().code == static_cast<uint8_t>(code) && a.dtype().bits == 16 && a.dtype().lanes == 1;
}

DType storage_dtype(const Array& a, const char* name) {
  if (a.dtype() == nb::dtype<float>()) return DType::f32;
  if (is_16_bit(a, nb::dlpack::dtype_code::Float)) return DType::f16;
  if (is_16_bit(a, nb::dlpack::dtype_code::Bfloat)) return DType::bf16;
  throw nb::type_error((std::string(name) + " must be float32, float16 or bfloat16, got " +
                        dtype_name(a.dtype())).c_str());
}

// [tokens, heads, head_dim] with unit head_dim stride, as a view of the same memory. A stride
// of a dimension of size 1 is meaningless (PyTorch may report anything): left to the view's
// contiguous default (0), as are all of an empty array's.
TensorView view3(const Array& a, const char* name) {
  check_cpu(a, name);
  const DType t = storage_dtype(a, name);
  if (a.ndim() != 3)
    throw nb::value_error((std::string(name) + " must be [tokens, heads, head_dim] (3 dimensions), got " +
                           std::to_string(a.ndim()) + " dimensions").c_str());
  // (an array with no element has no meaningful strides either: torch calls any such tensor
  // contiguous, whatever strides it reports)
  const bool empty = a.shape(0) == 0 || a.shape(1) == 0 || a.shape(2) == 0;
  const auto stride = [&](std::size_t d) -> int64_t { return a.shape(d) == 1 || empty ? 0 : a.stride(d); };
  if (stride(2) != 0 && stride(2) != 1)
    throw nb::value_error((std::string(name) + " must have unit stride in head_dim (its last dimension), got " +
                           std::to_string(a.stride(2)) + ": pass .contiguous()").c_str());
  for (std::size_t d = 0; d < 2; ++d)
    if (!empty && a.shape(d) > 1 && stride(d) < 1)
      throw nb::value_error((std::string(name) + " must have positive strides (no broadcast or flipped "
                             "dimension), got stride " + std::to_string(a.stride(d)) + " in dimension " +
                             std::to_string(d)).c_str());
  return {.data = a.data(), .rows = static_cast<int64_t>(a.shape(0)), .heads = static_cast<int>(a.shape(1)),
          .dim = static_cast<int>(a.shape(2)), .dtype = t, .row_stride = stride(0), .head_stride = stride(1)};
}

// A contiguous fp32 array of `rows` x `cols` (lse), or with no `rows` of `cols` (alibi_slopes),
// as a pointer.
float* f32_buffer(const Array& a, const char* name, std::optional<int64_t> rows, int64_t cols) {
  check_cpu(a, name);
  if (a.dtype() != nb::dtype<float>())
    throw nb::type_error((std::string(name) + " must be float32, got " + dtype_name(a.dtype())).c_str());
  const auto dim = [&](std::size_t d) { return static_cast<int64_t>(a.shape(d)); };
  const bool shape_ok = !rows ? a.ndim() == 1 && dim(0) == cols : a.ndim() == 2 && dim(0) == *rows && dim(1) == cols;
  const bool contiguous = !shape_ok || (a.ndim() == 1 ? dim(0) <= 1 || a.stride(0) == 1
                                                      : (dim(1) <= 1 || a.stride(1) == 1) &&
                                                            (dim(0) <= 1 || a.stride(0) == dim(1)));
  if (!shape_ok || !contiguous)
    throw nb::value_error((std::string(name) + " must be a contiguous float32 array of shape " +
                           (!rows ? "[" + std::to_string(cols) + "]"
                                  : "[" + std::to_string(*rows) + ", " + std::to_string(cols) + "]")).c_str());
  return static_cast<float*>(a.data());
}

// Document boundaries as the library takes them: a 1-D contiguous int32 or int64 array.
struct Boundaries {
  std::span<const int32_t> i32 = {};
  std::span<const int64_t> i64 = {};
  int64_t size() const { return i32.empty() ? static_cast<int64_t>(i64.size()) : static_cast<int64_t>(i32.size()); }
  int64_t at(int64_t i) const { return i32.empty() ? i64[i] : int64_t{i32[i]}; }
  int64_t longest() const {
    int64_t m = 0;
    for (int64_t i = 1; i < size(); ++i) m = std::max(m, at(i) - at(i - 1));
    return m;
  }
};

Boundaries boundaries(const Array& a, const char* name) {
  check_cpu(a, name);
  const bool i32 = a.dtype() == nb::dtype<int32_t>(), i64 = a.dtype() == nb::dtype<int64_t>();
  if (!i32 && !i64)
    throw nb::type_error((std::string(name) + " must be int32 or int64, got " + dtype_name(a.dtype())).c_str());
  if (a.ndim() != 1 || (a.shape(0) > 1 && a.stride(0) != 1))
    throw nb::value_error((std::string(name) + " must be a contiguous 1-D array [documents + 1]").c_str());
  const std::size_t n = a.shape(0);
  if (i32) return {.i32 = {static_cast<const int32_t*>(a.data()), n}};
  return {.i64 = {static_cast<const int64_t*>(a.data()), n}};
}

WorkList varlen_work(const Boundaries& q, const Boundaries& k, MaskType mask) {
  if (!q.i32.empty() && !k.i32.empty()) return varlen_worklist(q.i32, k.i32, mask);
  const auto widen = [](const Boundaries& b) {
    std::vector<int64_t> w(b.size());
    for (int64_t i = 0; i < b.size(); ++i) w[i] = b.at(i);
    return w;
  };
  return varlen_worklist(widen(q), widen(k), mask);
}

// FlashAttention's rules tying cu_seqlens to the tensors: the last boundary is the row count,
// and max_seqlen bounds every document.
void check_against(const Boundaries& cu, const char* name, int64_t rows, const char* rows_name,
                   int64_t max_seqlen, const char* max_name) {
  CPATTN_CHECK(cu.size() >= 2, name, " must hold at least one document ([0, T]), got ", cu.size(), " entries");
  CPATTN_CHECK(cu.at(cu.size() - 1) == rows, name, "[-1] must equal ", rows_name, " = ", rows, ", got ",
               cu.at(cu.size() - 1));
  CPATTN_CHECK(max_seqlen >= cu.longest(), max_name, " must be >= the longest document of ", name, " (",
               cu.longest(), "), got ", max_seqlen);
}

// AttnOptions without the ALiBi pointer, which each call passes with its own array.
AttnOptions make_options(bool causal, std::optional<float> softmax_scale, float dropout_p, uint64_t seed,
                         int64_t window_left, int64_t window_right, float softcap, int num_threads) {
  return {.mask = causal ? MaskType::causal : MaskType::none, .softmax_scale = softmax_scale,
          .dropout_p = dropout_p, .seed = seed, .num_threads = num_threads,
          .window_size_left = window_left, .window_size_right = window_right, .softcap = softcap};
}

AttnOptions with_alibi(AttnOptions o, const std::optional<Array>& alibi, int heads_q) {
  if (alibi) o.alibi_slopes = f32_buffer(*alibi, "alibi_slopes", std::nullopt, heads_q);
  return o;
}

struct VarlenCall {
  Boundaries cu_q = {}, cu_k = {};
  WorkList work = {};
  AttnInputs in = {};
};

VarlenCall varlen_call(const Array& q, const Array& k, const Array& v, const Array& cu_seqlens_q,
                       const Array& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                       const AttnOptions& options, const std::optional<Array>& alibi) {
  VarlenCall c{.cu_q = boundaries(cu_seqlens_q, "cu_seqlens_q"), .cu_k = boundaries(cu_seqlens_k, "cu_seqlens_k")};
  const ConstTensorView qv = view3(q, "q"), kv = view3(k, "k"), vv = view3(v, "v");
  check_against(c.cu_q, "cu_seqlens_q", qv.rows, "q.shape[0]", max_seqlen_q, "max_seqlen_q");
  check_against(c.cu_k, "cu_seqlens_k", kv.rows, "k.shape[0]", max_seqlen_k, "max_seqlen_k");
  c.work = varlen_work(c.cu_q, c.cu_k, options.mask);
  c.in = {.q = qv, .k = kv, .v = vv, .work = &c.work, .options = with_alibi(options, alibi, qv.heads)};
  return c;
}

void forward(const Array& q, const Array& k, const Array& v, const Array& cu_seqlens_q, const Array& cu_seqlens_k,
             int64_t max_seqlen_q, int64_t max_seqlen_k, const AttnOptions& options,
             const std::optional<Array>& alibi, const Array& out, const Array& lse) {
  const VarlenCall c = varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, alibi);
  const AttnFwdParams p{.in = c.in, .out = view3(out, "out"),
                        .lse = f32_buffer(lse, "lse", c.in.q.rows, c.in.q.heads)};
  nb::gil_scoped_release release;
  attention_forward(p);
}

void backward(const Array& q, const Array& k, const Array& v, const Array& cu_seqlens_q, const Array& cu_seqlens_k,
              int64_t max_seqlen_q, int64_t max_seqlen_k, const AttnOptions& options,
              const std::optional<Array>& alibi, const Array& out, const Array& lse, const Array& dout,
              const Array& dq, const Array& dk, const Array& dv) {
  const VarlenCall c = varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, alibi);
  const AttnBwdParams p{.in = c.in, .out = view3(out, "out"),
                        .lse = f32_buffer(lse, "lse", c.in.q.rows, c.in.q.heads), .dout = view3(dout, "dout"),
                        .dq = view3(dq, "dq"), .dk = view3(dk, "dk"), .dv = view3(dv, "dv")};
  nb::gil_scoped_release release;
  attention_backward(p);
}

// ---- The planner ---------------------------------------------------------------------------

template <class T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T> v) {
  auto* owned = new std::vector<T>(std::move(v));
  nb::capsule deleter(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), {owned->size()}, deleter);
}

template <class Field>
nb::ndarray<nb::numpy, int64_t> doc_field(const std::vector<DocSplit>& docs, Field f) {
  std::vector<int64_t> v(docs.size());
  std::transform(docs.begin(), docs.end(), v.begin(), [&](const DocSplit& d) { return d.*f; });
  return to_numpy(std::move(v));
}

nb::dict work_dict(const WorkList& w) {
  std::vector<int64_t> q_row, q_len, q_pos, doc, run_begin, run_end, row, len, pos;
  for (const AttnTask& t : w.tasks) {
    q_row.push_back(t.q_row), q_len.push_back(t.q_len), q_pos.push_back(t.q_pos), doc.push_back(t.doc);
    run_begin.push_back(t.run_begin), run_end.push_back(t.run_end);
  }
  for (const KeyRun& r : w.runs) row.push_back(r.row), len.push_back(r.len), pos.push_back(r.pos);
  nb::dict d;
  d["q_row"] = to_numpy(q_row), d["q_len"] = to_numpy(q_len), d["q_pos"] = to_numpy(q_pos);
  d["doc"] = to_numpy(doc), d["run_begin"] = to_numpy(run_begin), d["run_end"] = to_numpy(run_end);
  d["run_row"] = to_numpy(row), d["run_len"] = to_numpy(len), d["run_pos"] = to_numpy(pos);
  return d;
}

// RankPlan's fields under their C++ names (DocSplit's and WorkList's as arrays per field).
nb::dict plan_dict(RankPlan p) {
  nb::dict d;
  d["cp"] = p.cp, d["rank"] = p.rank, d["split"] = std::string(to_string(p.split));
  d["global_tokens"] = p.global_tokens;
  d["global_tokens_padded"] = p.global_tokens_padded, d["local_tokens"] = p.local_tokens;
  d["padding_tokens"] = p.padding_tokens;
  nb::dict docs;
  docs["begin"] = doc_field(p.docs, &DocSplit::begin), docs["len"] = doc_field(p.docs, &DocSplit::len);
  docs["padded_begin"] = doc_field(p.docs, &DocSplit::padded_begin);
  docs["padded_len"] = doc_field(p.docs, &DocSplit::padded_len);
  docs["chunk"] = doc_field(p.docs, &DocSplit::chunk), docs["local_begin"] = doc_field(p.docs, &DocSplit::local_begin);
  d["docs"] = docs;
  d["work"] = work_dict(p.work), d["work_indexed"] = work_dict(p.work_indexed);
  d["rect_work"] = p.workload.rect_work, d["visible_pairs"] = p.workload.visible_pairs;
  d["cu_seqlens"] = to_numpy(std::move(p.cu_seqlens));
  d["cu_seqlens_padded"] = to_numpy(std::move(p.cu_seqlens_padded));
  d["global_token_index"] = to_numpy(std::move(p.global_token_index));
  d["real_token_index"] = to_numpy(std::move(p.real_token_index));
  d["cu_seqlens_q"] = to_numpy(std::move(p.cu_seqlens_q)), d["cu_seqlens_kv"] = to_numpy(std::move(p.cu_seqlens_kv));
  d["actual_seq_qlen"] = to_numpy(std::move(p.actual_seq_qlen));
  d["actual_seq_kvlen"] = to_numpy(std::move(p.actual_seq_kvlen));
  d["kv_gather_index"] = to_numpy(std::move(p.kv_gather_index));
  return d;
}

// CpSplit by its to_string name ("padded", "padding-free"; also the enum's "padding_free").
CpSplit parse_split(const std::string& s) {
  for (const CpSplit c : {CpSplit::padded, CpSplit::padding_free})
    if (s == to_string(c)) return c;
  if (s == "padding_free") return CpSplit::padding_free;
  CPATTN_CHECK(false, "split must be one of padded, padding-free, got '", s, "'");
  return CpSplit::padded;  // not reached
}

RankPlan rank_plan(const Array& cu_seqlens, int cp_size, int rank, const std::string& split) {
  const Boundaries cu = boundaries(cu_seqlens, "cu_seqlens");
  const PlanOptions o{.split = parse_split(split)};
  return cu.i32.empty() ? get_thd_load_balanced_cp_metadata(cu.i64, cp_size, rank, o)
                        : get_thd_load_balanced_cp_metadata(cu.i32, cp_size, rank, o);
}

nb::dict plan(const Array& cu_seqlens, int cp_size, int rank, const std::string& split) {
  return plan_dict(rank_plan(cu_seqlens, cp_size, rank, split));
}

template <class T>
std::vector<T> to_vector(const nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>& a) {
  return {a.data(), a.data() + a.shape(0)};
}

using I64Array = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using F32Array = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

nb::dict batch_on_rank(const I64Array& tokens, const I64Array& labels, const I64Array& position_ids,
                       const F32Array& loss_mask, const Array& cu_seqlens, int cp_size, int rank,
                       int64_t pad_token_id, const std::string& split) {
  const RankPlan p = rank_plan(cu_seqlens, cp_size, rank, split);
  const TokenBatch b{.tokens = to_vector(tokens), .labels = to_vector(labels),
                     .position_ids = to_vector(position_ids), .loss_mask = to_vector(loss_mask)};
  TokenBatch local = get_batch_on_this_cp_rank(b, p, pad_token_id);
  nb::dict d;
  d["tokens"] = to_numpy(std::move(local.tokens)), d["labels"] = to_numpy(std::move(local.labels));
  d["position_ids"] = to_numpy(std::move(local.position_ids));
  d["loss_mask"] = to_numpy(std::move(local.loss_mask));
  return d;
}

// ---- Context parallelism -------------------------------------------------------------------

MPI_Comm comm_handle(std::uintptr_t comm_handle_address) {
  return *reinterpret_cast<const MPI_Comm*>(comm_handle_address);
}

// The module's communicator: one duplicate of the caller's, made with the module (a collective
// every rank makes alike) and shared by its layers, so that making a layer sends nothing and
// every call of any layer meets in the same place.
class CpComm {
 public:
  CpComm(std::uintptr_t comm_handle_address, std::optional<double> timeout_s)
      : comm_(std::make_shared<Communicator>(comm_handle(comm_handle_address),
                                             CommOptions{.timeout_s = timeout_s, .timeout_name = "timeout"})) {}

  int size() const { return comm_->size(); }
  int rank() const { return comm_->rank(); }
  const std::shared_ptr<Communicator>& comm() const { return comm_; }

  // A forward's first meeting (ContextParallelAttention.forward, before its layer's call): every
  // rank's error from the module's own checks (empty: none), whether it runs dropout, and rank
  // 0's dropout seed, in one agreement under the communicator's deadline. An error on any rank
  // raises on every rank (ValueError naming the ranks and the rule); ranks that disagree on
  // dropout likewise. Returns rank 0's seed when dropout is on.
  std::optional<uint64_t> meet(const std::string& local_error, std::optional<uint64_t> seed) {
    Fingerprint fp;
    if (local_error.empty())  // (a rank with an error sends no fields: errors are compared first)
      fp.add("dropout (training mode and dropout_p > 0)", seed.has_value())
          .add_min("rank 0's dropout seed", comm_->rank() == 0 && seed ? static_cast<int64_t>(*seed)
                                                                        : std::numeric_limits<int64_t>::max());
    std::vector<int64_t> minima;
    {
      nb::gil_scoped_release release;
      minima = agree(*comm_, fp, kCpAgreement, local_error);
    }
    if (!seed) return std::nullopt;
    return static_cast<uint64_t>(minima.at(0));
  }

 private:
  std::shared_ptr<Communicator> comm_;
};

// One CpAttention over the module's communicator (CpComm), which it keeps alive.
class CpLayer {
 public:
  CpLayer(const CpComm& comm, const CpAttnConfig& cfg) : comm_(comm), attn_(*comm_.comm(), cfg) {}

  int size() const { return comm_.size(); }
  int rank() const { return comm_.rank(); }

  CpContext forward(const Array& cu_seqlens, const Array& q, const Array& k, const Array& v, const Array& out,
                    const Array& lse, std::optional<uint64_t> dropout_seed) {
    std::string error;
    const CpForwardArgs a = checked(error, [&] {
      const Boundaries cu = boundaries(cu_seqlens, "cu_seqlens");
      const TensorView qv = view3(q, "q");
      return CpForwardArgs{.plan = cu.i32.empty() ? attn_.plan(cu.i64) : attn_.plan(cu.i32), .q = qv,
                           .k = view3(k, "k"), .v = view3(v, "v"), .out = view3(out, "out"),
                           .lse = f32_buffer(lse, "lse", qv.rows, attn_.config().num_heads_q),
                           .dropout_seed = dropout_seed};
    });
    nb::gil_scoped_release release;
    return attn_.forward(a);
  }

  void backward(CpContext& ctx, const Array& q, const Array& out, const Array& dout, const Array& dq,
                const Array& dk, const Array& dv) {
    std::string error;
    const CpBackwardArgs a = checked(error, [&] {
      return CpBackwardArgs{.q = view3(q, "q"), .out = view3(out, "out"), .dout = view3(dout, "dout"),
                            .dq = view3(dq, "dq"), .dk = view3(dk, "dk"), .dv = view3(dv, "dv")};
    });
    nb::gil_scoped_release release;
    attn_.backward(ctx, a);
  }

 private:
  // make()'s arguments (this rank's views of its arrays: the binding's checks). When a check
  // fails and there are peers, they are on their way to the call's agreement: the call is made
  // with the message as its caller_error (kept in `error`), so that every rank raises it, rather
  // than the peers waiting out the deadline. Alone, the check's own error is raised.
  template <class Make>
  auto checked(std::string& error, Make&& make) -> decltype(make()) {
    try {
      return make();
    } catch (const std::exception& e) {
      if (comm_.size() == 1) throw;
      error = e.what();
      return {.caller_error = error};
    }
  }

  CpComm comm_;  // (a copy: the communicator is shared)
  CpAttention attn_;
};

// hybrid_outer by its to_string name (check_cp_scheme then takes allgather or ring only).
CpScheme parse_hybrid_outer(const std::string& s) {
  for (const CpScheme c : kCpSchemes)
    if (s == to_string(c)) return c;
  CPATTN_CHECK(false, "hybrid_outer must be one of allgather, ring, got '", s, "'");
  return CpScheme::allgather;  // not reached
}

KvMode parse_kv_mode(const std::string& s) {
  if (s == "runs") return KvMode::runs;
  CPATTN_CHECK(s == "index", "kv_mode must be one of runs, index, got '", s, "'");
  return KvMode::index;
}

// CpAttnConfig's scheme fields, under their C++ names; the Python module's arguments.
struct SchemeArgs {
  std::string scheme, hybrid_outer, split, kv_mode;
  int cp_inner = 0;
  bool overlap = true, deterministic = true, check_finite = false;
  std::size_t plan_cache_capacity = 8;
  bool shared_memory = true;
};

CpAttnConfig scheme_config(const SchemeArgs& a) {
  return {.deterministic = a.deterministic, .kv_mode = parse_kv_mode(a.kv_mode), .check_finite = a.check_finite,
          .plan_cache_capacity = a.plan_cache_capacity, .scheme = parse_cp_scheme(a.scheme),
          .cp_inner = a.cp_inner, .hybrid_outer = parse_hybrid_outer(a.hybrid_outer),
          .split = parse_split(a.split), .overlap = a.overlap, .shared_memory = a.shared_memory};
}

// The scheme's rules for a communicator of cp ranks (check_cp_scheme), with nothing sent: what
// the module checks when it is made, on every rank alike.
void check_scheme(int cp, const SchemeArgs& a) { check_cp_scheme(scheme_config(a), cp); }

CpLayer* make_cp_layer(const CpComm& comm, int num_heads_q, int num_heads_k, int head_dim_qk, int head_dim_v,
                       const std::string& dtype, const SchemeArgs& scheme, const AttnOptions& options,
                       const std::optional<Array>& alibi) {
  CpAttnConfig cfg = scheme_config(scheme);
  cfg.num_heads_q = num_heads_q, cfg.num_heads_k = num_heads_k;
  cfg.head_dim_qk = head_dim_qk, cfg.head_dim_v = head_dim_v;
  cfg.dtype = DType::f32;  // the Python side passes to_string(DType)'s spelling of a checked dtype
  for (const DType d : {DType::f16, DType::bf16})
    if (dtype == to_string(d)) cfg.dtype = d;
  cfg.options = with_alibi(options, alibi, num_heads_q);
  // Bad sizes for the scheme (a2a's head counts) fail here, with nothing sent (the module's
  // forward passes the message to every rank through CpComm::meet).
  check_cp_attn_config(cfg, comm.size());
  return new CpLayer(comm, cfg);
}

}  // namespace
}  // namespace cpattn::python

NB_MODULE(_cpattn, m) {
  namespace py = cpattn::python;
  m.attr("__version__") = CPATTN_VERSION_STRING;
  m.attr("MAX_PLAN_CACHE_CAPACITY") = cpattn::kMaxPlanCacheCapacity;
  // Options and CP layers live in autograd graphs and modules that Python may still hold at
  // interpreter exit; nanobind's leak report would then be noise.
  nb::set_leak_warnings(false);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const cpattn::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.message().c_str());
    }
  });

  nb::class_<cpattn::AttnOptions>(m, "AttnOptions");
  m.def("make_options", &py::make_options, "causal"_a, "softmax_scale"_a.none(), "dropout_p"_a, "seed"_a,
        "window_left"_a, "window_right"_a, "softcap"_a, "num_threads"_a);
  m.def("forward", &py::forward, "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "max_seqlen_q"_a,
        "max_seqlen_k"_a, "options"_a, "alibi_slopes"_a.none(), "out"_a, "lse"_a);
  m.def("backward", &py::backward, "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "max_seqlen_q"_a,
        "max_seqlen_k"_a, "options"_a, "alibi_slopes"_a.none(), "out"_a, "lse"_a, "dout"_a, "dq"_a, "dk"_a,
        "dv"_a);
  m.def("plan", &py::plan, "cu_seqlens"_a, "cp_size"_a, "rank"_a, "split"_a);
  m.def("batch_on_rank", &py::batch_on_rank, "tokens"_a, "labels"_a, "position_ids"_a, "loss_mask"_a,
        "cu_seqlens"_a, "cp_size"_a, "rank"_a, "pad_token_id"_a, "split"_a);
  m.def("best_kernel_path", [] { return std::string(cpattn::to_string(cpattn::best_kernel_path())); });

  nb::class_<cpattn::CpContext>(m, "CpContext").def_prop_ro("valid", &cpattn::CpContext::valid);
  nb::class_<py::CpComm>(m, "CpComm")
      .def(nb::init<std::uintptr_t, std::optional<double>>(), "comm_handle_address"_a, "timeout_s"_a.none(),
           nb::call_guard<nb::gil_scoped_release>())  // (the duplicate is collective)
      .def_prop_ro("size", &py::CpComm::size)
      .def_prop_ro("rank", &py::CpComm::rank)
      .def("meet", &py::CpComm::meet, "local_error"_a, "dropout_seed"_a.none());
  nb::class_<py::CpLayer>(m, "CpLayer")
      .def_prop_ro("size", &py::CpLayer::size)
      .def_prop_ro("rank", &py::CpLayer::rank)
      .def("forward", &py::CpLayer::forward, "cu_seqlens"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a,
           "dropout_seed"_a.none())
      .def("backward", &py::CpLayer::backward, "ctx"_a, "q"_a, "out"_a, "dout"_a, "dq"_a, "dk"_a, "dv"_a);
  nb::class_<py::SchemeArgs>(m, "SchemeArgs")
      .def("__init__",
           [](py::SchemeArgs* a, std::string scheme, int cp_inner, std::string hybrid_outer, std::string split,
              std::string kv_mode, bool overlap, bool deterministic, bool check_finite,
              std::size_t plan_cache_capacity, bool shared_memory) {
             new (a) py::SchemeArgs{.scheme = std::move(scheme), .hybrid_outer = std::move(hybrid_outer),
                                    .split = std::move(split), .kv_mode = std::move(kv_mode), .cp_inner = cp_inner,
                                    .overlap = overlap, .deterministic = deterministic, .check_finite = check_finite,
                                    .plan_cache_capacity = plan_cache_capacity, .shared_memory = shared_memory};
           },
           "scheme"_a, "cp_inner"_a, "hybrid_outer"_a, "split"_a, "kv_mode"_a, "overlap"_a, "deterministic"_a, "check_finite"_a,
           "plan_cache_capacity"_a, "shared_memory"_a = true);
  m.def("check_scheme", &py::check_scheme, "cp"_a, "scheme"_a);
  m.def("make_cp_layer", &py::make_cp_layer, "comm"_a, "num_heads_q"_a, "num_heads_k"_a, "head_dim_qk"_a,
        "head_dim_v"_a, "dtype"_a, "scheme"_a, "options"_a, "alibi_slopes"_a.none(), nb::rv_policy::take_ownership);
}
