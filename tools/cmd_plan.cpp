// `cpattn plan`: the load-balancing plan of one packed batch, as a table or JSON.
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>

#include "commands.hpp"

namespace cpattn::cli {

std::vector<int64_t> read_lengths_file(const std::string& path) {
  std::ifstream in(path);
  CPATTN_CHECK(in.good(), "--lengths-file: cannot open '", path, "'");
  std::vector<int64_t> lengths;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    const auto hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    std::istringstream fields(line);
    std::string word, extra;
    if (!(fields >> word)) continue;
    CPATTN_CHECK(!(fields >> extra), "--lengths-file ", path, ":", line_no,
                 ": expected one document length per line, got '", line, "'");
    std::size_t used = 0;
    long long value = 0;
    try {
      value = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    CPATTN_CHECK(used == word.size() && value >= 1, "--lengths-file ", path, ":", line_no,
                 ": a document length must be an integer >= 1, got '", word, "'");
    lengths.push_back(value);
  }
  CPATTN_CHECK(!lengths.empty(), "--lengths-file ", path, ": holds no document length");
  return lengths;
}

namespace {

// The built-in example: a realistic mix of long and short documents, some needing padding.
const std::vector<int64_t> kExampleLengths{3000, 120, 900, 1, 2047, 64, 1500, 361};

struct PlanArgs {
  std::vector<int64_t> cu_seqlens, ends, lengths;
  std::string lengths_file;
  int cp = 2;
  bool json = false;
};

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

void print_table(const BalanceReport& b, const std::vector<int64_t>& cu) {
  std::printf("cpattn plan: %zu documents, %lld tokens, cp = %d\n", cu.size() - 1,
              static_cast<long long>(b.real_tokens), b.cp);
  std::printf("padding: %lld tokens (%.2f%% of the real tokens), padded batch %lld tokens\n\n",
              static_cast<long long>(b.padding_tokens()), b.padding_percent(),
              static_cast<long long>(b.padded_tokens));
  // Work columns count real (query, key) pairs only, padding excluded (docs/planner.md).
  std::printf("%-5s %12s %9s %7s %16s %16s   %12s %16s\n", "rank", "local_tokens", "padding",
              "tasks", "rect_work", "visible_pairs", "contig_tok", "contig_visible");
  for (const RankBalance& r : b.ranks)
    std::printf("%-5d %12lld %9lld %7lld %16lld %16lld   %12lld %16lld\n", r.rank,
                static_cast<long long>(r.local_tokens), static_cast<long long>(r.padding_tokens),
                static_cast<long long>(r.tasks), static_cast<long long>(r.balanced.rect_work),
                static_cast<long long>(r.balanced.visible_pairs),
                static_cast<long long>(r.contiguous_tokens),
                static_cast<long long>(r.contiguous.visible_pairs));
  std::printf("\nimbalance (max/mean real visible pairs): balanced %.4f, contiguous %.4f\n",
              b.imbalance_balanced, b.imbalance_contiguous);
}

// One rank's metadata, as print_json writes it.
nlohmann::json rank_json(const RankBalance& r, const RankPlan& p) {
  nlohmann::json runs = nlohmann::json::array();
  for (const AttnTask& t : p.work.tasks) {
    nlohmann::json task_runs = nlohmann::json::array();
    for (int64_t i = t.run_begin; i < t.run_end; ++i)
      task_runs.push_back({{"row", p.work.runs[i].row}, {"len", p.work.runs[i].len}, {"pos", p.work.runs[i].pos}});
    runs.push_back(std::move(task_runs));
  }
  return {{"rank", r.rank},
          {"local_tokens", r.local_tokens},
          {"padding_tokens", r.padding_tokens},
          {"tasks", r.tasks},
          {"rect_work", r.balanced.rect_work},
          {"visible_pairs", r.balanced.visible_pairs},
          {"contiguous_tokens", r.contiguous_tokens},
          {"contiguous_rect_work", r.contiguous.rect_work},
          {"contiguous_visible_pairs", r.contiguous.visible_pairs},
          {"global_token_index", p.global_token_index},
          {"actual_seq_qlen", p.actual_seq_qlen},
          {"actual_seq_kvlen", p.actual_seq_kvlen},
          {"kv_gather_index", p.kv_gather_index},
          {"kv_runs", std::move(runs)}};
}

// Streamed one rank at a time: the output grows with cp times the batch (every rank's index
// lists), the memory held only with one rank's plan (cp = 4096 with many documents is
// gigabytes of text, never gigabytes of JSON objects). A failed write is an error.
// The most index entries --json writes (about 1 GB of text): every rank lists its
// global_token_index and kv_gather_index, together up to (cp + 1) times the padded batch,
// which at cp = 4096 and many documents is terabytes.
constexpr int64_t kMaxJsonEntries = int64_t{1} << 27;

void print_json(const BalanceReport& b, const std::vector<int64_t>& cu) {
  const int64_t entries = b.padded_tokens > kMaxJsonEntries / (b.cp + 1) ? kMaxJsonEntries + 1
                                                                         : b.padded_tokens * (b.cp + 1);
  CPATTN_CHECK(entries <= kMaxJsonEntries, "--json: the plan of ", cu.size() - 1, " documents (", b.padded_tokens,
               " padded tokens) at --cp ", b.cp, " lists up to (cp + 1) x ", b.padded_tokens,
               " index entries, past --json's bound of ", kMaxJsonEntries,
               " (about 1 GB of text); the table (without --json) summarizes any size");
  nlohmann::json head;
  head["cp"] = b.cp;
  head["cu_seqlens"] = cu;
  head["cu_seqlens_padded"] = pad_cu_seqlens(cu, b.cp);
  head["seq_len"] = b.real_tokens;
  head["padded_tokens"] = b.padded_tokens;
  head["padding_tokens"] = b.padding_tokens();
  head["padding_percent"] = b.padding_percent();
  head["imbalance"] = {{"balanced", b.imbalance_balanced}, {"contiguous", b.imbalance_contiguous}};
  std::string text = head.dump();
  text.pop_back();  // the closing brace: "ranks" follows
  std::cout << text << ",\"ranks\":[";
  RankPlan p;  // reused: one rank's plan in memory at a time
  for (const RankBalance& r : b.ranks) {
    get_thd_load_balanced_cp_metadata(cu, b.cp, r.rank, p);
    std::cout << (r.rank == 0 ? "" : ",") << rank_json(r, p).dump();
    CPATTN_CHECK(std::cout.good(), "--json: writing standard output failed at rank ", r.rank);
  }
  std::cout << "]}\n" << std::flush;
  CPATTN_CHECK(std::cout.good(), "--json: writing standard output failed");
}

void run_plan(const PlanArgs& a) {
  std::vector<int64_t> cu;
  if (!a.cu_seqlens.empty()) {
    check_cu_seqlens(a.cu_seqlens, kUnknownTokens, "--cu-seqlens");
    cu = a.cu_seqlens;
  } else if (!a.ends.empty()) {
    cu = cu_seqlens_from_ends(a.ends, kUnknownTokens, "--ends");
  } else if (!a.lengths_file.empty()) {
    cu = cu_seqlens_from_lengths(read_lengths_file(a.lengths_file), "--lengths-file");
  } else if (!a.lengths.empty()) {
    cu = cu_seqlens_from_lengths(a.lengths, "--lengths");
  } else {
    cu = cu_seqlens_from_lengths(kExampleLengths);
  }
  check_cp_size(a.cp, "--cp");
  const BalanceReport b = balance_report(cu, a.cp);
  if (a.json)
    print_json(b, cu);
  else
    print_table(b, cu);
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Plan the load-balanced CP split of one packed batch: per-rank tokens, padding, tasks and "
      "work, against the plain contiguous split. Without boundaries, plans a built-in example "
      "batch (document lengths " + join(kExampleLengths) + ").");
  auto* cu = cmd->add_option("--cu-seqlens", args->cu_seqlens,
                             "Document boundaries with a leading 0, comma-separated: 0,16,40")
                 ->delimiter(',');
  auto* ends = cmd->add_option("--ends", args->ends,
                               "Document ends without the leading 0 (actual_seq_qlen form): 16,40")
                   ->delimiter(',');
  auto* lengths = cmd->add_option("--lengths", args->lengths,
                                  "Document lengths, packed in order into one batch: 16,24")
                      ->delimiter(',');
  auto* file = cmd->add_option("--lengths-file", args->lengths_file,
                               "File with one document length per line ('#' starts a comment), "
                               "packed in order into one batch");
  cu->excludes(ends, lengths, file);
  ends->excludes(lengths, file);
  lengths->excludes(file);
  cmd->add_option("--cp", args->cp, "Context-parallel size (ranks), >= 1")->capture_default_str();
  cmd->add_flag("--json", args->json,
                "Print one JSON object: cp, cu_seqlens_padded, ranks (with the metadata of each "
                "rank) and imbalance");
  cmd->callback([args] { run_plan(*args); });
}

}  // namespace cpattn::cli
