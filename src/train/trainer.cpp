// Trainer (include/cpattn/train.hpp): the model (model.hpp), the optimizer (optimizer.hpp) and
// checkpoints (checkpoint.hpp) composed into training steps, and the error agreement that
// makes every rank fail together.
#include <cpattn/error.hpp>
#include <cpattn/train.hpp>

#include "checkpoint.hpp"
#include "model.hpp"
#include "optimizer.hpp"
#include "pipeline_model.hpp"

#include <cpattn/executor.hpp>
#include <cpattn/mesh.hpp>

#include <algorithm>
#include <string_view>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>

namespace cpattn::train {

namespace {
std::string number(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", x);
  return b;
}

const OptimConfig& checked(const OptimConfig& oc) {
  check_optim_config(oc);
  return oc;
}

// The mesh's communicators for this rank, split from the world (include/cpattn/mesh.hpp's
// layout). Checked on every rank alike: the sizes are the same everywhere.
// ep: the EP group, ep consecutive ranks of dp_cp (MeshConfig::ep); edp: the ranks of dp_cp
// that hold the same experts (the same rank in every EP group), which sum their gradients.
struct MeshComms {
  MeshConfig config;
  int dp_rank = 0, pp_rank = 0;
  Communicator cp, pp, dp_cp, ep, edp;
};

MeshComms split_mesh(Communicator& world, const MeshConfig& mc, int experts) {
  CPATTN_CHECK(mc.dp >= 1 && mc.pp >= 1, "MeshConfig: dp and pp must be >= 1, got dp = ", mc.dp, ", pp = ", mc.pp);
  CPATTN_CHECK(world.size() % (mc.dp * mc.pp) == 0, "MeshConfig: dp * pp = ", mc.dp, "*", mc.pp, " = ", mc.dp * mc.pp,
               " does not divide the world's ", world.size(), " ranks");
  const int stage_ranks = world.size() / mc.pp;  // dp * cp
  CPATTN_CHECK(mc.ep >= 1, "MeshConfig: ep must be >= 1, got ", mc.ep);
  CPATTN_CHECK(mc.ep == 1 || experts > 0, "MeshConfig: ep = ", mc.ep,
               " needs a model with experts (ModelConfig::experts > 0)");
  CPATTN_CHECK(stage_ranks % mc.ep == 0, "MeshConfig: ep = ", mc.ep, " must divide the dp * cp = ", stage_ranks,
               " ranks of a pipeline stage");
  CPATTN_CHECK(experts == 0 || experts % mc.ep == 0, "MeshConfig: ep = ", mc.ep,
               " must divide ModelConfig::experts = ", experts);
  const Mesh mesh = make_mesh({.world = world.size(), .cp = world.size() / (mc.dp * mc.pp), .dp = mc.dp, .pp = mc.pp});
  const auto split = [&](MeshAxis axis) {
    const SplitColorKey ck = split_color_key(mesh, world.rank(), axis);
    return world.split(ck.color, ck.key);
  };
  Communicator cp = split(MeshAxis::cp), pp = split(MeshAxis::pp), dp_cp = split(MeshAxis::dp_cp);
  Communicator ep = dp_cp.split(dp_cp.rank() / mc.ep, dp_cp.rank());
  Communicator edp = dp_cp.split(dp_cp.rank() % mc.ep, dp_cp.rank());
  return {mc, mesh.coord(world.rank(), MeshAxis::dp), mesh.coord(world.rank(), MeshAxis::pp), std::move(cp),
          std::move(pp), std::move(dp_cp), std::move(ep), std::move(edp)};
}

}  // namespace

struct Trainer::Impl {
  Communicator& comm;
  OptimConfig oc;
  MeshComms mesh;
  Model model;
  ParamLayout whole;  // the model with every expert: a checkpoint's layout (model.layout without experts)
  AdamW adam;
  double norm = 0;  // global gradient norm of the last backward
  double aux = 0;   // MoE auxiliary loss of the last backward (StepStats::aux_loss)
  int64_t dropped = 0;  // MoE assignments dropped in the last backward, all ranks
  std::vector<int64_t> load;  // sigmoid_bias router: [L, E] the last backward's assignments, all ranks
  uint64_t seed = 0;

