// The plain configuration of cpattn::train (train.hpp): the model's and the optimizer's
// settings, the data position and the run's identity, which a checkpoint records. MPI-free,
// so that the checkpoint reader builds without MPI (tests/fuzz/fuzz_checkpoint.cpp).
#pragma once

#include <cpattn/moe.hpp>

#include <cstdint>
#include <optional>

namespace cpattn::train {

inline constexpr int kVocab = 257;              // bytes 0..255 and the end-of-document token
inline constexpr int64_t kEndOfDocument = 256;  // ends every document; also the padding token
inline constexpr const char* kDefaultDataDir = "/usr/share/common-licenses";

// Where the stream stands: the next token is token `offset` of document `doc` in epoch `epoch`.
struct DataPosition {
  int64_t doc = 0;
  int64_t offset = 0;
  int64_t epoch = 0;
  bool operator==(const DataPosition&) const = default;
};

struct ModelConfig {
  int vocab = kVocab;
  int layers = 2;
  int dim = 128;       // model width D = heads * head_dim
  int heads = 4;       // query heads
  int kv_heads = 2;    // key/value heads (GQA), divides heads
  int ffn = 0;         // SwiGLU hidden width; 0: 8/3 * dim rounded up to a multiple of 32
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  float init_std = 0.02f;
  // Attention's masks on top of causal, with AttnOptions' (FlashAttention's) semantics. They
  // change the model, so a checkpoint records them. A query at position p of its document
  // sees the keys p - window_left .. p (-1: unbounded); window_right is AttnOptions' right
  // edge, which the causal mask makes moot (any value >= -1 gives the same model).
  int64_t window_left = -1;
  int64_t window_right = -1;
  float softcap = 0.0f;  // logit soft cap: S = softcap * tanh(S / softcap); 0 = off
  bool alibi = false;    // ALiBi with the standard slopes, cpattn::alibi_slopes(heads)
  // Hidden (residual) dropout in [0, 1), training forwards only: each block's attention and
  // MLP outputs are dropped before their residual add, elementwise, with the mask of
  // attention dropout's generator keyed by the token's document and global position
  // (dropout_rows in src/train/layers.hpp), so that every CP split drops what one process
  // drops. Dense MLP only (not with experts). 0 = off.
  float dropout = 0.0f;
  // Mixture of experts (docs/moe.md, docs/training.md "Mixture of experts"): experts > 0
  // replaces every block's SwiGLU MLP by the MoE layer of include/cpattn/moe.hpp, `experts`
  // SwiGLU experts of width ffn_dim() each, top_k of them per token (moe.hpp's MoeConfig
  // fields, same meaning). Each micro-batch (sequence) is one routing group, its real tokens in
  // sequence order as on one process, also when CP splits it (capacity, drops and the
  // auxiliary loss are decided over the whole sequence; padding rows are not routed). 0: the
  // dense MLP, and the fields below are ignored.
  int experts = 0;
  int top_k = 1;  // 1 .. experts
  MoeRouter router = MoeRouter::softmax;
  std::optional<double> capacity_factor = std::nullopt;  // > 0; unset: nothing dropped
  MoeDropPolicy drop_policy = MoeDropPolicy::by_position;
  // >= 0, softmax only: the Switch loss's weight; the step's auxiliary loss is, summed over the
  // blocks, aux_loss_coeff * the mean over the step's sequences of moe_aux_term (StepStats::aux_loss).
  double aux_loss_coeff = 0;
  double bias_update_rate = 1e-3;  // > 0, sigmoid_bias only: moe_update_bias's step, once per step
  bool moe() const { return experts > 0; }
  int head_dim() const { return dim / heads; }
  int ffn_dim() const { return ffn > 0 ? ffn : (8 * dim / 3 + 31) / 32 * 32; }
};

struct OptimConfig {
  float lr = 5e-4f;             // peak learning rate
  int warmup = 10;              // steps of linear warm-up: lr * (step + 1) / warmup
  float weight_decay = 0.1f;    // AdamW, decoupled, on matrices (not norms)
  float clip = 1.0f;            // clip the global gradient norm to this (0: off)
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
};

// What a checkpoint records of the run besides the model and the optimizer (Trainer::save,
// Trainer::load): both must match on resume. 0: not recorded (library use without them).
struct RunIdentity {
  int64_t seq_len = 0;
  uint64_t data_hash = 0;  // data_identity() of the documents
  int64_t micro = 0;       // sequences per step (0: not recorded; a checkpoint without it matches any)
};

}  // namespace cpattn::train
