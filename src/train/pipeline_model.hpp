// The training model's blocks split into pipeline stages (issue 12 item 6): the
// PipelineStage (include/cpattn/executor.hpp) that run_pipeline drives for one step's
// micro-batches. Internal to cpattn_train (not installed).
//
// Every rank holds the whole Model (this example's model is small); a stage runs, and takes
// gradients of, only its layers: the embedding on the first virtual stage, its blocks, the
// final norm, LM head and loss on the last. The gradients of every other layer stay zero on
// that rank, so a sum over the pipeline axis assembles the full gradient exactly.
//
// Each micro-batch keeps its own Batch and Activations (its plan, local tokens, every
// block's saved tensors and attention context) from its forward to its backward; they are
// swapped into the Model for the duration of each action, so the Model's passes
// (model.hpp) run unchanged.
#pragma once

#include "model.hpp"

#include <cpattn/executor.hpp>

#include <span>
#include <vector>

namespace cpattn::train {

// Blocks [begin, end) of virtual stage v out of n: L / n each, the first L % n one more
// (5 blocks over 2 stages: 3 and 2; over 3: 2, 2, 1; over 4 virtual stages: 2, 1, 1, 1).
// With L < n the last virtual stages hold none and only pass the activation on.
struct LayerRange {
  int begin = 0, end = 0;
};
LayerRange stage_layers(int layers, int vstages, int v);

// Rows with a label over `seqs`: what a step's loss is divided by.
int64_t labeled_rows(std::span<const PackedSequence> seqs);

class PipelineModel final : public PipelineStage {
 public:
  // Prepares every micro-batch in order (prepare_batch: collective over the model's CP group)
  // and zeroes m.grads. `stage`: this rank's pipeline stage. `total`: the labeled rows of the
  // whole step (all micro-batches, all ranks that share it): each backward takes the gradient
  // of (sum of row losses) / total, so the micro-batches' gradients add up to the step's.
  // dropout_seeds: the hidden dropout key of each micro-batch (dropout_stream), or empty for
  // none.
  PipelineModel(Model& m, const PipelineSpec& spec, int stage, std::span<const PackedSequence> micro,
                int64_t total, std::span<const uint64_t> dropout_seeds = {});
  // Hands the micro-batches' activation buffers back to the Model (Model::spare_acts).
  ~PipelineModel() override;
  PipelineModel(const PipelineModel&) = delete;
  PipelineModel& operator=(const PipelineModel&) = delete;

  int64_t boundary_floats(int micro) const override;  // [T of the micro-batch, D]
  void forward(int chunk, int micro, std::span<const float> in, std::span<float> out) override;
  void backward(int chunk, int micro, std::span<const float> dout, std::span<float> din,
                bool defer_weights) override;
  void weight(int chunk, int micro) override;

  // The last virtual stage's row losses summed over its forwards, in the order they ran, and
  // their count; 0 on other stages.
  double loss_sum() const { return loss_sum_; }
  int64_t scored() const { return scored_; }
  // This rank's rows over the micro-batches, padding included.
  int64_t local_tokens() const;

 private:
  struct MicroState {
    Batch batch;
    Activations acts;
  };
  // Runs f with micro-batch mb's state in the Model.
  template <class F>
  void with_micro(int mb, F&& f);
  int vstage(int chunk) const { return chunk * stages_ + stage_; }
  bool last(int chunk) const { return vstage(chunk) == stages_ * chunks_ - 1; }
  LayerRange layers(int chunk) const { return stage_layers(m_.dims.L, stages_ * chunks_, vstage(chunk)); }

  Model& m_;
  int stages_, chunks_, stage_;
  int64_t total_;
  std::vector<MicroState> micro_;
  double loss_sum_ = 0;
  int64_t scored_ = 0;
};

}  // namespace cpattn::train
