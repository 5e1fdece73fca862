#include <cpattn/check/problem.hpp>

#include <random>

namespace cpattn::check {

Problem::Problem(const AttnCase& cs, DType t, uint64_t seed, float magnitude) : c(cs), dtype(t) {
  work = varlen_worklist(c.cu_seqlens_q(), c.cu_seqlens_k(), c.mask);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto fill = [&](Tensor& x, TensorShape s, float mag) {
    x = Tensor(t, s);
    for (std::size_t i = 0; i < x.size(); ++i) x.set(i, mag * u(rng));
  };
  fill(q, q_shape(), magnitude);
  fill(k, k_shape(), magnitude);
  fill(v, v_shape(), 1.0f);
  fill(dout, out_shape(), 1.0f);
  if (c.alibi) slopes = alibi_slopes(c.num_heads_q);
}

AttnFwdParams Problem::fwd(const Tensor& Q, const Tensor& K, const Tensor& V, Tensor& out,
                           float* lse, KernelPath path, int threads, const WorkList* w) const {
  return {.in = {.q = Q.view(), .k = K.view(), .v = V.view(), .work = w ? w : &work,
                 .options = options(path, threads)},
          .out = out.view(),
          .lse = lse};
}

AttnBwdParams Problem::bwd(const Tensor& Q, const Tensor& K, const Tensor& V, const Tensor& out,
                           const float* lse, const Tensor& dO, Tensor& dq, Tensor& dk,
                           Tensor& dvt, KernelPath path, int threads, const WorkList* w) const {
  return {.in = {.q = Q.view(), .k = K.view(), .v = V.view(), .work = w ? w : &work,
                 .options = options(path, threads)},
          .out = out.view(),
          .lse = lse,
          .dout = dO.view(),
          .dq = dq.view(),
          .dk = dk.view(),
          .dv = dvt.view(),
          .grad_mode = GradMode::write};
}

namespace {

Results run_with(const Problem& pb, DType dt, bool ref, RefAccum accum, KernelPath path,
                 int threads, const Tensor* out_in, const std::vector<float>* lse_in) {
  const Tensor Q = pb.q.as(dt), K = pb.k.as(dt), V = pb.v.as(dt), dO = pb.dout.as(dt);
  Tensor out(dt, pb.out_shape()), dq(dt, pb.q_shape()), dk(dt, pb.k_shape()), dv(dt, pb.v_shape());
  std::vector<float> lse(pb.lse_size());
  const AttnFwdParams fp = pb.fwd(Q, K, V, out, lse.data(), path, threads);
  if (ref) attention_forward_reference(fp, accum);
  else attention_forward(fp);
  Results r;
  r.out = out.values();
  r.lse = lse;
  const Tensor out_b = out_in ? out_in->as(dt) : out;
  const float* lse_b = lse_in ? lse_in->data() : lse.data();
  const AttnBwdParams bp = pb.bwd(Q, K, V, out_b, lse_b, dO, dq, dk, dv, path, threads);
  if (ref) attention_backward_reference(bp, accum);
  else attention_backward(bp);
  r.dq = dq.values();
  r.dk = dk.values();
  r.dv = dv.values();
  return r;
}

}  // namespace

Results run_kernels(const Problem& pb, DType dt, KernelPath path, int threads,
                    const Tensor* out_in, const std::vector<float>* lse_in) {
  return run_with(pb, dt, false, RefAccum::f64, path, threads, out_in, lse_in);
}

Results run_reference(const Problem& pb, DType dt, RefAccum accum, const Tensor* out_in,
                      const std::vector<float>* lse_in) {
  return run_with(pb, dt, true, accum, KernelPath::portable, 1, out_in, lse_in);
}

}  // namespace cpattn::check
