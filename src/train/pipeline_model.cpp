// PipelineModel (pipeline_model.hpp): a stage's share of the model's passes.
#include "pipeline_model.hpp"

#include <cpattn/error.hpp>

#include <algorithm>
#include <utility>

namespace cpattn::train {

LayerRange stage_layers(int layers, int vstages, int v) {
  const int base = layers / vstages, extra = layers % vstages;
  const int begin = v * base + std::min(v, extra);
  return {begin, begin + base + (v < extra ? 1 : 0)};
}

int64_t labeled_rows(std::span<const PackedSequence> seqs) {
  int64_t n = 0;
  for (const PackedSequence& s : seqs) n += std::ranges::count_if(s.labels, [](int64_t y) { return y != kIgnoreIndex; });
  return n;
}

PipelineModel::PipelineModel(Model& m, const PipelineSpec& spec, int stage, std::span<const PackedSequence> micro,
                             int64_t total, std::span<const uint64_t> dropout_seeds)
    : m_(m), stages_(spec.stages), chunks_(spec.virtual_stages), stage_(stage), total_(total),
      micro_(micro.size()) {
  CPATTN_CHECK(std::ssize(micro) == spec.micro, "PipelineModel: ", micro.size(), " sequences for ", spec.micro,
               " micro-batches");
  CPATTN_CHECK(stage >= 0 && stage < spec.stages, "PipelineModel: stage ", stage, " outside [0, ", spec.stages, ")");
  CPATTN_CHECK(total >= 1, "PipelineModel: the step has no labeled token");
  CPATTN_CHECK(dropout_seeds.empty() || dropout_seeds.size() == micro.size(), "PipelineModel: ",
               dropout_seeds.size(), " dropout seeds for ", micro.size(), " micro-batches");
  // The destructor's pushes never allocate (it must not throw); it pushes the micro-batches
  // in reverse, so that the back of the list is micro-batch 0's.
  m.spare_acts.reserve(m.spare_acts.size() + micro_.size());
  for (MicroState& st : micro_) {
    if (!m.spare_acts.empty()) {
      st.acts = std::move(m.spare_acts.back());
      m.spare_acts.pop_back();
    }
    st.acts.resid.resize(m.dims.L + 1);
    st.acts.blocks.resize(m.dims.L);
  }
  for (int mb = 0; mb < spec.micro; ++mb)
    with_micro(mb, [&] {
      prepare_batch(m_, micro[mb], dropout_seeds.empty() ? std::nullopt : std::optional(dropout_seeds[mb]));
    });
  std::fill(m.grads.begin(), m.grads.end(), 0.0f);
}

PipelineModel::~PipelineModel() {
  for (auto it = micro_.rbegin(); it != micro_.rend(); ++it) {
    for (BlockActs& a : it->acts.blocks) {  // the step's contexts end with it
      a.attn = CpContext();
      a.moe = {};
    }
    m_.spare_acts.push_back(std::move(it->acts));  // within the constructor's reserve
  }
}

template <class F>
void PipelineModel::with_micro(int mb, F&& f) {
  MicroState& st = micro_[static_cast<std::size_t>(mb)];
  struct Swap {
    Model& m;
    MicroState& st;
    Swap(Model& model, MicroState& state) : m(model), st(state) { swap(); }
    ~Swap() { swap(); }
    void swap() {
      std::swap(m.batch, st.batch);
      std::swap(m.acts, st.acts);
    }
  } in_model(m_, st);
  f();
}

int64_t PipelineModel::boundary_floats(int micro) const {
  return micro_[static_cast<std::size_t>(micro)].batch.T * m_.dims.D;
}

int64_t PipelineModel::local_tokens() const {
  int64_t n = 0;
  for (const MicroState& st : micro_) n += st.batch.T;
  return n;
}

void PipelineModel::forward(int chunk, int micro, std::span<const float> in, std::span<float> out) {
  with_micro(micro, [&] {
    std::vector<std::vector<float>>& resid = m_.acts.resid;
    const LayerRange r = layers(chunk);
    if (vstage(chunk) == 0)
      embed_forward(m_);
    else
      std::copy(in.begin(), in.end(), resid[r.begin].begin());
    for (int l = r.begin; l < r.end; ++l) block_forward(m_, l, resid[l].data(), resid[l + 1].data());
    if (!last(chunk)) {
      std::copy(resid[r.end].begin(), resid[r.end].end(), out.begin());
      return;
    }
    int64_t scored = 0;
    loss_sum_ += head_forward(m_, scored);
    scored_ += scored;
  });
}

void PipelineModel::backward(int chunk, int micro, std::span<const float> dout, std::span<float> din,
                             bool defer_weights) {
  with_micro(micro, [&] {
    std::vector<float>& dres = m_.scratch.dres;
    const LayerRange r = layers(chunk);
    size_backward_scratch(m_);
    if (last(chunk))
      head_backward(m_, total_);
    else
      std::copy(dout.begin(), dout.end(), dres.begin());
    for (int l = r.end - 1; l >= r.begin; --l) block_backward(m_, l, m_.acts.resid[l].data(), defer_weights);
    if (vstage(chunk) == 0)
      embed_backward(m_);
    else
      std::copy(dres.begin(), dres.end(), din.begin());
  });
}

void PipelineModel::weight(int chunk, int micro) {
  with_micro(micro, [&] {
    const LayerRange r = layers(chunk);
    for (int l = r.end - 1; l >= r.begin; --l) block_weight_backward(m_, l);
  });
}

}  // namespace cpattn::train