  Impl(Communicator& c, const ModelConfig& mc, const OptimConfig& optim, const RunOptions& ro, uint64_t sd,
       const MeshConfig& mesh_config)
      : comm(c), oc(checked(optim)), mesh(split_mesh(c, mesh_config, mc.experts)),
        model(mesh.cp, mc, ro, sd, c.size(), &mesh.ep), whole(param_layout(model.dims, model.config)), seed(sd) {
    adam.m.assign(model.layout.count, 0.0f);
    adam.v.assign(model.layout.count, 0.0f);
  }

  std::span<const float> grads() const {
    return std::span<const float>(model.grads).first(static_cast<std::size_t>(model.layout.count));
  }

  // The mean loss of `seq` through the whole model on this rank's CP group (collective
  // over it; forward only, no pipeline).
  // With experts, the EP groups span the DP replicas, which all run `seq`: collective over
  // the world then, and the auxiliary loss is added (the mean over the dp * cp groups of
  // each block).
  double forward(const PackedSequence& seq, int64_t& total) {
    prepare_batch(model, seq);
    moe_begin_step(model, static_cast<int64_t>(mesh.config.dp) * mesh.cp.size());
    int64_t scored = 0;
    std::array<double, 2> s{model_forward(model, scored), 0.0};
    s[1] = static_cast<double>(scored);
    mesh.cp.all_reduce<double>(s, ReduceOp::sum);
    total = static_cast<int64_t>(s[1]);
    CPATTN_CHECK(total > 0, "the packed sequence has no token with a label");
    // Every stage ran every block here (no pipeline): each block's aux loss pp times.
    return s[0] / s[1] + (model.config.moe() ? reduced_aux() / mesh.config.pp : 0.0);
  }

  // The forwards' auxiliary loss over the world: each EP call's value counted once.
  double reduced_aux() {
    std::array<double, 1> a{model.moe_aux / mesh.ep.size()};
    comm.all_reduce<double>(a, ReduceOp::sum);
    return a[0];
  }

