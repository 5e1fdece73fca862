// The model of include/cpattn/train.hpp: parameters and activations by name, the batch this
// rank holds, and the forward and backward of a block and of the whole model (llm.c style:
// plain structs, one free function per pass, the layers of layers.hpp). Internal to
// cpattn_train (not installed).
//
// Shapes: T = this rank's local tokens (padding included), D = dim, H = heads, KV = kv_heads,
// hd = head_dim, F = ffn_dim, V = vocab, L = layers.
//
// Padding rows (the planner's end-of-document padding) run through the token-wise layers like
// any row, but they take no part in attention (CpAttention gives them zero output and zero
// gradient) and have no label, so every gradient they produce is exactly zero: the result is
// that of the unpadded batch.
#pragma once

#include <cpattn/cp.hpp>
#include <cpattn/moe_ep.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/train.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace cpattn::train {

// The sizes of the model, checked (ModelConfig's fields name the errors).
struct Dims {
  int D = 0, H = 0, KV = 0, hd = 0, F = 0, V = 0, L = 0;
  float eps = 0;
};
Dims model_dims(const ModelConfig& mc);

// One block's parameter tensors, as pointers into a flat vector (the weights or their
// gradients, same layout). With experts (E = ModelConfig::experts), w1, w3 and w2 hold every
// expert's matrices one after the other (MoeWeights' w_gate, w_up, w_down layout).
template <class Float>
struct BlockTensors {
  Float* ln1;  // [D]
  Float* wq;   // [D, H*hd]
  Float* wk;   // [D, KV*hd]
  Float* wv;   // [D, KV*hd]
  Float* wo;   // [H*hd, D]
  Float* ln2;  // [D]
  Float* w1;   // [D, F] gate; experts: [E, D, F]
  Float* w3;   // [D, F] up; experts: [E, D, F]
  Float* w2;   // [F, D]; experts: [E, F, D]
  Float* router;  // experts: [D, E]; dense: nullptr
  Float* bias;    // sigmoid_bias router: [E], moved by moe_update_bias, never by a gradient; else nullptr
};

// Where every tensor lies in the flat parameter vector, in the order of `tensors`:
// wte, then per block ln1 wq wk wv wo ln2 w1 w3 w2, then lnf, lm_head. With experts: wte, per
// block ln1 wq wk wv wo ln2 moe.router [moe.bias], lnf, lm_head, and then the experts region
// [experts_begin, count): per block moe.w1 moe.w3 moe.w2, each [local_experts, ...], the
// experts [first_expert, first_expert + local_experts) that this rank holds under EP. A layout
// made with `align` > 1 has zero floats in no tensor between the replicated tensors and the
// experts region and after it, so that experts_begin and count - experts_begin are multiples
// of `align`: the two regions are summed over groups whose sizes divide it in place.
struct ParamLayout {
  struct Block {
    int64_t ln1, wq, wk, wv, wo, ln2, w1, w3, w2;
    int64_t router = -1, bias = -1;  // -1: none
  };
  std::vector<ParamTensor> tensors;
  int64_t count = 0;  // floats
  int64_t wte = 0;    // [V, D]
  std::vector<Block> blocks;
  int64_t lnf = 0;      // [D]
  int64_t lm_head = 0;  // [D, V]
  int64_t replicated = 0;     // floats of the replicated tensors: [0, replicated)
  int64_t experts_begin = 0;  // = count without experts; >= replicated
  int first_expert = 0, local_experts = 0;

  template <class Float>
  BlockTensors<Float> block(Float* base, int l) const {
    const Block& b = blocks[l];
    return {base + b.ln1, base + b.wq, base + b.wk, base + b.wv, base + b.wo,
            base + b.ln2, base + b.w1, base + b.w3, base + b.w2,
            b.router >= 0 ? base + b.router : nullptr, b.bias >= 0 ? base + b.bias : nullptr};
  }
};
// local_experts 0: all of them (the layout of a checkpoint file, align 1). align >= 1: see
// ParamLayout (applies to a model with experts only).
ParamLayout param_layout(const Dims& d, const ModelConfig& mc, int first_expert = 0, int local_experts = 0,
                         int64_t align = 1);

// Between the whole model (`global`, every expert: a checkpoint's layout) and one rank's
// (`local`, the same model, its experts only): the replicated tensors are copied as they are,
// `mine` = all's experts of local; `all` = mine's replicated tensors and the experts region
// of every rank of the EP group, `gathered` = [ep, local's experts region] rank-major.
void take_local_experts(const ParamLayout& global, const ParamLayout& local, std::span<const float> all,
                        std::span<float> mine);
void put_gathered_experts(const ParamLayout& global, const ParamLayout& local, std::span<const float> mine,
                          std::span<const float> gathered, std::span<float> all);

// The MoE layer's configuration of a model with experts (ModelConfig's fields, checked:
// they name the errors), hidden = dim, ffn = ffn_dim().
MoeConfig moe_config(const ModelConfig& mc);

