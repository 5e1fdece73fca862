// `cpattn train`: a small causal LM trained on packed real documents with context
// parallelism (include/cpattn/train.hpp, docs/training.md). Launch as
//   mpirun -np N cpattn train --cp N [flags]      (plain `cpattn train` for CP=1)
// `--compare 1,2,4` runs the same training at each CP size as its own MPI job and prints the
// curves side by side (train_compare.cpp).
#include <cpattn/comm.hpp>
#include <cpattn/error.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/file.hpp>
#include <cpattn/memory.hpp>
#include <cpattn/pipeline.hpp>
#include <cpattn/train.hpp>

#include <nlohmann/json.hpp>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <bit>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "commands.hpp"
#include "train_compare.hpp"
#include "vocab.hpp"

#ifndef CPATTN_MPIEXEC
#define CPATTN_MPIEXEC "mpirun"
#endif

namespace cpattn::cli {

namespace {

struct TrainArgs {
  int cp = 1;
  // The mesh (docs/training.md): world = dp * cp * pp; `micro` sequences per step, split
  // over the dp replicas, each replica's run through its pp-stage pipeline under `schedule`.
  int dp = 1, pp = 1;
  int micro = 1;
  std::string schedule = "1f1b";
  std::optional<int> virtual_stages;  // interleaved only; default 2
  train::ModelConfig model;
  train::OptimConfig optim;
  int64_t seq_len = 1024;
  int64_t steps = 200;
  uint64_t seed = 1;
  std::string dtype = "fp32";  // attention storage, canonical (vocab.hpp)
  std::string cp_scheme = "allgather";  // canonical (vocab.hpp)
  int cp_inner = 0;                      // --cp-scheme hybrid: all-to-all group size
  std::string window;                   // --window LEFT,RIGHT (empty: unbounded)
  float softcap = 0.0f;
  bool alibi = false;
  std::string split = "padded";  // canonical (vocab.hpp)
  int threads = 1;
  std::vector<std::string> data;
  std::string json_log, save, resume;
  std::vector<std::string> compare;  // CP sizes ("4") or mesh shapes ("dp2xcp2xpp2")
  std::string compare_svg;           // --compare --svg FILE: the loss curves on one chart
  std::string mpirun = CPATTN_MPIEXEC;
  std::optional<double> timeout;  // --timeout (unset: CPATTN_COMM_TIMEOUT_S, else 300 s)
  bool rope_local = false;  // hidden: RoPE on local offsets (for tests)
  int print_every = 1;
  int64_t save_every = 0;       // also save every N steps (0: only at the end)
  bool skip_nonfinite = false;  // skip a non-finite step instead of stopping
  int64_t testing_nan_at_step = -1;  // hidden: NaN loss at this step (for tests)
  int64_t testing_log_full_at_step = -1;  // hidden: the JSON log's disk is full from this step on
  int64_t testing_rank_error_at_step = -1;  // hidden: the last rank alone meets an error before this step
  // Mixture of experts (docs/training.md): model.experts and model.top_k, the EP size, and
  // the layer's options as cpattn moe names them.
  int ep = 1;
  std::optional<double> capacity_factor;
  std::string router = "softmax";        // softmax | sigmoid-bias
  std::string drop_policy = "position";  // position | probability
  double aux_loss_coeff = 0;
  double bias_update_rate = 1e-3;
};

// SIGTERM or SIGINT received (the signal's number); the loop checks it between steps.
volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_RESETHAND;  // a second signal ends the process at once
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

uint64_t hash_of(const std::string& s) {
  uint64_t h = 14695981039346656037ull;
  for (const char c : s) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

// The model of the flags: the sizes, and the attention masks parsed (check_args checks them).
train::ModelConfig model_config(const TrainArgs& a) {
  train::ModelConfig m = a.model;
  const Window w = parse_window(a.window);
  m.window_left = w.left;
  m.window_right = w.right;
  m.softcap = a.softcap;
  m.alibi = a.alibi;
  m.router = a.router == "sigmoid-bias" ? MoeRouter::sigmoid_bias : MoeRouter::softmax;
  m.capacity_factor = a.capacity_factor;
  m.drop_policy = a.drop_policy == "probability" ? MoeDropPolicy::by_probability : MoeDropPolicy::by_position;
  m.aux_loss_coeff = a.aux_loss_coeff;
  m.bias_update_rate = a.bias_update_rate;
  return m;
}

// Every setting that must be the same on every rank, for cpattn::agree.
Fingerprint settings_fingerprint(const TrainArgs& a) {
  std::string data;
  for (const std::string& d : a.data) data += d + '\n';
  const auto fbits = [](float x) { return static_cast<int64_t>(std::bit_cast<uint32_t>(x)); };
  Fingerprint fp;
  fp.add("--cp", a.cp).add("--layers", a.model.layers).add("--dim", a.model.dim).add("--heads", a.model.heads);
  fp.add("--kv-heads", a.model.kv_heads).add("--seq-len", a.seq_len).add("--steps", a.steps);
  fp.add("--seed", static_cast<int64_t>(a.seed)).add("--lr (float bits)", fbits(a.optim.lr));
  fp.add("--warmup", a.optim.warmup).add("--weight-decay (float bits)", fbits(a.optim.weight_decay));
  fp.add("--clip (float bits)", fbits(a.optim.clip)).add("--dtype (hash)", static_cast<int64_t>(hash_of(a.dtype)));
  const train::ModelConfig m = model_config(a);
  fp.add("--cp-scheme (hash)", static_cast<int64_t>(hash_of(a.cp_scheme))).add("--cp-inner", a.cp_inner);
  fp.add("--window (left)", m.window_left).add("--window (right)", m.window_right);
  fp.add("--softcap (float bits)", fbits(a.softcap)).add("--alibi", a.alibi ? 1 : 0);
  fp.add("--dropout (float bits)", fbits(a.model.dropout));
  fp.add("--split (hash)", static_cast<int64_t>(hash_of(a.split)));
  fp.add("--data (hash)", static_cast<int64_t>(hash_of(data)));
  fp.add("--resume (hash)", static_cast<int64_t>(hash_of(a.resume)));
  fp.add("--save (hash)", static_cast<int64_t>(hash_of(a.save))).add("--save-every", a.save_every);
  fp.add("--json-log (hash)", static_cast<int64_t>(hash_of(a.json_log)));
  fp.add("--skip-nonfinite", a.skip_nonfinite ? 1 : 0).add("--print-every", a.print_every);
  fp.add("--timeout (double bits)", std::bit_cast<int64_t>(a.timeout.value_or(0.0)));
  fp.add("--rope-local-offsets", a.rope_local ? 1 : 0).add("--testing-nan-at-step", a.testing_nan_at_step);
  fp.add("--testing-rank-error-at-step", a.testing_rank_error_at_step);
  fp.add("--dp", a.dp).add("--pp", a.pp).add("--micro", a.micro).add("--schedule (hash)", static_cast<int64_t>(hash_of(a.schedule)));
  fp.add("--virtual", a.virtual_stages.value_or(0));
  const auto dbits = [](double x) { return std::bit_cast<int64_t>(x); };
  fp.add("--experts", a.model.experts).add("--top-k", a.model.top_k).add("--ep", a.ep);
  fp.add("--capacity-factor (double bits, -1 unset)", a.capacity_factor ? dbits(*a.capacity_factor) : -1);
  fp.add("--router (hash)", static_cast<int64_t>(hash_of(a.router)));
  fp.add("--drop-policy (hash)", static_cast<int64_t>(hash_of(a.drop_policy)));
  fp.add("--aux-loss-coeff (double bits)", dbits(a.aux_loss_coeff));
  fp.add("--bias-update-rate (double bits)", dbits(a.bias_update_rate));
  return fp;
}

// The JSON log: opened once (truncated, or appended to on --resume), every write checked,
// fsynced at each checkpoint and at the end. Rank 0 only.
struct JsonLog {
  int fd = -1;
  std::string path;
  ~JsonLog() {
    if (fd >= 0) ::close(fd);
  }
  // `resume_step` >= 0: a resumed run's, appended to after its records of the steps before the
  // checkpoint's (records of later steps, written by a run that ended before its next save,
  // and a torn last line are cut: the resumed run writes those steps again, which left them
  // twice in the log).
  void open(const std::string& p, int64_t resume_step) {
    path = p;
    check_output_path(p, "--json-log");
    const bool append = resume_step >= 0;
    fd = ::open(p.c_str(), (append ? O_RDWR | O_APPEND : O_WRONLY | O_TRUNC) | O_CREAT | O_CLOEXEC, 0666);
    CPATTN_CHECK(fd >= 0, "--json-log: cannot open '", p, "': ", std::strerror(errno));
    if (!append) return;
    // The records, read through the descriptor that will write (the file the path names now).
    std::string bytes;
    for (char chunk[65536];;) {
      const ssize_t n = ::pread(fd, chunk, sizeof chunk, static_cast<off_t>(bytes.size()));
      if (n < 0 && errno == EINTR) continue;
      CPATTN_CHECK(n >= 0, "--json-log: cannot read '", p, "': ", std::strerror(errno));
      if (n == 0) break;
      bytes.append(chunk, static_cast<std::size_t>(n));
    }
    const std::string_view text(bytes);
    std::size_t keep = 0;
    for (std::size_t at = 0; at < text.size();) {
      const std::size_t end = text.find('\n', at);
      if (end == std::string_view::npos) break;  // a torn last line
      const nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at), nullptr, false);
      if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number_integer() ||
          j["step"].get<int64_t>() >= resume_step)
        break;
      keep = at = end + 1;
    }
    CPATTN_CHECK(keep == text.size() || ::ftruncate(fd, static_cast<off_t>(keep)) == 0, "--json-log: cannot cut '",
                 p, "' to its records before step ", resume_step, ": ", std::strerror(errno));
  }
  void write(const std::string& line) {
    with_flag("--json-log", [&] { write_all(fd, std::as_bytes(std::span(line.data(), line.size())), path); });
  }
  void sync() {
    CPATTN_CHECK(fd < 0 || ::fsync(fd) == 0, "--json-log: fsync of '", path, "' failed: ", std::strerror(errno));
  }
  // For tests: every later write goes to /dev/full, so it fails with ENOSPC like a full disk.
  void fill_disk() {
    const int full = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
    CPATTN_CHECK(full >= 0 && ::dup2(full, fd) >= 0, "--testing-log-full-at-step: cannot open /dev/full");
    ::close(full);
  }
};