  // The step's micro-batches through this replica's pipeline: the global mean loss, the
  // gradient summed over the mesh into model.grads (collective over the world).
  double loss_and_grad(std::span<const PackedSequence> micro, int64_t& total, int64_t& local_tokens) {
    const MeshConfig& mc = mesh.config;
    const auto M = static_cast<int>(micro.size());
    CPATTN_CHECK(M >= 1 && M % mc.dp == 0, "a step's micro-batches must be a positive multiple of dp = ", mc.dp,
                 " (each data-parallel replica takes as many), got ", M);
    CPATTN_CHECK(mc.schedule != PipelineSchedule::fill_drain,
                 "the fill-drain schedule runs forwards only: training needs a schedule with backwards");
    total = labeled_rows(micro);
    CPATTN_CHECK(total > 0, "the packed sequence has no token with a label");
    const PipelineSpec spec{.stages = mc.pp, .micro = M / mc.dp, .schedule = mc.schedule,
                            .virtual_stages = mc.virtual_stages};
    const Schedule schedule = make_schedule(spec);
    moe_begin_step(model, static_cast<int64_t>(M) * mesh.cp.size());
    std::vector<uint64_t> drop;  // each micro-batch's hidden dropout key, by its index in the step
    for (int mb = 0; mb < spec.micro; ++mb) drop.push_back(dropout_stream(seed, adam.step, mesh.dp_rank * spec.micro + mb));
    PipelineModel stage(model, spec, mesh.pp_rank, micro.subspan(mesh.dp_rank * spec.micro, spec.micro), total, drop);
    (void)run_pipeline(mesh.pp, schedule, stage);
    local_tokens = stage.local_tokens();
    // Only the last stage has losses: the others add zeros.
    std::array<double, 1> loss_sum{stage.loss_sum()};
    if (model.run.testing_nan_at_step == adam.step && comm.rank() == 0)
      loss_sum[0] = std::numeric_limits<double>::quiet_NaN();
    comm.all_reduce<double>(loss_sum, ReduceOp::sum);
    aux = model.config.moe() ? reduced_aux() : 0.0;
    if (model.config.moe()) {
      std::array<int64_t, 1> d{model.moe_dropped};
      comm.all_reduce<int64_t>(d, ReduceOp::sum);
      dropped = d[0];
    }
    load.clear();
    if (model.config.moe() && model.config.router == MoeRouter::sigmoid_bias) {
      for (const std::vector<int64_t>& l : model.moe_load) load.insert(load.end(), l.begin(), l.end());
      comm.all_reduce<int64_t>(load, ReduceOp::sum);
    }
    if (!model.config.moe()) {
      all_reduce_grads(mesh.dp_cp, model.grads);
      all_reduce_grads(mesh.pp, model.grads);  // stages' disjoint layers: exact
      norm = grad_norm(grads());
      return loss_sum[0] / static_cast<double>(total);
    }
    // The replicated tensors over DP x CP, each rank's experts over the ranks holding them; the
    // layout is aligned to the world size, so both regions divide into the groups' chunks.
    const std::span<float> g = std::span(model.grads).first(static_cast<std::size_t>(model.layout.count));
    const auto eb = static_cast<std::size_t>(model.layout.experts_begin);
    CPATTN_DASSERT(eb % static_cast<std::size_t>(mesh.dp_cp.size()) == 0 &&
                   (g.size() - eb) % static_cast<std::size_t>(mesh.edp.size()) == 0);
    all_reduce_grads(mesh.dp_cp, g.first(eb));
    all_reduce_grads(mesh.edp, g.subspan(eb));
    all_reduce_grads(mesh.pp, model.grads);  // stages' disjoint layers (the same experts): exact
    // The norm over every expert once: the EP group's shards' squares, summed in rank order.
    const double replicated = grad_norm(g.first(eb)), mine = grad_norm(g.subspan(eb));
    std::vector<double> shards(static_cast<std::size_t>(mesh.ep.size()));
    mesh.ep.all_gather<double>(std::span(&mine, 1), shards);
    double ss = replicated * replicated;
    for (const double e : shards) ss += e * e;
    norm = std::sqrt(ss);
    return loss_sum[0] / static_cast<double>(total);
  }