// Deterministic initial weights (the same on every platform and rank): norms 1 (the router's
// selection bias 0), matrices normal(0, init_std), the residual projections wo and w2
// normal(0, init_std / sqrt(2 L)). For the whole layout (all experts): Model takes its part.
void init_params(const ParamLayout& layout, const ModelConfig& mc, uint64_t seed, std::span<float> params);

// This rank's part of one packed sequence: the plan (made once per batch, shared by every
// layer's attention), the local token arrays in the plan's order, and RoPE's tables.
struct Batch {
  std::shared_ptr<const RankPlan> plan;
  TokenBatch local;  // [T] tokens, labels, positions, loss mask
  int64_t T = 0;
  std::vector<float> rope_cos, rope_sin;  // [T, hd/2]
  std::vector<int64_t> real_rows;         // the local rows that are not padding, in order: what MoE routes
  std::vector<int64_t> real_positions;    // [real_rows] their places in the sequence (the MoE group's order)
  // Hidden dropout (ModelConfig::dropout): each row's document in the packed sequence (-1:
  // padding) and the key of this batch's masks; unset for a forward without dropout (eval).
  std::vector<int64_t> row_doc;  // [T]
  std::optional<uint64_t> dropout_seed;
};

// The gradients at the outputs of a block's weight products, which its weight gradients read
// (dW = input^T . gradient). The backward computes them on its way to the block's input
// gradient; a backward that defers the weight gradients (zero-bubble pipelines) keeps them
// until block_weight_backward.
struct BlockOutGrads {
  std::vector<float> dy;          // [T, D] gradient of h @ w2 (the block's output, dropout applied)
  std::vector<float> da, db;      // [T, F] gate and up (w1, w3)
  std::vector<float> dx_mid;      // [T, D] gradient of att @ wo (the residual after attention, dropout applied)
  std::vector<float> dq, dk, dv;  // [T, H*hd], [T, KV*hd], [T, KV*hd] before RoPE (wq, wk, wv)
};

// What one block's forward keeps for its backward. Sizes in elements.
struct BlockActs {
  std::vector<float> xn1, rstd1;  // [T, D], [T]
  std::vector<float> q, k, v;     // [T, H*hd] (after RoPE), [T, KV*hd] (after RoPE), [T, KV*hd]
  std::vector<float> att;         // [T, H*hd] attention output
  std::vector<float> x_mid;       // [T, D] residual after attention
  std::vector<float> xn2, rstd2;  // [T, D], [T]
  std::vector<float> a, b, h;     // [T, F] gate, up, silu(gate) * up (dense MLP)
  std::vector<float> moe_x;       // experts: [R, D] xn2's real rows (Batch::real_rows)
  MoeEpForward moe;               // experts: the MoE forward's state, for its backward
  // bf16 attention: the forward's q and out in bf16, which the attention backward reads again.
  std::vector<uint16_t> q16, o16;  // [T, H*hd]
  CpContext attn;                  // the attention forward's context (gathered K/V, lse)
  BlockOutGrads deferred;          // a backward's gradients kept for block_weight_backward
};

struct Activations {
  std::vector<std::vector<float>> resid;  // [L+1][T, D]: input of block l; resid[L] the last output
  std::vector<BlockActs> blocks;          // [L]
  std::vector<float> xf, rstdf;           // [T, D], [T] final norm
  std::vector<float> logits;              // [T, V]; after forward, probabilities of labeled rows
};

// Backward's buffers, shared by the blocks.
struct Scratch {
  std::vector<float> dres;               // [T, D] gradient of the residual stream
  std::vector<float> dxn;                // [T, D] gradient of a norm's output
  std::vector<float> dh;                 // [T, F]
  std::vector<float> datt;               // [T, H*hd]
  BlockOutGrads out;                     // a backward's gradients used at once
  std::vector<uint16_t> k16, v16;        // bf16 attention: forward's k, v
  std::vector<uint16_t> dout16, dq16, dk16, dv16;  // bf16 attention: backward's tensors
};

struct Model {
  // comm: the CP group. reduce_ranks: the ranks whose all-reduces grads goes through (the
  // chunks of all_reduce_grads); 0: comm.size(). ep: the EP group of a model with experts
  // (borrowed; nullptr: comm).
  Model(Communicator& comm, const ModelConfig& mc, const RunOptions& run, uint64_t seed, int reduce_ranks = 0,
        Communicator* ep = nullptr);