using Clock = std::chrono::steady_clock;

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

DType parse_train_dtype(const std::string& s) { return parse_dtype(s, kTrainDtypes, "cpattn train"); }

// The mesh of the flags (checked by check_mesh_args).
train::MeshConfig mesh_config(const TrainArgs& a) {
  const PipelineSchedule kind = *parse_pipeline_schedule(a.schedule);
  return {.dp = a.dp, .pp = a.pp, .schedule = kind,
          .virtual_stages = a.virtual_stages.value_or(kind == PipelineSchedule::interleaved ? 2 : 1), .ep = a.ep};
}

// The mixture-of-experts flags' rules (the same on every rank: flags only).
void check_moe_args(const TrainArgs& a) {
  const int E = a.model.experts;
  CPATTN_CHECK(E >= 0, "--experts must be >= 0 (0: the dense MLP), got ", E);
  CPATTN_CHECK(a.router == "softmax" || a.router == "sigmoid-bias", "--router must be softmax or sigmoid-bias, got '",
               a.router, "'");
  CPATTN_CHECK(a.drop_policy == "position" || a.drop_policy == "probability",
               "--drop-policy must be position or probability, got '", a.drop_policy, "'");
  if (E == 0) {
    CPATTN_CHECK(a.ep == 1 && a.model.top_k == 1 && !a.capacity_factor && a.router == "softmax" &&
                     a.drop_policy == "position" && a.aux_loss_coeff == 0 && a.bias_update_rate == 1e-3,
                 "--ep, --top-k, --capacity-factor, --router, --drop-policy, --aux-loss-coeff and --bias-update-rate "
                 "need --experts E (a mixture of experts)");
    return;
  }
  CPATTN_CHECK(a.model.top_k >= 1 && a.model.top_k <= E, "--top-k must be in 1..--experts = ", E, ", got ",
               a.model.top_k);
  CPATTN_CHECK(a.ep >= 1, "--ep must be >= 1, got ", a.ep);
  CPATTN_CHECK(E % a.ep == 0, "--ep ", a.ep, " must divide --experts ", E, " (each EP rank holds --experts / --ep)");
  CPATTN_CHECK((a.dp * a.cp) % a.ep == 0, "--ep ", a.ep, " must divide --dp * --cp = ", a.dp, " * ", a.cp, " = ",
               a.dp * a.cp, " (EP is folded over the data- and context-parallel ranks of a pipeline stage)");
  check_router_flags(a.capacity_factor, a.aux_loss_coeff, a.router);
  CPATTN_CHECK(std::isfinite(a.bias_update_rate) && a.bias_update_rate > 0, "--bias-update-rate must be finite and > 0, got ",
               a.bias_update_rate);
}

void check_mesh_args(const TrainArgs& a) {
  CPATTN_CHECK(a.dp >= 1, "--dp must be >= 1, got ", a.dp);
  CPATTN_CHECK(a.pp >= 1, "--pp must be >= 1, got ", a.pp);
  // In int64 (in int, --dp 954437177 --pp 9 overflowed), and refused past any MPI world (an int
  // of ranks) before MPI starts; the world's own size is compared once it has started.
  CPATTN_CHECK(int64_t{a.dp} * a.cp <= std::numeric_limits<int>::max() / a.pp, "--dp ", a.dp, " * --cp ", a.cp,
               " * --pp ", a.pp, " ranks is past any MPI world size (at most ", std::numeric_limits<int>::max(),
               " ranks)");
  CPATTN_CHECK(a.micro >= 1, "--micro must be >= 1, got ", a.micro);
  CPATTN_CHECK(a.micro % a.dp == 0, "--micro ", a.micro, " must be a multiple of --dp ", a.dp,
               " (every data-parallel replica takes --micro / --dp sequences per step)");
  const std::optional<PipelineSchedule> kind = parse_pipeline_schedule(a.schedule);
  CPATTN_CHECK(kind.has_value(), "--schedule must be gpipe, 1f1b, interleaved or zb-h1, got '", a.schedule, "'");
  CPATTN_CHECK(*kind != PipelineSchedule::fill_drain, "--schedule fill-drain runs forwards only: training needs "
               "gpipe, 1f1b, interleaved or zb-h1");
  CPATTN_CHECK(!a.virtual_stages || *kind == PipelineSchedule::interleaved,
               "--virtual applies to --schedule interleaved only, got --virtual ", a.virtual_stages.value_or(0),
               " with ", a.schedule);
  const train::MeshConfig mc = mesh_config(a);
  with_flag("--schedule", [&] {
    (void)make_schedule({.stages = a.pp, .micro = a.micro / a.dp, .schedule = mc.schedule,
                         .virtual_stages = mc.virtual_stages});
  });
}