  // The parameters and both moments in the whole layout, on the writing rank (world rank 0;
  // empty elsewhere): the other ranks of its EP group send it their experts, every other EP
  // group only takes part in one all-reduce that finds the writer's. Collective over the EP
  // groups. A model without experts is whole already: nothing to gather (empty everywhere).
  struct Whole {
    std::vector<float> p, m, v;
  };
  Whole gather_to_writer() {
    const bool writer = comm.rank() == 0;
    Whole w;
    if (!model.config.moe()) return w;
    std::array<int64_t, 1> at{writer ? mesh.ep.rank() + 1 : 0};  // the writer's EP rank + 1, or 0
    mesh.ep.all_reduce<int64_t>(at, ReduceOp::max);
    if (at[0] == 0) return w;  // the writer's experts are in another, identical EP group
    const int root = static_cast<int>(at[0] - 1), ep = mesh.ep.size();
    const auto eb = static_cast<std::size_t>(model.layout.experts_begin);
    const std::size_t region = static_cast<std::size_t>(model.layout.count) - eb;
    const std::span<const float> mine[3] = {model.params, adam.m, adam.v};
    if (!writer) {
      CommRequest sent[3];
      for (int i = 0; i < 3; ++i) sent[i] = mesh.ep.start_send<float>(mine[i].subspan(eb), root);
      for (CommRequest& r : sent) mesh.ep.wait(r);
      return w;
    }
    std::vector<float>* out[3] = {&w.p, &w.m, &w.v};
    std::vector<std::vector<float>> gathered(3, std::vector<float>(region * static_cast<std::size_t>(ep)));
    std::vector<CommRequest> received;
    for (int q = 0; q < ep; ++q)  // each source's three messages arrive in the order they were sent
      for (int i = 0; i < 3; ++i) {
        const std::span<float> to = std::span(gathered[static_cast<std::size_t>(i)]).subspan(static_cast<std::size_t>(q) * region, region);
        if (q == root)
          std::copy_n(mine[i].begin() + static_cast<std::ptrdiff_t>(eb), region, to.begin());
        else
          received.push_back(mesh.ep.start_recv<float>(to, q));
      }
    for (CommRequest& r : received) mesh.ep.wait(r);
    for (int i = 0; i < 3; ++i) {
      out[i]->resize(static_cast<std::size_t>(whole.count));
      put_gathered_experts(whole, model.layout, mine[i], gathered[static_cast<std::size_t>(i)], *out[i]);
    }
    return w;
  }
  // This rank's part of a whole-layout vector.
  std::vector<float> take_mine(const std::vector<float>& all) const {
    if (!model.config.moe()) return all;
    std::vector<float> mine(static_cast<std::size_t>(model.layout.count));
    take_local_experts(whole, model.layout, all, mine);
    return mine;
  }
};

Trainer::Trainer(Communicator& comm, const ModelConfig& model, const OptimConfig& optim,
                 const RunOptions& options, uint64_t seed, const MeshConfig& mesh)
    : impl_(std::make_unique<Impl>(comm, model, optim, options, seed, mesh)) {}

Trainer::~Trainer() = default;

StepStats Trainer::step(const PackedSequence& seq) { return step(std::span(&seq, 1)); }

StepStats Trainer::step(std::span<const PackedSequence> micro) {
  Impl& s = *impl_;
  StepStats st;
  st.step = s.adam.step;
  st.lr = lr_at(s.oc, s.adam.step);
  st.loss = s.loss_and_grad(micro, st.tokens, st.local_tokens);
  st.grad_norm = s.norm;
  st.aux_loss = s.aux;
  st.dropped = s.dropped;
  if (!std::isfinite(st.loss + st.aux_loss) || !std::isfinite(st.grad_norm)) {  // the same values on every rank
    if (!s.model.run.skip_nonfinite)
      throw Error("step " + std::to_string(st.step) + ": loss is " + number(st.loss) + ", gradient norm " +
                  number(st.grad_norm) + ": training stopped before this step's update (skip such steps with "
                  "RunOptions::skip_nonfinite, --skip-nonfinite in cpattn train)");
    st.skipped = true;
    ++s.adam.skipped;
    ++s.adam.step;  // the step is spent (its data consumed, the schedule moves on), the weights unchanged
    return st;
  }
  adamw_update(s.oc, s.model.layout.tensors, s.model.params, s.grads(), s.norm, s.adam);
  if (!s.load.empty()) {  // the sigmoid_bias router's balancing, from the whole step's load
    const MoeConfig mc = moe_config(s.model.config);
    const auto E = static_cast<std::size_t>(mc.num_experts);
    for (int l = 0; l < s.model.dims.L; ++l)
      moe_update_bias(mc, std::span(s.model.params.data() + s.model.layout.blocks[l].bias, E),
                      std::span(s.load).subspan(static_cast<std::size_t>(l) * E, E));
  }
  return st;
}

double Trainer::loss_and_grad(const PackedSequence& seq) {
  int64_t total = 0, local = 0;
  const double loss = impl_->loss_and_grad(std::span(&seq, 1), total, local);
  return loss + impl_->aux;
}

double Trainer::loss(const PackedSequence& seq) {
  int64_t total = 0;
  const double loss = impl_->forward(seq, total);
  for (BlockActs& a : impl_->model.acts.blocks) {  // no backward follows
    a.attn = CpContext();
    a.moe = {};
  }
  return loss;
}

std::span<float> Trainer::params() { return impl_->model.params; }
std::span<const float> Trainer::grads() const { return impl_->grads(); }
const std::vector<ParamTensor>& Trainer::tensors() const { return impl_->model.layout.tensors; }
const ModelConfig& Trainer::model() const { return impl_->model.config; }
int64_t Trainer::steps_done() const { return impl_->adam.step; }
double Trainer::global_grad_norm() const { return impl_->norm; }
int64_t Trainer::skipped_steps() const { return impl_->adam.skipped; }

namespace {
// FNV-1a over every document in order: its sizes, its name when `names`, its bytes. (Without
// names the name's size is hashed as 0, so the two hashes share one layout.)
uint64_t hash_documents(std::span<const Document> docs, bool names) {
  uint64_t h = fnv1a64({});
  for (const Document& d : docs) {
    const std::string_view name = names ? std::string_view(d.name) : std::string_view();
    const int64_t sizes[2] = {static_cast<int64_t>(name.size()), static_cast<int64_t>(d.bytes.size())};
    h = fnv1a64(std::as_bytes(std::span(sizes)), h);
    h = fnv1a64(std::as_bytes(std::span(name.data(), name.size())), h);
    h = fnv1a64(std::as_bytes(std::span(d.bytes)), h);
  }
  return h;
}
}  // namespace

uint64_t data_identity(std::span<const Document> docs) { return hash_documents(docs, true); }
uint64_t data_content_hash(std::span<const Document> docs) { return hash_documents(docs, false); }

namespace {
// n_params: the whole model's (every expert), whatever this rank holds.
CheckpointConfig checkpoint_config(const Model& m, int64_t n_params, const OptimConfig& oc, uint64_t seed,
                                   const RunIdentity& id) {
  return {.model = m.config, .n_params = n_params, .optim = oc, .seed = seed, .attn_dtype = m.run.attn_dtype,
          .id = id};
}
}  // namespace

void Trainer::save(const std::string& path, const DataPosition& data, const RunIdentity& id) const {
  Impl& s = *impl_;
  // Rank 0's EP group holds every expert (the EP groups of a stage hold the same ones, and
  // every stage holds the whole model): gathered on rank 0 alone, which writes.
  const Impl::Whole w = s.gather_to_writer();
  const bool moe = s.model.config.moe();
  on_every_rank(s.comm, [&] {
    if (s.comm.rank() == 0)
      save_checkpoint(path, checkpoint_config(s.model, s.whole.count, s.oc, s.seed, id), s.adam.step, s.adam.skipped, data,
                      moe ? w.p : s.model.params, moe ? w.m : s.adam.m, moe ? w.v : s.adam.v);
  });
}

DataPosition Trainer::load(const std::string& path, const RunIdentity& id) {
  Impl& s = *impl_;
  DataPosition d;
  uint64_t checksum = 0;
  on_every_rank(s.comm, [&] {
    CheckpointState c = load_checkpoint(path, checkpoint_config(s.model, s.whole.count, s.oc, s.seed, id));
    s.model.params = s.take_mine(c.params);
    s.adam.m = s.take_mine(c.m);
    s.adam.v = s.take_mine(c.v);
    s.adam.step = c.step;
    s.adam.skipped = c.skipped;
    d = c.data;
    checksum = c.checksum;
  });
  // Each rank reads the file itself (a folder of each node's own, say): all must have read the
  // same one, or they would train on different weights and part at the next collective.
  Fingerprint fp;
  fp.add("step", s.adam.step).add("checksum", static_cast<int64_t>(checksum));
  agree(s.comm, fp, "the checkpoint '" + path + "' each rank read");
  return d;
}

}  // namespace cpattn::train
