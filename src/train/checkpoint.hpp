// Training checkpoints (include/cpattn/train.hpp, Trainer::save/load): one file with the full
// configuration, the step, the data position, the weights and AdamW's moments (fp32). No MPI
// here: the Trainer decides which rank writes and makes every rank agree on errors. Internal
// to cpattn_train (not installed).
//
// Format (version 6), native byte order:
//   "CPATTNTR"                     8 bytes, the magic
//   version = 6, field count F     int64 each
//   F int64 fields                 kFields order (checkpoint.cpp): the configuration, which
//                                  must match on resume (model with its attention masks
//                                  and its mixture of experts: experts, top_k, router,
//                                  capacity_factor, drop_policy, aux_loss_coeff,
//                                  bias_update_rate; 0 without experts; dropout), optimizer, seed, attention dtype, seq_len, data hash,
//                                  micro (0: not recorded, not compared); floats as their
//                                  bits), then the state (step, data doc, offset, epoch,
//                                  skipped steps: AdamW's bias correction counts the updates)
//   checksum                       uint64 FNV-1a 64 over the version, count, fields and payload
//   payload                        params, m, v (fp32, the parameter count each)
// The file is exactly this long: a shorter one is truncated, a longer one has trailing bytes;
// both are refused, as are version 1 (no checksum, no configuration) and version 2 (no
// attention masks). Version 5 (no micro, no skipped steps) is read with micro unchecked and no
// step skipped (a version 5 run that did skip steps resumes with its bias correction counting
// them, as it did), version 4 (no dropout either) as a model without dropout, version 3 (no
// mixture-of-experts fields either) as one without experts and dropout. Every expert of
// every block is in the payload (sent to rank 0 by its EP group before it writes; each rank
// holds only its E/ep experts in training), so a file saved at one ep
// resumes at any ep.
#pragma once

#include <cpattn/dtype.hpp>
#include <cpattn/train_config.hpp>

#include <cstddef>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cpattn::train {

// What must match between a checkpoint and the run that resumes it.
struct CheckpointConfig {
  ModelConfig model;
  int64_t n_params = 0;
  OptimConfig optim;
  uint64_t seed = 0;
  DType attn_dtype = DType::f32;
  RunIdentity id;
};

struct CheckpointState {
  int64_t step = 0;
  int64_t skipped = 0;  // of the steps, those skipped as non-finite (no AdamW update)
  int64_t micro = 0;    // the file's RunIdentity::micro (0: not recorded)
  DataPosition data;
  std::vector<float> params, m, v;
  uint64_t checksum = 0;  // the file's own (header and data): ranks compare what they read by it
};

uint64_t fnv1a64(std::span<const std::byte> bytes, uint64_t h = 14695981039346656037ull);

// The file's bytes (the format above). Throws cpattn::Error when m or v differ in size from params.
std::vector<std::byte> format_checkpoint(const CheckpointConfig& cfg, int64_t step, int64_t skipped,
                                         const DataPosition& data, std::span<const float> params,
                                         std::span<const float> m, std::span<const float> v);
// Writes format_checkpoint's bytes to `path` through write_file_atomically. Throws cpattn::Error
// naming the file.
void save_checkpoint(const std::string& path, const CheckpointConfig& cfg, int64_t step, int64_t skipped,
                     const DataPosition& data, std::span<const float> params, std::span<const float> m,
                     std::span<const float> v);

// Reads and verifies `path` against `cfg` (cpattn::Error names the file and the first problem
// or the first field that differs).
CheckpointState load_checkpoint(const std::string& path, const CheckpointConfig& cfg);
// The same checks on a checkpoint's bytes, `path` naming it in messages (load_checkpoint reads
// the file and calls this; the fuzzer feeds it bytes directly).
CheckpointState parse_checkpoint(std::span<const std::byte> file, const std::string& path, const CheckpointConfig& cfg);

}  // namespace cpattn::train