// The model's attention layers as the flags make them (masks aside), for the checks and the
// memory estimate before any layer exists.
CpAttnConfig attention_config(const TrainArgs& a) {
  const train::ModelConfig& m = a.model;
  return {.num_heads_q = m.heads, .num_heads_k = m.kv_heads, .head_dim_qk = m.head_dim(), .head_dim_v = m.head_dim(),
          .dtype = parse_train_dtype(a.dtype), .options = {.num_threads = a.threads},
          .scheme = parse_scheme(a.cp_scheme, "--cp-scheme"), .cp_inner = a.cp_inner, .split = parse_split(a.split)};
}

// Checks that need no MPI, the same on every rank.
void check_args(const TrainArgs& a) {
  CPATTN_CHECK(a.cp >= 1, "--cp must be >= 1, got ", a.cp);
  check_mesh_args(a);
  check_moe_args(a);
  CPATTN_CHECK(a.steps >= 0, "--steps must be >= 0, got ", a.steps);
  CPATTN_CHECK(a.threads >= 1, "--threads must be >= 1, got ", a.threads);
  CPATTN_CHECK(a.optim.warmup >= 0, "--warmup must be >= 0, got ", a.optim.warmup);
  CPATTN_CHECK(a.optim.lr > 0 && std::isfinite(a.optim.lr), "--lr must be finite and > 0, got ", a.optim.lr);
  CPATTN_CHECK(a.optim.weight_decay >= 0 && std::isfinite(a.optim.weight_decay), "--weight-decay must be >= 0 and "
               "finite, got ", a.optim.weight_decay);
  CPATTN_CHECK(a.optim.clip >= 0, "--clip must be >= 0 (0: no clipping), got ", a.optim.clip);
  CPATTN_CHECK(a.print_every >= 1, "--print-every must be >= 1, got ", a.print_every);
  CPATTN_CHECK(a.save_every >= 0, "--save-every must be >= 0, got ", a.save_every);
  CPATTN_CHECK(a.save_every == 0 || !a.save.empty(), "--save-every needs --save FILE (where to write)");
  const train::ModelConfig& m = a.model;
  CPATTN_CHECK(m.layers >= 1, "--layers must be >= 1, got ", m.layers);
  CPATTN_CHECK(m.heads >= 1 && m.kv_heads >= 1 && m.heads % m.kv_heads == 0, "--heads (", m.heads,
               ") must be a positive multiple of --kv-heads (", m.kv_heads, ")");
  CPATTN_CHECK(m.dim >= 2 && m.dim % m.heads == 0, "--dim (", m.dim, ") must be a multiple of --heads (", m.heads, ")");
  CPATTN_CHECK(m.head_dim() % 2 == 0 && m.head_dim() <= 256,
               "the head dimension --dim / --heads must be even and <= 256, got ", m.head_dim());
  parse_train_dtype(a.dtype);
  const bool hybrid = parse_scheme(a.cp_scheme, "--cp-scheme") == CpScheme::hybrid;
  CPATTN_CHECK(hybrid || a.cp_inner == 0, "--cp-inner is for --cp-scheme hybrid only, got --cp-inner ", a.cp_inner,
               " with --cp-scheme ", a.cp_scheme);
  CPATTN_CHECK(!hybrid || (a.cp_inner >= 1 && a.cp % a.cp_inner == 0),
               "--cp-scheme hybrid needs --cp-inner N, N dividing --cp (", a.cp, " = inner x outer), got --cp-inner ",
               a.cp_inner);
  // The scheme's own rules (the split it takes, the all-to-all's head counts) before MPI starts.
  const std::string flags = "--cp-scheme " + a.cp_scheme + " with --split " + a.split + ", --heads " +
                            std::to_string(m.heads) + ", --kv-heads " + std::to_string(m.kv_heads) + " and --cp " +
                            std::to_string(a.cp);
  with_flag(flags.c_str(), [&] { check_cp_attn_config(attention_config(a), a.cp); });
  parse_window(a.window);
  check_softcap(a.softcap);
  CPATTN_CHECK(a.model.dropout >= 0.0f && a.model.dropout < 1.0f, "--dropout must be in [0, 1) (0 = off), got ",
               a.model.dropout);
  CPATTN_CHECK(a.model.dropout == 0.0f || a.model.experts == 0, "--dropout is the dense MLP's hidden dropout: "
               "with --experts ", a.model.experts, " it must be 0, got ", a.model.dropout);
  // (One token can be a lone end of document, which has no next token: a step with no label.)
  CPATTN_CHECK(a.seq_len >= 2, "--seq-len must be >= 2 (a sequence of one token may hold only an end of "
               "document, which has no label to learn), got ", a.seq_len);
  CPATTN_CHECK(a.seq_len >= train::min_seq_len(a.cp), "--seq-len ", a.seq_len,
               " cannot hold one padded chunk per rank: with --cp ", a.cp,
               " every document is cut into ", train::min_seq_len(a.cp),
               " chunks (2 * cp; 1 at cp = 1), so --seq-len must be at least ", train::min_seq_len(a.cp));
}

// An output that lands in the training data: in a --data file it replaced the corpus (and the
// run exited 0); below a --data folder it became a document, and the resumed run failed on a
// data hash that named no flag. Refused (rank 0 checks, every rank fails) before any work:
// below the --data paths, in a folder the data's walk enters by any name (through a link, a
// bind mount), or onto a data file under another name (a hard link, a link to it). Folders and
// files are compared by (device, inode), which a filesystem whose inode numbers are not unique
// (some FUSE ones) could make refuse an unrelated folder.
// The data's files and folders (train::data_tree), or none where they cannot be walked (a
// --data path that is not there, a folder that cannot be listed): the loading then fails on
// the same tree, naming the flag, before any output is written.
std::optional<train::DataTree> data_tree_of(const TrainArgs& a) {
  try {
    return train::data_tree(a.data);
  } catch (const Error&) {
    return std::nullopt;
  }
}

