// `cpattn run`'s memory budget: what a rank allocates for the flags' batch, checked against
// what the machine has before the batch exists (a huge --seq-len is refused in milliseconds,
// not by the OOM killer). Upper estimates, from the shapes alone.
#include "run.hpp"

#include <cpattn/attention.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/error.hpp>
#include <cpattn/memory.hpp>

#include <algorithm>
#include <cstdlib>
#include <string>

namespace cpattn::cli::run_cmd {
namespace {

// Elements of q, k, v and dout together (also of dq, dk, dv and out): per token.
uint64_t input_elements_per_token(const check::BatchShape& s) {
  const uint64_t heads = static_cast<uint64_t>(s.heads_q) + static_cast<uint64_t>(s.heads_k);  // (an int sum wrapped)
  return heads * static_cast<uint64_t>(s.head_dim_qk) + heads * static_cast<uint64_t>(s.head_dim_v);
}

// The ranks of this job on this node (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE; 1 outside mpirun):
// they share its memory.
uint64_t ranks_on_this_node() {
  const char* n = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const long v = n != nullptr ? std::atol(n) : 1;
  return v >= 1 ? static_cast<uint64_t>(v) : 1;
}

}  // namespace

RunMemory run_memory_estimate(int64_t tokens, int64_t longest, const check::BatchShape& s,
                              std::span<const CpAttnConfig> configs, int cp) {
  CPATTN_CHECK(!configs.empty(), "run_memory_estimate: no scheme to run");
  const CpAttnConfig& cfg = configs.front();  // the schemes share shapes, dtype and options
  const auto t = static_cast<uint64_t>(tokens);
  const uint64_t per_token = input_elements_per_token(s);
  // A check::Tensor keeps fp32 values, plus its fp16/bf16 storage.
  const uint64_t tensor_bytes = 4 + (cfg.dtype == DType::f32 ? 0 : dtype_size(cfg.dtype));
  const uint64_t all = saturating_mul(t, per_token);  // elements of 4 global tensors
  const auto local_tokens = static_cast<int64_t>((t + static_cast<uint64_t>(cp) - 1) / static_cast<uint64_t>(cp));
  const uint64_t lse = saturating_mul(t, static_cast<uint64_t>(s.heads_q) * 4);
  RunMemory m;
  m.batch = saturating_mul(all, tensor_bytes);
  // Local inputs and outputs (8 tensors of local_tokens rows) and every scheme's CP layer.
  m.cp = saturating_mul(saturating_mul(static_cast<uint64_t>(local_tokens), per_token), 2 * tensor_bytes);
  for (const CpAttnConfig& c : configs) m.cp = saturating_add(m.cp, cp_memory_estimate(c, cp, local_tokens).total());
  // Each scheme's results gathered in global order on every rank, with gather_global_rows' staging.
  m.results = saturating_mul(saturating_add(saturating_mul(all, 3 * 4), lse), configs.size());
  // Rank 0: the single-process outputs (Tensors and fp32 results) and the kernel's scratch,
  // with the per-task buffers of the longest document. Rows bounded as cp_memory_estimate's:
  // past 2^50 the batch's own terms refuse the run, and the scratch's sums must not wrap.
  const auto rows = static_cast<int64_t>(std::min(t, uint64_t{1} << 50));
  const AttnBwdParams whole{.in = {.q = {nullptr, rows, s.heads_q, s.head_dim_qk, cfg.dtype},
                                   .k = {nullptr, rows, s.heads_k, s.head_dim_qk, cfg.dtype},
                                   .v = {nullptr, rows, s.heads_k, s.head_dim_v, cfg.dtype},
                                   .options = cfg.options}};
  m.reference = saturating_add(saturating_add(saturating_mul(all, tensor_bytes + 4), lse),
                               attention_backward_scratch_bytes(whole, longest));
  m.ranks_on_node = ranks_on_this_node();
  return m;
}

uint64_t RunMemory::node_bytes() const {
  return saturating_add(saturating_mul(saturating_add(saturating_add(batch, cp), results), ranks_on_node), reference);
}

std::string RunMemory::describe() const {
  return std::to_string(ranks_on_node) + " rank(s) on this node, each: global batch " + format_bytes(batch) +
         ", local tensors and CP attention " + format_bytes(cp) + ", gathered results " + format_bytes(results) +
         "; rank 0's single-process check " + format_bytes(reference);
}

void check_run_memory(int64_t tokens, int64_t longest, const check::BatchShape& s,
                      std::span<const CpAttnConfig> configs, int cp) {
  const RunMemory m = run_memory_estimate(tokens, longest, s, configs, cp);
  check_memory(m.node_bytes(), "cpattn run of " + std::to_string(tokens) + " tokens", m.describe());
}

}  // namespace cpattn::cli::run_cmd
