// The two runs the checkpoint seeds are written for (make_checkpoint_seeds.py's DENSE and MOE),
// read against by fuzz_checkpoint and train_checkpoint_test: a dense model and one with experts.
#pragma once

#include <cpattn/train_config.hpp>

#include "checkpoint.hpp"

namespace cpattn::train::seed_configs {

inline const CheckpointConfig kDense{.model = {.layers = 1, .dim = 8, .heads = 2, .kv_heads = 1},
                                     .n_params = 3,
                                     .optim = {},
                                     .seed = 1,
                                     .attn_dtype = DType::f32,
                                     .id = {.seq_len = 64, .data_hash = 0x1234abcdULL, .micro = 2}};
inline const CheckpointConfig kMoe{.model = {.layers = 1, .dim = 8, .heads = 2, .kv_heads = 1, .experts = 4,
                                             .top_k = 2, .capacity_factor = 1.25,
                                             .drop_policy = MoeDropPolicy::by_probability, .aux_loss_coeff = 0.01},
                                   .n_params = 3,
                                   .optim = {},
                                   .seed = 1,
                                   .attn_dtype = DType::f32,
                                   .id = {.seq_len = 64, .data_hash = 0x1234abcdULL, .micro = 2}};

}  // namespace cpattn::train::seed_configs