// `tree`: data_tree_of(a), walked once for every output.
void check_not_into_data(const TrainArgs& a, const char* flag, const std::string& path,
                         const std::optional<train::DataTree>& tree) {
  if (path.empty()) return;
  const std::vector<std::string> roots = a.data.empty() ? std::vector<std::string>{train::kDefaultDataDir} : a.data;
  constexpr const char* kWhy = ": an output must not replace the training data or add a document to it";
  for (const std::string& d : roots)
    CPATTN_CHECK(!writes_into(path, d), flag, " '", path, "' ",
                 same_file(path, d) ? "is the file of" : "lies in the folder of", " --data '", d, "'", kWhy);
  if (!tree) return;
  // Where the output lands (output_location): each folder above it that exists, by identity,
  // against the folders the walk entered (so also one reached under another name, as through a
  // bind mount), then its own identity against the data files'.
  const std::string out = output_location(path);
  if (!out.empty())
    for (std::filesystem::path up = out;; up = up.parent_path()) {  // the output itself first (a folder)
      if (const std::optional<FileId> id = file_id(up.string())) {
        const auto entered = tree->folders.find(*id);
        CPATTN_CHECK(entered == tree->folders.end(), flag, " '", path, "' lies in the folder '", entered->second,
                     "', which --data reaches through a link or under another name", kWhy);
      }
      if (up == up.parent_path()) break;  // the root
    }
  const std::optional<FileId> id = file_id(path);  // (not there yet: no data file)
  if (!id) return;
  const auto data_file = std::find(tree->file_ids.begin(), tree->file_ids.end(), *id);
  CPATTN_CHECK(data_file == tree->file_ids.end(), flag, " '", path, "' is the data file '",
               tree->files[static_cast<size_t>(data_file - tree->file_ids.begin())], "' of --data under another name",
               kWhy);
}

struct StepRow {
  int64_t step = 0;
  double loss = 0, grad_norm = 0, lr = 0, step_s = 0, tokens_per_s = 0;
  std::vector<double> peak_rss_mb;  // per rank
};

void print_summary(const std::vector<StepRow>& rows, int cp, double total_s) {
  if (rows.empty()) return;
  double sum_s = 0, sum_tps = 0;
  int n = 0;
  for (std::size_t i = rows.size() > 1 ? 1 : 0; i < rows.size(); ++i, ++n) {  // the first step warms up
    sum_s += rows[i].step_s;
    sum_tps += rows[i].tokens_per_s;
  }
  double min_loss = rows[0].loss;
  for (const StepRow& r : rows) min_loss = std::min(min_loss, r.loss);
  std::printf("\nrun summary (cp = %d)\n", cp);
  std::printf("  %-28s %lld\n", "steps", static_cast<long long>(rows.size()));
  std::printf("  %-28s %.4f -> %.4f (min %.4f, ln 257 = %.4f)\n", "loss", rows.front().loss,
              rows.back().loss, min_loss, std::log(257.0));
  std::printf("  %-28s %.4f -> %.4f\n", "grad norm", rows.front().grad_norm, rows.back().grad_norm);
  std::printf("  %-28s %.4f\n", "time per iteration (s)", sum_s / n);
  std::printf("  %-28s %.0f\n", "tokens per second", sum_tps / n);
  std::printf("  %-28s", "peak memory per rank (MB)");
  for (const double m : rows.back().peak_rss_mb) std::printf(" %.1f", m);
  std::printf("\n  %-28s %.2f\n", "total time (s)", total_s);
}

// What one rank allocates for training, at least, refused with both sizes before the model
// exists when past the available memory: its stage's layers' activations kept for their
// backward (about 16 x dim + 4 x ffn fp32 values per local token; with experts the MLP's 4 x
// ffn becomes top_k x (4 x ffn + 2 x dim) + experts: each token's rows at its top_k experts
// and back, under balanced routing) and the logits (3 x vocab per token) for each of its
// replica's micro-batches (a pipeline keeps up to all of them alive), the CP attention of
// those layers (cp_memory_estimate of --cp-scheme, --cp-inner and --split, one context per
// layer and micro-batch), and the parameters with their gradients and two Adam moments
// (ParamLayout's count: with experts, the router of every expert and experts / ep experts'
// weights per block). With experts, the model's every expert is also held once, at
// initialisation, when a checkpoint is loaded and, on rank 0, when one is saved.
void check_train_memory(const TrainArgs& a) {
  const train::ModelConfig m = model_config(a);
  const auto local = static_cast<uint64_t>((a.seq_len + a.cp - 1) / a.cp);
  const auto layers = static_cast<uint64_t>((m.layers + a.pp - 1) / a.pp);  // this rank's stage
  const auto micro = static_cast<uint64_t>(std::max(1, a.micro / std::max(1, a.dp)));  // this replica's
  const auto dim = static_cast<uint64_t>(m.dim), ffn = static_cast<uint64_t>(m.ffn_dim());
  const auto vocab = static_cast<uint64_t>(m.vocab), experts = static_cast<uint64_t>(std::max(0, m.experts));
  const auto top_k = static_cast<uint64_t>(std::max(1, m.top_k)), ep = static_cast<uint64_t>(std::max(1, a.ep));
  const uint64_t mlp_acts = m.moe() ? top_k * (4 * ffn + 2 * dim) + experts : 4 * ffn;
  const uint64_t activations = saturating_mul(
      saturating_mul(saturating_mul(local, micro),
                     saturating_add(saturating_mul(layers, 16 * dim + mlp_acts), 3 * vocab)),
      4);
  const uint64_t cp = cp_memory_estimate(attention_config(a), a.cp, static_cast<int64_t>(local))
                          .total(static_cast<int64_t>(saturating_mul(layers, micro)));
  // Parameters per block as ParamLayout lays them out (norms, q/k/v/o, then the MLP or the
  // router, its bias and the experts), `held` experts of them; wte, lnf and lm_head once.
  const uint64_t q = static_cast<uint64_t>(m.heads) * static_cast<uint64_t>(m.head_dim());
  const uint64_t kv = static_cast<uint64_t>(m.kv_heads) * static_cast<uint64_t>(m.head_dim());
  const auto count = [&](uint64_t held) {
    const uint64_t mlp = m.moe() ? dim * experts + (m.router == MoeRouter::sigmoid_bias ? experts : 0) +
                                       held * 3 * dim * ffn
                                 : 3 * dim * ffn;
    return saturating_add(saturating_mul(layers, 2 * dim + 2 * dim * q + 2 * dim * kv + mlp),
                          2 * vocab * dim + dim);
  };
  const uint64_t params = saturating_mul(count(experts / ep), 4 * 4);
  const uint64_t gathered = m.moe() ? saturating_mul(count(experts), 4) : 0;
  check_memory(saturating_add(saturating_add(saturating_add(activations, cp), params), gathered),
               "cpattn train at --seq-len " + std::to_string(a.seq_len) + " and --cp " + std::to_string(a.cp),
               "activations " + format_bytes(activations) + ", CP attention " + format_bytes(cp) +
                   ", parameters, gradients and moments " + format_bytes(params) +
                   (m.moe() ? ", every expert gathered " + format_bytes(gathered) : std::string()) + ", per rank");
}

// The longest a rank that met an error in a step waits for every other rank to meet it too.
constexpr double kStepErrorWaitS = 10;

// Whether every rank of `c` calls this within its deadline (false: this rank's call timed out,
// and `c` is poisoned).
bool every_rank_met_it(Communicator& c) {
  try {
    std::array<int64_t, 1> one{1};
    c.all_reduce<int64_t>(one, ReduceOp::sum);
    return true;
  } catch (const Error&) {
    return false;
  }
}