  ModelConfig config;
  RunOptions run;
  Dims dims;
  ParamLayout layout;
  std::vector<float> params;  // [layout.count]
  int cp = 1;                 // ranks of the CP group
  Communicator* cp_comm;      // the CP group (borrowed): a sequence's MoE routing group
  // [layout.count padded to a multiple of reduce_ranks] (the all-reduce's chunks); with experts
  // the layout is aligned to reduce_ranks, so that its two regions need no padded copy either.
  std::vector<float> grads;
  CpAttention attn;           // one for every block: the contexts in acts hold each block's state
  Batch batch;
  Activations acts;
  // The activations of a finished step's micro-batches, which the next step's PipelineModel
  // takes back, micro-batch i the last step's i: where the sizes repeat, a step's activation
  // tensors are neither allocated nor zero-filled nor page-faulted again. The price: they stay
  // allocated between steps (and beside `acts` during an evaluation forward). Buffers that a
  // step frees itself (MoE's moe_x, a deferred weight backward's gradients, Batch) are not
  // kept.
  std::vector<Activations> spare_acts;
  Scratch scratch;
  // Experts: the EP group, the layer (made by moe_begin_step), every block's router and
  // this rank's experts copied from params, and what the forwards observed since then.
  Communicator* ep_comm = nullptr;
  std::unique_ptr<MoeEpLayer> moe;
  std::vector<MoeWeights> moe_weights;           // [L]
  double moe_aux = 0;                            // sum of the forwards' MoeEpForward::aux_loss
  int64_t moe_dropped = 0;                       // assignments this rank's groups dropped
  std::vector<std::vector<int64_t>> moe_load;    // [L][E] assignments this rank's groups routed
};

// Before the forwards of a step (or of loss()) with experts; collective over the EP and CP
// groups. A routing group is one sequence: the real tokens of its CP group's ranks, in sequence
// order (Batch::real_positions), as on one process. `step_groups`: the (sequence, CP rank)
// pairs of one block in the whole step over the mesh (micro-batches * cp). Makes the layer with
// aux_loss_coeff * ep / step_groups, so that the EP forwards' aux_loss, each counted once (it
// is the same on the ep ranks of a call), add up to aux_loss_coeff * the mean over the step's
// sequences per block (each sequence's term is held by its cp ranks), and the backward's
// objective is that; copies the router and this rank's experts from params; zeroes moe_aux,
// moe_dropped and moe_load. No-op without experts.
void moe_begin_step(Model& m, int64_t step_groups);

// The positions RoPE rotates this rank's rows by: each token's global position in its document
// segment (the planner's `position_ids`, padding continuing its document's), or, with
// `local_offsets` (RunOptions::rope_local_offsets, the wrong choice the tests show), its offset
// in this rank's local part of the document. [plan.local_tokens].
std::vector<int64_t> rope_positions(const RankPlan& plan, std::span<const int64_t> position_ids, bool local_offsets);

// Plans `seq` for this rank (once: every block's attention gets that plan), takes the local
// arrays and RoPE tables, sizes the activations. Checks the sequence (PackedSequence's fields
// and min_seq_len name the errors).
// dropout_seed: the key of the hidden dropout masks of a training forward (dropout_stream);
// unset (eval) or ModelConfig::dropout = 0: no dropout.
void prepare_batch(Model& m, const PackedSequence& seq, std::optional<uint64_t> dropout_seed = std::nullopt);

// The hidden dropout key of micro-batch `micro` (counted over the whole step, every replica's)
// of optimizer step `step` of a run seeded `seed`: the same on every rank, whatever cp, so a CP
// run drops what one process drops.
uint64_t dropout_stream(uint64_t seed, int64_t step, int64_t micro);

// x [T, D] -> y [T, D]:  x_mid = x + drop(Wo . Attn(RoPE(Wq . rms(x)), RoPE(Wk . rms(x)), Wv . rms(x)))
//                        y = x_mid + drop(W2 . (silu(W1 . rms(x_mid)) * (W3 . rms(x_mid))))
// (drop: hidden dropout, only when the batch has a dropout_seed)
void block_forward(Model& m, int l, const float* x, float* y);
// The block's backward: m.scratch.dres holds dy [T, D] on entry and dx on return; adds the
// block's weight gradients into m.grads, or with `defer_weights` only its norms' and keeps
// what the others need for block_weight_backward. x: the block's input. Consumes its
// attention context. Needs size_backward_scratch(m) after the batch's prepare_batch.
void block_backward(Model& m, int l, const float* x, bool defer_weights = false);
// Adds block l's matrix weight gradients from its deferred backward into m.grads. Each
// gradient gets the same products in the same order as in an undeferred backward.
void block_weight_backward(Model& m, int l);
void size_backward_scratch(Model& m);

// The pieces of model_forward and model_backward, for callers that run the blocks
// themselves (a pipeline stage):
// resid[0] = embedding of the local tokens.
void embed_forward(Model& m);
// Final norm, LM head and cross-entropy of resid[L]: the loss sum of the labeled rows.
double head_forward(Model& m, int64_t& scored);
// scratch.dres = d(sum of row losses / total) / d(resid[L]), head gradients into m.grads.
void head_backward(Model& m, int64_t total);
// The embedding's gradient from scratch.dres (the gradient of resid[0]).
void embed_backward(Model& m);

// Embedding, blocks, final norm, LM head, cross-entropy of this rank's labeled rows: returns
// their loss sum (nats) and counts them in `scored`.
double model_forward(Model& m, int64_t& scored);
// Gradients of (sum of this rank's row losses) / total into m.grads (overwritten); total: the
// labeled rows of all ranks. Consumes the forward's attention contexts.
void model_backward(Model& m, int64_t total);

}  // namespace cpattn::train
