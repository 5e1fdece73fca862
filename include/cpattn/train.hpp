// A small causal language model trained with context parallelism (docs/design.md section 8): the
// end-to-end user of the planner, the CP attention and the communicator. See docs/training.md.
//
//   Data   documents (one per file) -> byte tokens + an end-of-document token (vocab 257),
//          packed into sequences of seq_len tokens, attention and positions reset at every
//          document segment (DataStream).
//   Model  token embedding; `layers` pre-norm blocks
//            x = x + Wo . Attn(RoPE(Wq . rms(x)), RoPE(Wk . rms(x)), Wv . rms(x))   (GQA)
//            x = x + W2 . (silu(W1 . rms(x)) * (W3 . rms(x)))                       (SwiGLU)
//          or, with ModelConfig::experts, x = x + MoE(rms(x)) (moe.hpp's layer, expert parallel
//          over MeshConfig::ep ranks)
//          final RMSNorm, LM head, cross-entropy over the real tokens of all ranks.
//          Token-wise layers run on this rank's local tokens (sequence parallel); attention
//          goes through cpattn::CpAttention; RoPE uses each token's global position in its
//          document. Forward and backward are written by hand; matrix products are cblas_sgemm.
//   Optim  AdamW (decay on matrices only), linear warm-up then a constant rate, clipping by
//          the global gradient norm; gradients summed over the CP group in a fixed order, so
//          every rank holds bitwise-identical weights.
//
//   cpattn::Communicator comm(MPI_COMM_WORLD);
//   cpattn::train::Trainer trainer(comm, {.layers = 2, .dim = 128}, {.lr = 5e-4f}, {});
//   cpattn::train::DataStream data(cpattn::train::load_documents({}));
//   for (int s = 0; s < 100; ++s) {
//     const cpattn::train::StepStats st = trainer.step(data.next(1024));
//   }
#pragma once