void train_run(const TrainArgs& a) {
  check_args(a);
  const MpiSession mpi;  // finalizes only what it initialized
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = a.timeout, .timeout_name = "--timeout"});
  const int rank = comm.rank();
  const int ranks = a.dp * a.cp * a.pp;
  // Every rank runs the same settings, or every rank fails at once naming the field; first, so
  // that the world size check below fails on every rank alike (a rank whose --cp alone differed
  // failed it alone and waited in MPI_Finalize while the others waited for it in the agreement
  // until --timeout, its message never printed).
  agree(comm, settings_fingerprint(a), "cpattn train");
  CPATTN_CHECK(ranks == comm.size(), "--dp ", a.dp, " * --cp ", a.cp, " * --pp ", a.pp, " = ", ranks,
               " does not match the MPI world size ", comm.size(), ": launch as mpirun -np ", ranks, " cpattn train");
  on_every_rank(comm, [&] { check_train_memory(a); });
  // Output paths before any work: a FIFO, a device, a folder or an unwritable folder is exit 2.
  on_every_rank(comm, [&] {
    if (rank != 0) return;
    if (!a.save.empty()) check_output_path(a.save, "--save");
    const std::optional<train::DataTree> tree =
        a.save.empty() && a.json_log.empty() ? std::nullopt : data_tree_of(a);
    check_not_into_data(a, "--save", a.save, tree);
    check_not_into_data(a, "--json-log", a.json_log, tree);
    if (a.json_log.empty()) return;
    check_output_path(a.json_log, "--json-log");
    // (A log in the checkpoint's file: resumed, its lines would be appended to the checkpoint;
    // saved, the checkpoint would replace the log.)
    for (const auto& [flag, path] : {std::pair{"--save", &a.save}, std::pair{"--resume", &a.resume}})
      CPATTN_CHECK(path->empty() || !same_file(a.json_log, *path), "--json-log '", a.json_log, "' is the file of ",
                   flag, " '", *path, "': the log and the checkpoint must be different files");
  });

  std::unique_ptr<train::DataStream> data;
  on_every_rank(comm, [&] {
    with_flag("--data", [&] { data = std::make_unique<train::DataStream>(train::load_documents(a.data)); });
  });
  train::Trainer trainer(comm, model_config(a), a.optim,
                         {.attn_dtype = parse_train_dtype(a.dtype), .threads = a.threads,
                          .cp_scheme = parse_scheme(a.cp_scheme, "--cp-scheme"), .cp_inner = a.cp_inner,
                          .split = parse_split(a.split),
                          .rope_local_offsets = a.rope_local, .skip_nonfinite = a.skip_nonfinite,
                          .testing_nan_at_step = a.testing_nan_at_step},
                         a.seed, mesh_config(a));
  // Each rank reads --data itself: all must have read the same documents (their bytes, in
  // order; copies under other paths are the same data), or they would train on different
  // tokens, silently or until a later collective disagrees.
  with_flag("--data", [&] {
    Fingerprint fp;
    fp.add("documents", static_cast<int64_t>(data->documents().size()))
        .add("tokens per epoch", data->total_tokens())
        .add("hash of the documents' bytes", static_cast<int64_t>(train::data_content_hash(data->documents())));
    agree(comm, fp, "the documents each rank read");
  });
  // The data identity a checkpoint holds (names and bytes) is rank 0's on every rank: the
  // bytes agree, and a rank whose copy lies under another path resumes as rank 0 does.
  std::array<int64_t, 1> data_id{rank == 0 ? static_cast<int64_t>(train::data_identity(data->documents())) : 0};
  comm.broadcast<int64_t>(data_id, 0);
  const train::RunIdentity identity{.seq_len = a.seq_len, .data_hash = static_cast<uint64_t>(data_id[0]),
                                    .micro = a.micro};
  if (!a.resume.empty()) {
    train::DataPosition pos;
    with_flag("--resume", [&] { pos = trainer.load(a.resume, identity); });
    on_every_rank(comm, [&] { with_flag("--resume", [&] { data->seek(pos); }); });
    // (It trained nothing, re-saved the checkpoint and exited 0: a --steps mistaken for the
    // steps still to run looked like a finished run.)
    CPATTN_CHECK(trainer.steps_done() <= a.steps, "--steps ", a.steps, " is below the checkpoint's step ",
                 trainer.steps_done(), " (--resume '", a.resume, "'): --steps is the total to train up to");
  }
  JsonLog log;  // a resumed run appends to its log, after the records of the steps before its checkpoint
  on_every_rank(comm, [&] {
    if (rank == 0 && !a.json_log.empty()) log.open(a.json_log, a.resume.empty() ? -1 : trainer.steps_done());
  });
  const auto save = [&] {
    on_every_rank(comm, [&] {
      if (rank == 0) log.sync();
    });
    with_flag("--save", [&] { trainer.save(a.save, data->position(), identity); });
  };
  install_stop_handlers();

  if (rank == 0) {
    int64_t mine = 0;  // with experts: this rank's share (params() also holds the all-reduce's alignment)
    for (const train::ParamTensor& t : trainer.tensors()) mine += t.size;
    const int64_t experts = int64_t{3} * a.model.layers * a.model.dim * a.model.ffn_dim() * a.model.experts;
    const int64_t params = mine + experts / a.ep * (a.ep - 1);
    std::printf("cpattn train: cp = %d, %d layers, dim %d, %d heads / %d kv heads, ffn %d, %lld parameters",
                a.cp, a.model.layers, a.model.dim, a.model.heads, a.model.kv_heads, a.model.ffn_dim(),
                static_cast<long long>(params));
    if (a.ep > 1) std::printf(" (%lld on each rank: experts / ep)", static_cast<long long>(mine));
    std::printf("\n");
    std::printf("  mesh: dp %d x cp %d x pp %d, schedule %s, %d micro-batch(es) of %lld tokens per step\n", a.dp,
                a.cp, a.pp, a.schedule.c_str(), a.micro, static_cast<long long>(a.seq_len));
    if (a.model.moe()) {
      std::printf("  experts: %d per block, top-%d, %s router, ep %d (%d experts per rank)", a.model.experts,
                  a.model.top_k, a.router.c_str(), a.ep, a.model.experts / a.ep);
      if (a.capacity_factor) std::printf(", capacity factor %g (drop by %s)", *a.capacity_factor, a.drop_policy.c_str());
      if (a.aux_loss_coeff > 0) std::printf(", aux loss coeff %g", a.aux_loss_coeff);
      std::printf("\n");
    }
    std::printf("  data: %zu documents, %lld tokens per epoch; seq-len %lld; attention %s; %d thread(s) per rank%s\n",
                data->documents().size(), static_cast<long long>(data->total_tokens()),
                static_cast<long long>(a.seq_len), a.dtype.c_str(), a.threads,
                a.resume.empty() ? "" : (", resumed at step " + std::to_string(trainer.steps_done())).c_str());
    std::printf("  attention: causal, cp scheme %s", a.cp_scheme.c_str());
    if (a.cp_inner != 0) std::printf(" (all-to-all groups of %d)", a.cp_inner);
    if (!a.window.empty()) std::printf(", window %s", a.window.c_str());
    if (a.softcap > 0.0f) std::printf(", softcap %g", static_cast<double>(a.softcap));
    if (a.model.dropout > 0.0f) std::printf(", dropout %g", static_cast<double>(a.model.dropout));
    std::printf("%s\n", a.alibi ? ", alibi" : "");
    std::fflush(stdout);
  }

  // Where the ranks that meet an error in a step meet, to learn whether every rank met it (its own
  // communicator: the step's may hold the others' collectives, posted before the error).
  Communicator step_errors(MPI_COMM_WORLD, {.timeout_s = std::min(kStepErrorWaitS, comm.timeout_s() / 2),
                                            .timeout_name = "--timeout / 2 (at most 10 s: the wait for every rank "
                                                            "to meet a step's error)",
                                            .on_timeout = TimeoutAction::throw_error,
                                            .print_timeout = false});
  std::vector<StepRow> rows;
  const auto t_start = Clock::now();
  int stop_signal = 0;
  for (int64_t s = trainer.steps_done(); s < a.steps; ++s) {
    std::vector<train::PackedSequence> seqs;
    for (int i = 0; i < a.micro; ++i) seqs.push_back(data->next(a.seq_len));
    const auto t0 = Clock::now();
    train::StepStats st;
    try {
      if (s == a.testing_rank_error_at_step && rank == comm.size() - 1)
        throw Error("testing: an error on rank " + std::to_string(rank) + " alone before step " + std::to_string(s));
      st = trainer.step(seqs);
    } catch (const std::exception& e) {
      // Not an input error. A step's errors are agreed (a non-finite loss or gradient norm, the
      // CP layer's agreement), and rank 0 says them; an error only some ranks meet (out of memory
      // on one, say) leaves the others in the step's collectives until --timeout, and this rank's
      // message would be lost (its exit waits in MPI_Finalize for theirs): such a rank says it
      // itself and ends the job.
      const auto* error = dynamic_cast<const Error*>(&e);
      const std::string what = error != nullptr ? error->message() : std::string("unexpected error: ") + e.what();
      if (!every_rank_met_it(step_errors)) {
        std::fprintf(stderr, "cpattn: error (rank %d): %s (not every rank met this error: the others did not "
                     "reach it within %g s; ending the job)\n", rank, what.c_str(), step_errors.timeout_s());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      if (rank == 0) std::fprintf(stderr, "cpattn: error: %s\n", what.c_str());
      throw ExitCode{1};
    }
    std::array<double, 1> dt{std::chrono::duration<double>(Clock::now() - t0).count()};
    comm.all_reduce<double>(dt, ReduceOp::max);  // a step takes as long as its slowest rank
    // Each rank's peak memory and rows (its tokens of the step's micro-batches, padding
    // included: the split's cost), in one collective.
    const std::array<double, 2> mine{peak_rss_mb(), static_cast<double>(st.local_tokens)};
    std::vector<double> gathered(static_cast<std::size_t>(2 * comm.size()));
    comm.all_gather<double>(mine, gathered);
    std::vector<double> rss;
    std::vector<int64_t> local_rows;
    for (std::size_t r = 0; r < gathered.size(); r += 2) {
      rss.push_back(gathered[r]);
      local_rows.push_back(static_cast<int64_t>(gathered[r + 1]));
    }
    StepRow row{st.step, st.loss, st.grad_norm, st.lr, dt[0], static_cast<double>(a.micro * a.seq_len) / dt[0], rss};
    std::string log_error;
    if (rank == 0 && st.skipped) {
      std::printf("step %5lld | skipped: loss %g, grad norm %g (non-finite; %lld skipped so far)\n",
                  static_cast<long long>(st.step), st.loss, st.grad_norm,
                  static_cast<long long>(trainer.skipped_steps()));
      std::fflush(stdout);
      if (log.fd >= 0) {
        const nlohmann::json j = {{"step", st.step}, {"skipped", true}, {"loss", st.loss},
                                  {"aux_loss", st.aux_loss}, {"grad_norm", st.grad_norm}, {"lr", st.lr},
                                  {"cp", a.cp}};
        try {
          log.write(j.dump() + "\n");
        } catch (const Error& e) {
          log_error = e.message();
        }
      }
    } else if (rank == 0) {
      const double max_rss = *std::max_element(rss.begin(), rss.end());
      if (st.step % a.print_every == 0 || s + 1 == a.steps) {
        std::printf("step %5lld | loss %.4f | ", static_cast<long long>(st.step), st.loss);
        if (a.model.moe()) std::printf("aux %.4g | ", st.aux_loss);
        std::printf("grad norm %7.4f | lr %.2e | %8.0f tok/s | %.3f s | peak MB", st.grad_norm, st.lr,
                    row.tokens_per_s, row.step_s);
        for (const double m : rss) std::printf(" %.1f", m);
        std::printf("\n");
        std::fflush(stdout);
      }
      if (log.fd >= 0 && st.step == a.testing_log_full_at_step) log.fill_disk();
      if (log.fd >= 0) {
        const nlohmann::json j = {{"step", st.step},          {"loss", st.loss},
                                  {"grad_norm", st.grad_norm}, {"lr", st.lr},
                                  {"step_s", row.step_s},      {"tokens_per_s", row.tokens_per_s},
                                  {"tokens", st.tokens},       {"peak_rss_mb", max_rss},
                                  {"peak_rss_mb_per_rank", rss}, {"local_tokens_per_rank", local_rows},
                                  {"cp", a.cp},
                                  {"dp", a.dp},                {"pp", a.pp},
                                  {"aux_loss", st.aux_loss},   {"dropped", st.dropped},
                                  {"experts", a.model.experts}, {"ep", a.ep}};
        try {
          log.write(j.dump() + "\n");
        } catch (const Error& e) {
          log_error = e.message();
        }
      }
    }
    on_every_rank(comm, [&] { CPATTN_CHECK(log_error.empty(), log_error); });
    if (!st.skipped) rows.push_back(std::move(row));
    // A signal on any rank stops every rank after the same step.
    int64_t sig = g_stop_signal;
    comm.all_reduce<int64_t>(std::span(&sig, 1), ReduceOp::max);
    if (sig != 0) {
      stop_signal = static_cast<int>(sig);
      break;
    }
    if (a.save_every > 0 && trainer.steps_done() % a.save_every == 0 && s + 1 < a.steps) {
      save();
      if (rank == 0) {
        std::printf("saved step %lld to %s\n", static_cast<long long>(trainer.steps_done()), a.save.c_str());
        std::fflush(stdout);
      }
    }
  }
  const double total_s = std::chrono::duration<double>(Clock::now() - t_start).count();
  on_every_rank(comm, [&] {
    if (rank == 0) log.sync();
  });
  if (!a.save.empty()) {
    save();
    if (rank == 0) std::printf("saved step %lld to %s\n", static_cast<long long>(trainer.steps_done()), a.save.c_str());
  }
  if (stop_signal != 0) {
    if (rank == 0) {
      std::fflush(stdout);
      std::fprintf(stderr, "cpattn: stopped by %s after step %lld%s\n", stop_signal == SIGINT ? "SIGINT" : "SIGTERM",
                   static_cast<long long>(trainer.steps_done()),
                   a.save.empty() ? " (no --save: nothing saved)" : (": checkpoint in " + a.save).c_str());
    }
    throw ExitCode{128 + stop_signal};
  }
  if (rank == 0) {
    print_summary(rows, a.cp, total_s);
    if (trainer.skipped_steps() > 0)
      std::printf("  %-28s %lld\n", "skipped steps (non-finite)", static_cast<long long>(trainer.skipped_steps()));
  }
}

