// The optimizer of include/cpattn/train.hpp: the gradient all-reduce over the CP group, the
// global gradient norm, the learning-rate schedule (linear warm-up, then constant) and AdamW
// with clipping by the global norm. Internal to cpattn_train (not installed).
#pragma once

#include <cpattn/comm.hpp>
#include <cpattn/train.hpp>

#include <cstdint>
#include <span>
#include <vector>

namespace cpattn::train {

// Sum of `grads` over the CP group: reduce-scatter in a fixed order, then all-gather, so that
// every rank ends with bitwise the same sum on every run. A grads.size() that is not a
// multiple of comm.size() goes through a zero-padded copy. Collective.
void all_reduce_grads(Communicator& comm, std::span<float> grads);

// sqrt(sum g^2), accumulated in double in index order.
double grad_norm(std::span<const float> grads);

// The rate of step `step` (from 0): lr * (step + 1) / warmup during the warm-up, then lr.
double lr_at(const OptimConfig& oc, int64_t step);

// Checks the configuration (OptimConfig's fields name the errors).
void check_optim_config(const OptimConfig& oc);

// AdamW's moments, one of each per parameter.
struct AdamW {
  std::vector<float> m, v;
  int64_t step = 0;     // steps taken: the learning-rate schedule's
  int64_t skipped = 0;  // of them, skipped as non-finite: step - skipped updates done
};

// One AdamW update of `params` from `grads` (scaled by clip / norm when the global norm
// exceeds oc.clip > 0), decoupled weight decay on the tensors marked `decay`; the bias
// correction counts the updates (step - skipped + 1: a skipped step left the moments as they
// were, and counting it shrank every later update, to 0.73 of a first one after one skip).
// ++state.step.
void adamw_update(const OptimConfig& oc, const std::vector<ParamTensor>& tensors, std::span<float> params,
                  std::span<const float> grads, double norm, AdamW& state);

}  // namespace cpattn::train