#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cpattn/file.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/moe.hpp>
#include <cpattn/pipeline.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/train_config.hpp>

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace cpattn::train {


// ---- Data ---------------------------------------------------------------------------------------

struct Document {
  std::string name;            // the file it came from
  std::vector<uint8_t> bytes;  // its contents
};

// One document per file. `paths` are files or folders (a folder contributes every regular
// file below it); all files are read in sorted order of their canonical path, each file once
// (symlinked duplicates skipped), empty files skipped. No paths: kDefaultDataDir. Throws
// cpattn::Error for a missing path, an unreadable file or when no non-empty document is left.
std::vector<Document> load_documents(std::span<const std::string> paths);

// What load_documents(paths) reads, without reading it: its files and the folders its walk
// enters (folder links followed, each folder once), all canonical, with their identities. For
// the checks that an output never lands among the data (a hard link to a data file, a folder
// reached through a link below a data folder or under another name, as a bind mount gives).
// Throws as load_documents does for a missing path, and naming a file the walk cannot resolve.
struct DataTree {
  std::vector<std::string> files;         // sorted, each once
  std::vector<FileId> file_ids;           // files[i]'s identity when walked
  std::map<FileId, std::string> folders;  // each folder entered, by identity: its canonical name
                                          // (the name walked where it has none)
};
DataTree data_tree(std::span<const std::string> paths);

// One packed sequence of the whole batch (global order, real tokens only).
struct PackedSequence {
  std::vector<int64_t> tokens;      // [T]
  std::vector<int64_t> labels;      // [T] next token of the same document, or kIgnoreIndex
  std::vector<int64_t> positions;   // [T] position in the document segment, from 0
  std::vector<int64_t> cu_seqlens;  // [segments+1] segment boundaries, leading 0, last T
};

// The token stream: document d is its bytes followed by kEndOfDocument; documents follow each
// other in order and the stream wraps around (epoch + 1). next(n) takes the next n tokens.
// Every document segment starts at position 0: a document cut at the end of a sequence goes
// on in the next one as a new segment (positions from 0 again, no attention back to the cut
// part). Labels are the document's next token, also across such a cut; the end-of-document
// token has no label.
class DataStream {
 public:
  explicit DataStream(std::vector<Document> docs);
  PackedSequence next(int64_t seq_len);
  const DataPosition& position() const { return pos_; }
  void seek(const DataPosition& pos);  // checks the position is inside the data
  const std::vector<Document>& documents() const { return docs_; }
  int64_t total_tokens() const;  // tokens of one epoch

 private:
  std::vector<Document> docs_;
  DataPosition pos_;
};

// ---- Model and training -------------------------------------------------------------------------

struct RunOptions {
  DType attn_dtype = DType::f32;  // storage type of q, k, v in attention: f32 or bf16
  int threads = 1;                // BLAS and attention threads per rank
  // How attention's K/V reach the queries (CpAttnConfig::scheme). Every scheme is exact, so
  // the scheme changes no result beyond rounding and a checkpoint does not record it (like cp).
  CpScheme cp_scheme = CpScheme::allgather;
  int cp_inner = 0;  // hybrid only: ranks of one all-to-all group (CpAttnConfig::cp_inner)
  CpSplit split = CpSplit::padded;  // how each sequence's documents are cut (docs/planner.md)
  // Internal, for tests: apply RoPE with each token's offset in this rank's local part of its
  // document instead of its global position. Wrong for cp > 1 on purpose.
  bool rope_local_offsets = false;
  // A step whose loss or gradient norm is not finite: false (default) stops training with
  // cpattn::Error "step N: loss is nan, gradient norm nan: ..." on every rank alike (both are
  // all-reduced, so every rank sees the same values) and leaves the weights as they were;
  // true skips that step's update (the step still counts for the schedule, its data is
  // consumed, the AdamW moments are untouched and its bias correction counts only updates)
  // and counts it in Trainer::skipped_steps(), which a checkpoint keeps.
  bool skip_nonfinite = false;
  // Internal, for tests: rank 0's loss of this step (counting from 0) becomes NaN before the
  // all-reduce, so every rank sees a NaN loss. -1: off.
  int64_t testing_nan_at_step = -1;
};

struct StepStats {
  int64_t step = 0;          // the step just taken, from 0
  double loss = 0;           // mean cross-entropy over the real tokens of all ranks (nats)
  // The MoE auxiliary loss (ModelConfig::aux_loss_coeff; 0 without experts): the step
  // minimizes loss + aux_loss, and grad_norm is that objective's.
  double aux_loss = 0;
  int64_t dropped = 0;       // MoE assignments over their expert's capacity, all blocks and ranks
  double grad_norm = 0;      // global gradient norm before clipping
  double lr = 0;             // learning rate used
  int64_t tokens = 0;        // real (scored) tokens of all ranks
  int64_t local_tokens = 0;  // this rank's rows, padding included
  bool skipped = false;      // non-finite loss or gradient norm, update skipped (skip_nonfinite)
};

// Training on a DP x CP x PP mesh (docs/training.md). The Communicator given to the Trainer
// is the whole mesh: world = dp * cp * pp ranks, laid out as include/cpattn/mesh.hpp says
// (cp fastest, then dp, then pp); cp = world / (dp * pp). A step takes M micro-batches, one
// packed sequence each, the same on every rank: DP replica d runs micro-batches
// [d * M/dp, (d+1) * M/dp) through its pipeline of pp stages under `schedule`, each stage's
// CP group splitting every sequence. Gradients are summed over DP x CP, then assembled over
// PP (each stage holds its own layers' gradients); every rank keeps the whole model, but for
// the experts of a model with experts: each rank keeps its EP share (MeshConfig::ep), whose
// gradients are summed over the ranks holding the same experts.
// The loss and gradient are those of the M sequences as one batch, so a run on one process
// with the same micro-batches gives the same loss and gradient norm (up to float summation
// order).
struct MeshConfig {
  int dp = 1;  // data-parallel replicas
  int pp = 1;  // pipeline stages
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;  // fill-drain (forward only) refused
  int virtual_stages = 1;  // model chunks per stage, interleaved only
  // Expert-parallel size (ModelConfig::experts > 0): the dp * cp ranks of each pipeline stage
  // form dp * cp / ep EP groups of ep consecutive ranks (cp fastest, then dp), and each rank
  // of a group computes experts / ep of every block's experts for the group's tokens. Must
  // divide experts and dp * cp; 1 without experts. Exact: a checkpoint does not record it.
  int ep = 1;
};

// A 64-bit hash (FNV-1a) of every document's name and bytes, in order: the data's identity.
uint64_t data_identity(std::span<const Document> docs);
// The same of the bytes alone, in order: what the tokens are, wherever the files lie (the ranks
// of a run compare it: copies on each node's own disk may lie under other paths).
uint64_t data_content_hash(std::span<const Document> docs);

// A parameter tensor inside the flat parameter vector.
struct ParamTensor {
  std::string name;  // e.g. "layer0.wq"
  int64_t offset = 0;
  int64_t size = 0;
  std::vector<int64_t> shape;
  bool decay = false;  // weight decay applies
};

class Trainer {
 public:
  // Borrows `comm`: the mesh of `mesh` (by default the CP group alone, cp = comm.size()).
  // Every rank initializes identical weights from `seed`. Throws cpattn::Error, on every
  // rank, when the mesh's sizes do not multiply to comm.size() (resolve_mesh's message) or
  // MeshConfig::ep does not fit (naming ep and the rule).
  Trainer(Communicator& comm, const ModelConfig& model, const OptimConfig& optim,
          const RunOptions& options, uint64_t seed = 1, const MeshConfig& mesh = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Forward, backward, gradient all-reduce, clipping and one AdamW update. Collective.
  StepStats step(const PackedSequence& seq);
  // The same over the step's micro-batches (MeshConfig): their number must be a multiple of
  // dp (and each replica's of pp, with interleaved). step(seq) is step({&seq, 1}).
  StepStats step(std::span<const PackedSequence> micro);
  // Forward and backward only: returns the global mean loss (plus the MoE auxiliary loss,
  // StepStats::aux_loss) and leaves the all-reduced (unclipped) gradients in grads(). Collective.
  double loss_and_grad(const PackedSequence& seq);
  // Forward only: the global mean loss plus the MoE auxiliary loss, the objective whose
  // gradient loss_and_grad gives (on one sequence). Collective.
  double loss(const PackedSequence& seq);

  // This rank's parameters, gradients and tensors: the whole model, or with experts the
  // replicated tensors and then this rank's experts only (expert tensors [experts / ep, ...]).
  // With experts each region of params() is followed by zeros in no tensor up to a multiple of
  // the world size, as grads() always is (so that the gradient all-reduces need no padded copy);
  // without, params() is exactly the tensors. tensors() gives the offsets.
  std::span<float> params();
  std::span<const float> grads() const;
  const std::vector<ParamTensor>& tensors() const;
  const ModelConfig& model() const;
  int64_t steps_done() const;
  double global_grad_norm() const;  // of grads()
  int64_t skipped_steps() const;    // steps skipped as non-finite (RunOptions::skip_nonfinite),
                                    // since step 0: a loaded checkpoint's included

  // Checkpoint: the full configuration (model config, optimizer settings, seed, attention
  // dtype, `id`'s seq_len, data hash and micro), step, skipped steps, data position, weights and AdamW moments
  // (fp32), under an FNV-1a 64 checksum (src/train/checkpoint.hpp). Written by rank 0
  // (weights are replicated; experts are first gathered over its EP group, so the file holds
  // every expert whatever ep) through write_file_atomically, read by every rank (each keeps
  // its experts); a file saved at one cp, ep or mesh resumes at any other. load() refuses, with the same cpattn::Error on every rank,
  // a file that is truncated, has trailing bytes, fails its checksum, holds a negative step or
  // data position, more skipped steps than steps, or a non-finite weight or moment, or whose configuration differs from this
  // run's (the message names the field: "checkpoint 'c' has lr 0.001, this run 0.0005").
  void save(const std::string& path, const DataPosition& data, const RunIdentity& id = {}) const;  // collective
  DataPosition load(const std::string& path, const RunIdentity& id = {});                         // collective

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Smallest seq_len such that every rank holds a chunk: chunks_per_document(cp), 2 * cp (1 at cp = 1).
inline int64_t min_seq_len(int cp) { return chunks_per_document(cp); }

}  // namespace cpattn::train