// ---- --compare: one MPI job per CP size ---------------------------------------------------------

// argv of `train` for one CP size, from the parsed flags.
// `a` with the sizes of one --compare entry: "4" is --cp 4; "dp2xcp2", "cp2xpp2", "dp2xcp2xpp2"
// (any order, each axis at most once) set those axes and leave the others at 1.
TrainArgs with_compare_shape(const TrainArgs& a, const std::string& entry) {
  TrainArgs c = a;
  c.dp = c.cp = c.pp = 1;
  const auto bad = [&entry] {
    return Error("--compare: '" + entry + "' is neither a CP size nor a mesh shape such as dp2xcp2xpp2");
  };
  if (!entry.empty() && std::all_of(entry.begin(), entry.end(), ::isdigit)) {
    if (entry.size() > 6) throw bad();
    c.cp = std::stoi(entry);
    return c;
  }
  std::vector<bool> seen(3, false);
  for (std::size_t begin = 0; begin <= entry.size();) {
    const std::size_t end = std::min(entry.find('x', begin), entry.size());
    const std::string part = entry.substr(begin, end - begin);
    const std::string axis = part.substr(0, 2), n = part.size() > 2 ? part.substr(2) : "";
    const int which = axis == "dp" ? 0 : axis == "cp" ? 1 : axis == "pp" ? 2 : -1;
    if (which < 0 || seen[which] || n.empty() || n.size() > 6 || !std::all_of(n.begin(), n.end(), ::isdigit)) throw bad();
    seen[which] = true;
    (which == 0 ? c.dp : which == 1 ? c.cp : c.pp) = std::stoi(n);
    begin = end + 1;
  }
  return c;
}

