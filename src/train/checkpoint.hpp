// Training checkpoints (include/cpattn/train.hpp, Trainer::save/load): one file with the model
// config, the step, the data position, the weights and AdamW's moments (fp32). No MPI here:
// the Trainer decides which rank writes and makes every rank agree on errors. Internal to
// cpattn_train (not installed).
//
// Format: the magic "CPATTNTR", 13 int64 fields (version, vocab, layers, dim, heads, kv_heads,
// ffn, rope theta's bits, parameter count, step, data doc, offset, epoch), then params, m, v
// (fp32, parameter count each), native byte order.
#pragma once

#include <cpattn/train.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cpattn::train {

struct CheckpointState {
  int64_t step = 0;
  DataPosition data;
  std::vector<float> params, m, v;
};

// Writes `path` atomically: into `path`.tmp, then renamed over `path`. Throws cpattn::Error
// naming the file.
void save_checkpoint(const std::string& path, const ModelConfig& mc, int64_t step, const DataPosition& data,
                     std::span<const float> params, std::span<const float> m, std::span<const float> v);

// Reads `path`, checking that it holds a model of config `mc` with `n_params` parameters
// (cpattn::Error names the file and the first field that differs).
CheckpointState load_checkpoint(const std::string& path, const ModelConfig& mc, int64_t n_params);

}  // namespace cpattn::train
