// AdamW, the schedule and the gradient all-reduce (optimizer.hpp).
#include "optimizer.hpp"

#include <cpattn/error.hpp>

#include <algorithm>
#include <cmath>

namespace cpattn::train {

void all_reduce_grads(Communicator& comm, std::span<float> grads) {
  const int cp = comm.size();
  if (cp == 1) return;
  if (grads.size() % static_cast<std::size_t>(cp) != 0) {
    std::vector<float> padded((grads.size() / cp + 1) * cp, 0.0f);
    std::copy(grads.begin(), grads.end(), padded.begin());
    all_reduce_grads(comm, padded);
    std::copy_n(padded.begin(), grads.size(), grads.begin());
    return;
  }
  const std::size_t chunk = grads.size() / static_cast<std::size_t>(cp);
  std::vector<float> mine(chunk);
  comm.reduce_scatter_sum(grads, mine);
  comm.all_gather<float>(mine, grads);
}

double grad_norm(std::span<const float> grads) {
  double ss = 0;
  for (const float g : grads) ss += static_cast<double>(g) * g;
  return std::sqrt(ss);
}

double lr_at(const OptimConfig& oc, int64_t step) {
  if (oc.warmup > 0 && step < oc.warmup)
    return static_cast<double>(oc.lr) * static_cast<double>(step + 1) / oc.warmup;
  return oc.lr;
}

void check_optim_config(const OptimConfig& oc) {
  CPATTN_CHECK(oc.lr > 0 && std::isfinite(oc.lr), "OptimConfig::lr must be > 0 and finite, got ", oc.lr);
  CPATTN_CHECK(oc.warmup >= 0, "OptimConfig::warmup must be >= 0, got ", oc.warmup);
  CPATTN_CHECK(oc.weight_decay >= 0, "OptimConfig::weight_decay must be >= 0, got ", oc.weight_decay);
  CPATTN_CHECK(oc.clip >= 0, "OptimConfig::clip must be >= 0 (0: no clipping), got ", oc.clip);
  // (beta 1 made the bias correction divide by 0: NaN weights)
  CPATTN_CHECK(oc.beta1 >= 0 && oc.beta1 < 1 && oc.beta2 >= 0 && oc.beta2 < 1, "OptimConfig::beta1 and beta2 must be in "
               "[0, 1), got ", oc.beta1, " and ", oc.beta2);
  CPATTN_CHECK(oc.eps > 0 && std::isfinite(oc.eps), "OptimConfig::eps must be finite and > 0, got ", oc.eps);
}

void adamw_update(const OptimConfig& oc, const std::vector<ParamTensor>& tensors, std::span<float> params,
                  std::span<const float> grads, double norm, AdamW& state) {
  const float lr = static_cast<float>(lr_at(oc, state.step));
  const float scale = oc.clip > 0 && norm > oc.clip ? static_cast<float>(oc.clip / norm) : 1.0f;
  const auto t = static_cast<double>(state.step - state.skipped + 1);
  const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(oc.beta1), t));
  const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(oc.beta2), t));
  std::vector<float>& m = state.m;
  std::vector<float>& v = state.v;
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
  ++state.step;
}

}  // namespace cpattn::train