std::string compare_label(const TrainArgs& c) {
  if (c.dp == 1 && c.pp == 1) return "cp" + std::to_string(c.cp);
  std::string l;
  for (const auto& [name, n] : {std::pair{"dp", c.dp}, std::pair{"cp", c.cp}, std::pair{"pp", c.pp}})
    if (n > 1) l += (l.empty() ? "" : "x") + std::string(name) + std::to_string(n);
  return l;
}

std::vector<std::string> child_args(const TrainArgs& a, const std::string& log) {
  const int cp = a.cp;
  const auto f = [](double x) {
    char b[64];
    std::snprintf(b, sizeof b, "%.17g", x);  // round-trips a double (%.9g only a float)
    return std::string(b);
  };
  std::vector<std::string> v = {"train", "--cp", std::to_string(cp), "--layers", std::to_string(a.model.layers),
                                "--dim", std::to_string(a.model.dim), "--heads", std::to_string(a.model.heads),
                                "--kv-heads", std::to_string(a.model.kv_heads), "--seq-len", std::to_string(a.seq_len),
                                "--steps", std::to_string(a.steps), "--seed", std::to_string(a.seed),
                                "--lr", f(a.optim.lr), "--warmup", std::to_string(a.optim.warmup),
                                "--weight-decay", f(a.optim.weight_decay), "--clip", f(a.optim.clip),
                                "--dtype", a.dtype, "--split", a.split, "--threads", std::to_string(a.threads),
                                "--cp-scheme", a.cp_scheme, "--softcap", f(a.softcap), "--dropout", f(a.model.dropout),
                                "--print-every", std::to_string(a.print_every),
                                "--json-log", log, "--dp", std::to_string(a.dp), "--pp", std::to_string(a.pp),
                                "--micro", std::to_string(a.micro), "--schedule", a.schedule};
  if (a.virtual_stages) v.insert(v.end(), {"--virtual", std::to_string(*a.virtual_stages)});
  if (a.timeout) v.insert(v.end(), {"--timeout", f(*a.timeout)});
  if (a.model.moe()) {
    v.insert(v.end(), {"--experts", std::to_string(a.model.experts), "--top-k", std::to_string(a.model.top_k),
                       "--ep", std::to_string(a.ep), "--router", a.router, "--drop-policy", a.drop_policy,
                       "--aux-loss-coeff", f(a.aux_loss_coeff), "--bias-update-rate", f(a.bias_update_rate)});
    if (a.capacity_factor) v.insert(v.end(), {"--capacity-factor", f(*a.capacity_factor)});
  }
  if (!a.resume.empty()) v.insert(v.end(), {"--resume", a.resume});
  if (a.skip_nonfinite) v.emplace_back("--skip-nonfinite");
  if (!a.window.empty()) v.insert(v.end(), {"--window", a.window});
  if (a.alibi) v.emplace_back("--alibi");
  if (a.cp_inner != 0) v.insert(v.end(), {"--cp-inner", std::to_string(a.cp_inner)});
  if (!a.data.empty()) {
    v.emplace_back("--data");
    v.insert(v.end(), a.data.begin(), a.data.end());
  }
  return v;
}

