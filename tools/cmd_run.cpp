// `cpattn run`: the distributed CP attention forward and backward on one packed batch,
// checked against a single-process run of the whole batch. Launch with mpirun.
// This file wires the flags to the parts in run/ (run/run.hpp): the batch source, the
// distributed run, the check and the report.
#include <cpattn/comm.hpp>

#include <memory>

#include "commands.hpp"
#include "run/run.hpp"
#include "vocab.hpp"

namespace cpattn::cli {

namespace {

using run_cmd::RunArgs;

void run(const RunArgs& a) {
  const MpiSession mpi;  // finalizes only what it initialized
  if (!run_cmd::run_distributed(a)) throw ExitCode{1};
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto a = std::make_shared<RunArgs>();
  CLI::App* cmd = app.add_subcommand(
      "run",
      "Distributed CP attention, forward and backward, on one packed batch, checked against a "
      "single-process run. Launch as: mpirun -np N cpattn run [flags]. Exits 1 when the check fails.");
  auto* lengths = cmd->add_option("--lengths", a->lengths, "Document lengths, comma-separated (default: a "
                                                           "realistic mix drawn from --seed)")
                      ->delimiter(',')->check(int64_value());
  auto* seq_len = cmd->add_option("--seq-len", a->seq_len, "Tokens of the default document mix")->capture_default_str();
  auto* npy = cmd->add_option("--npy-in", a->npy_in,
                              "Read the global unpadded batch from DIR: q.npy, k.npy, v.npy, dout.npy (float32 "
                              "or float16, [T, H, D]) and cu_seqlens.npy (int32 or int64, leading 0)")->check(path_flag());
  npy->excludes(lengths, seq_len);
  cmd->add_option("--npy-out", a->npy_out, "Write out.npy, lse.npy ([T, Hq]), dq.npy, dk.npy, dv.npy (float32, "
                                           "real tokens in global order) to DIR")->check(path_flag());
  // (The shape of --npy-in's batch is its files': these flags would be ignored with it.)
  for (CLI::Option* shape :
       {cmd->add_option("--heads", a->heads, "Query heads")->capture_default_str(),
        cmd->add_option("--kv-heads", a->kv_heads, "Key/value heads (GQA when fewer than --heads)")->capture_default_str(),
        cmd->add_option("--head-dim", a->head_dim, "Head dimension of q, k and v")->check(CLI::Range(1, 256))
            ->capture_default_str(),
        cmd->add_option("--head-dim-qk", a->head_dim_qk, "Head dimension of q and k (MLA: e.g. 192), overrides "
                        "--head-dim")->check(CLI::Range(1, 256)),
        cmd->add_option("--head-dim-v", a->head_dim_v, "Head dimension of v (MLA: e.g. 128), overrides --head-dim")
            ->check(CLI::Range(1, 256))})
    npy->excludes(shape);
  cmd->add_option("--dtype", a->dtype, "Storage type: fp32, fp16 or bf16 (or float32, float16, bfloat16)")
      ->transform(dtype_transformer())->capture_default_str();
  cmd->add_option("--mask", a->mask, "causal or none")->transform(mask_transformer())->capture_default_str();
  cmd->add_option("--kernel-path", a->kernel_path, "Kernel path (automatic: the fastest this CPU runs)")
      ->transform(kernel_path_transformer())->capture_default_str();
  cmd->add_option("--dropout", a->dropout, "Attention dropout probability in [0, 1)")->capture_default_str();
  cmd->add_option("--window", a->window, "Sliding window LEFT,RIGHT (FlashAttention's window_size; -1 = "
                                         "unbounded on that side)");
  cmd->add_option("--softcap", a->softcap, "Logit soft cap (0 = off): scores become X * tanh(s / X)")
      ->capture_default_str();
  cmd->add_flag("--alibi", a->alibi, "ALiBi biases with the standard slopes 2^(-8 (h + 1) / heads)");
  cmd->add_option("--threads", a->threads, "Kernel threads per rank")->capture_default_str();
  cmd->add_option("--cp", a->cp, "Context-parallel size, dividing the MPI world size: world/cp CP groups "
                                 "each run the check (default: the world size, one group)")
      ->check(at_least_one());
  cmd->add_option("--mode", a->mode, "How the kernel reads the gathered keys: runs (in place) or index "
                                     "(index_select copy, index_add_ in backward)")
      ->capture_default_str()
      ->transform(kv_mode_transformer());
  cmd->add_option("--scheme", a->scheme, "How K/V reach the queries: allgather (gather every rank's K/V once), "
                                         "ring (pass-KV: blocks shifted around the ring of CP ranks), pass-q "
                                         "(the queries travel, partial results come back), a2a (all-to-all: "
                                         "heads scattered, whole documents per rank), hybrid (a2a over "
                                         "--cp-inner ranks x allgather over the groups), or all (every scheme "
                                         "on the same batch, one table)")
      ->capture_default_str()
      ->transform(run_scheme_transformer());
  cmd->add_option("--cp-inner", a->cp_inner, "--scheme hybrid (or all): ranks of one all-to-all group (consecutive "
                                             "ranks), dividing the CP size");
  cmd->add_option("--split", a->split, "How documents are cut into chunks: padded (TransformerEngine's) or "
                                       "padding-free (allgather scheme only; docs/planner.md)")
      ->capture_default_str()
      ->transform(split_transformer());
  auto* overlap = cmd->add_option("--overlap", a->overlap, "All-gather scheme (runs mode): on runs the kernels per group of KV "
                                         "heads (the first and last group, or with one KV head its one group, also "
                                         "per group of documents) while the other groups' K/V and dK/dV travel; off: "
                                         "one all-gather, one kernel call, one reduce-scatter (bitwise the same results)")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  auto* shared_memory = cmd->add_option("--shared-memory", a->shared_memory,
                  "All-gather scheme (runs mode), every rank on one node: on moves K/V and dK/dV through one "
                  "shared-memory buffer each (no copies; --overlap is then moot), off: through messages (bitwise "
                  "the same results)")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  cmd->add_option("--seed", a->seed, "Seed of the default batch's lengths and tensors, and of dropout")
      ->capture_default_str();
  cmd->add_option("--repeats", a->repeats, "Forward+backward steps to time (medians are reported)")
      ->capture_default_str();
  add_timeout_option(cmd, a->timeout);
  cmd->add_flag("!--no-check-finite", a->check_finite,
                "Skip the check that q, k, v and dout are finite (by default a NaN or inf input is an error "
                "naming the tensor and its first bad element)");
  cmd->add_option("--testing-stall-s", a->testing_stall_s, "Testing only: this rank sleeps SECONDS before its "
                                                          "first CP step (give it to one rank, mpirun's MPMD form)")
      ->group("");
  cmd->add_flag("--json", a->json, "Print the report as one JSON object");
  cmd->callback([a, overlap, shared_memory] {
    a->overlap_given = overlap->count() > 0;
    a->shared_memory_given = shared_memory->count() > 0;
    run(*a);
  });
}

}  // namespace cpattn::cli