void compare_run(const TrainArgs& a) {
  std::vector<TrainArgs> shapes;
  std::vector<CompareRun> runs;
  for (const std::string& entry : a.compare) {
    // The shape's own errors name its entry ("--compare '0': --cp must be >= 1, got 0").
    rewrite_errors([&] {
      shapes.push_back(with_compare_shape(a, entry));
      check_args(shapes.back());
    }, [&entry](const std::string& m) { return m.starts_with("--compare") ? m : "--compare '" + entry + "': " + m; });
    const std::string label = compare_label(shapes.back());
    // Two entries of one shape ("1,cp1", "cp2,dp1xcp2") would write one log twice: the second
    // run's replaced the first's and the table compared two copies of one log.
    for (std::size_t i = 0; i < runs.size(); ++i)
      CPATTN_CHECK(runs[i].label != label, "--compare: '", entry, "' is the shape of '", a.compare[i], "' (", label,
                   "): give each shape once");
    runs.push_back({label, shapes.back().dp * shapes.back().cp * shapes.back().pp});
  }
  CPATTN_CHECK(a.json_log.empty() && a.save.empty(), "--compare writes its own logs: drop --json-log and --save");
  if (!a.compare_svg.empty()) {
    check_output_path(a.compare_svg, "--svg");
    check_not_into_data(a, "--svg", a.compare_svg, data_tree_of(a));
    CPATTN_CHECK(a.resume.empty() || !same_file(a.compare_svg, a.resume), "--svg '", a.compare_svg,
                 "' is the file of --resume '", a.resume, "': the chart would replace the checkpoint");
  }
  compare_runs({.runs = runs,
                .mpirun = a.mpirun,
                .print_every = a.print_every,
                .svg = a.compare_svg,
                .train_args = [&shapes](std::size_t i, const std::string& log) { return child_args(shapes[i], log); }});
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  CLI::App* cmd = app.add_subcommand(
      "train",
      "Train a small causal LM on packed documents with context parallelism. Launch as: "
      "mpirun -np N cpattn train --cp N [flags] (plain `cpattn train` for CP=1). See docs/training.md.");
  cmd->add_option("--cp", a->cp, "Context-parallel size; --dp * --cp * --pp must equal the MPI world size")
      ->capture_default_str();
  cmd->add_option("--split", a->split, "How each sequence's documents are cut over the CP ranks: padded "
                                       "(TransformerEngine's) or padding-free (docs/planner.md)")
      ->capture_default_str()
      ->transform(split_transformer());
  cmd->add_option("--dp", a->dp, "Data-parallel replicas (each takes --micro / --dp sequences per step)")
      ->capture_default_str();
  cmd->add_option("--pp", a->pp, "Pipeline stages (the blocks split over them)")->capture_default_str();
  cmd->add_option("--micro", a->micro, "Sequences (micro-batches) per step, all replicas together")
      ->capture_default_str();
  cmd->add_option("--schedule", a->schedule, "Pipeline schedule: gpipe, 1f1b, interleaved or zb-h1")
      ->capture_default_str();
  cmd->add_option("--virtual", a->virtual_stages, "Model chunks per stage for --schedule interleaved (default 2)");
  cmd->add_option("--layers", a->model.layers, "Transformer blocks")->capture_default_str();
  cmd->add_option("--experts", a->model.experts,
                  "Mixture of experts: E SwiGLU experts replace every block's MLP (0: the dense MLP)")
      ->capture_default_str();
  cmd->add_option("--top-k", a->model.top_k, "Experts per token K (1..--experts)")->capture_default_str();
  cmd->add_option("--ep", a->ep, "Expert-parallel size: divides --experts and --dp * --cp (EP folded over them)")
      ->capture_default_str();
  cmd->add_option("--capacity-factor", a->capacity_factor,
                  "Each expert keeps at most ceil(C * tokens * K / E) of a group's assignments (default: no limit)");
  cmd->add_option("--drop-policy", a->drop_policy, "Which assignments over capacity are dropped: position or probability")
      ->capture_default_str();
  cmd->add_option("--router", a->router, "softmax (top-k of softmax) or sigmoid-bias (auxiliary-loss-free)")
      ->capture_default_str();
  cmd->add_option("--aux-loss-coeff", a->aux_loss_coeff,
                  "Weight of the Switch load-balancing loss, added to the training loss (softmax router)")
      ->capture_default_str();
  cmd->add_option("--bias-update-rate", a->bias_update_rate,
                  "sigmoid-bias router: the selection bias's step per training step")
      ->capture_default_str();
  cmd->add_option("--dim", a->model.dim, "Model width")->capture_default_str();
  cmd->add_option("--heads", a->model.heads, "Query heads")->capture_default_str();
  cmd->add_option("--kv-heads", a->model.kv_heads, "Key/value heads (GQA)")->capture_default_str();
  cmd->add_option("--seq-len", a->seq_len, "Tokens per packed sequence (one sequence per micro-batch, --micro per step)")
      ->capture_default_str();
  cmd->add_option("--steps", a->steps, "Total optimizer steps (a resumed run continues up to this step)")
      ->capture_default_str();
  cmd->add_option("--seed", a->seed, "Seed of the weight initialization")->capture_default_str();
  cmd->add_option("--lr", a->optim.lr, "Peak learning rate (constant after the warm-up)")->capture_default_str();
  cmd->add_option("--warmup", a->optim.warmup, "Steps of linear learning-rate warm-up")->capture_default_str();
  cmd->add_option("--weight-decay", a->optim.weight_decay, "AdamW weight decay (matrices only)")
      ->capture_default_str();
  cmd->add_option("--clip", a->optim.clip, "Clip the global gradient norm to this (0: off)")->capture_default_str();
  cmd->add_option("--dtype", a->dtype, "Attention storage type: fp32 or bf16 (or float32, bfloat16)")
      ->transform(dtype_transformer(kTrainDtypes, "cpattn train"))->capture_default_str();
  cmd->add_option("--cp-scheme", a->cp_scheme, "How attention's K/V reach the queries: " + scheme_names() +
                                                 " (as cpattn run --scheme; every scheme trains to the same curve)")
      ->transform(scheme_transformer("--cp-scheme"))->capture_default_str();
  cmd->add_option("--cp-inner", a->cp_inner, "--cp-scheme hybrid: ranks of one all-to-all group (consecutive ranks, "
                                             "dividing --cp; the K/V travel between the groups)");
  cmd->add_option("--window", a->window, "Sliding attention window LEFT,RIGHT (FlashAttention's window_size; "
                                         "-1 = unbounded; RIGHT has no effect under the causal mask)");
  cmd->add_option("--softcap", a->softcap, "Attention logit soft cap (0 = off): scores become X * tanh(s / X)")
      ->capture_default_str();
  cmd->add_option("--dropout", a->model.dropout, "Hidden dropout of each block's attention and MLP outputs before "
                  "their residual adds, in [0, 1) (0 = off; training steps only), masks keyed by each token's "
                  "document and global position: every --cp drops the same entries")
      ->capture_default_str();
  cmd->add_flag("--alibi", a->alibi, "ALiBi attention biases with the standard slopes 2^(-8 (h + 1) / heads)");
  cmd->add_option("--threads", a->threads, "BLAS and attention threads per rank")->capture_default_str();
  cmd->add_option("--data", a->data, "Files or folders, one document per file (default: " +
                                         std::string(train::kDefaultDataDir) + ")")->check(path_flag());
  cmd->add_option("--json-log", a->json_log, "Write one JSON object per step to FILE")->check(path_flag());
  cmd->add_option("--save", a->save, "Save a checkpoint to FILE at the end (and on SIGTERM/SIGINT)")->check(path_flag());
  cmd->add_option("--save-every", a->save_every, "Also save the checkpoint every N steps (needs --save)")
      ->capture_default_str();
  cmd->add_flag("--skip-nonfinite", a->skip_nonfinite,
                "Skip the update of a step whose loss or gradient norm is not finite (and count it) "
                "instead of stopping with an error");
  cmd->add_option("--testing-log-full-at-step", a->testing_log_full_at_step,
                  "Testing only: the --json-log disk is full (writes fail with ENOSPC) from this step on")
      ->group("");
  cmd->add_option("--testing-nan-at-step", a->testing_nan_at_step, "Testing only: a NaN loss at this step")
      ->group("");
  cmd->add_option("--testing-rank-error-at-step", a->testing_rank_error_at_step,
                  "Testing only: the last rank alone meets an error before this step")
      ->group("");
  cmd->add_option("--resume", a->resume, "Resume from a checkpoint FILE (any CP size)")->check(path_flag());
  cmd->add_option("--compare", a->compare,
                  "Run the same training at each CP size or mesh shape, e.g. 1,2,dp2xcp2,cp2xpp2, and compare")
      ->delimiter(',');
  cmd->add_option("--svg", a->compare_svg, "With --compare: draw every run's loss curve on one chart in FILE")->check(path_flag());
  cmd->add_option("--mpirun", a->mpirun, "mpirun used by --compare")->capture_default_str();
  add_timeout_option(cmd, a->timeout);
  cmd->add_option("--print-every", a->print_every, "Print every Nth step")->capture_default_str();
  cmd->add_flag("--rope-local-offsets", a->rope_local,
                "Testing only: RoPE on each token's local offset instead of its global position (wrong for cp > 1)")
      ->group("");
  cmd->callback([a] {
    CPATTN_CHECK(a->compare_svg.empty() || !a->compare.empty(), "--svg needs --compare (it draws the compared runs)");
    if (!a->compare.empty())
      compare_run(*a);
    else
      train_run(*a);
  });
}

}  // namespace cpattn::cli
