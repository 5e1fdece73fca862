// `cpattn plan`: the load-balancing plan of one packed batch, as a table or JSON.
#include <cpattn/error.hpp>
#include <cpattn/file.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/memory.hpp>
#include <cpattn/plan.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>

#include "commands.hpp"
#include "vocab.hpp"

namespace cpattn::cli {

std::vector<int64_t> read_lengths_file(const std::string& path) {
  // (a FIFO, a device or a folder refused without blocking)
  const std::vector<std::byte> bytes = with_flag("--lengths-file", [&] { return read_regular_file(path); });
  std::istringstream in(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  return parse_lengths_file(in, path);
}

std::vector<int64_t> parse_lengths_file(std::istream& in, const std::string& path) {
  std::vector<int64_t> lengths;
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
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
  std::string split = "padded";  // canonical (vocab.hpp)
  std::string svg;
};

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

// Both splits' padding and balance, side by side (the table's last lines, JSON "splits").
struct SplitSummary {
  BalanceReport padded, padding_free;
};

void print_splits(const SplitSummary& s) {
  std::printf("\n%-13s %10s %9s %10s %10s %12s\n", "split", "padding", "padding%", "imbalance", "bound",
              "lower_bound");
  for (const BalanceReport* b : {&s.padded, &s.padding_free})
    std::printf("%-13s %10lld %8.2f%% %10.4f %10.4f %12.4f\n", std::string(to_string(b->split)).c_str(),
                static_cast<long long>(b->padding_tokens()), b->padding_percent(), b->imbalance_balanced,
                b->imbalance_bound, b->imbalance_lower_bound);
}

nlohmann::json splits_json(const SplitSummary& s) {
  nlohmann::json out = nlohmann::json::array();
  for (const BalanceReport* b : {&s.padded, &s.padding_free})
    out.push_back({{"split", to_string(b->split)},
                   {"padded_tokens", b->padded_tokens},
                   {"padding_tokens", b->padding_tokens()},
                   {"padding_percent", b->padding_percent()},
                   {"imbalance", b->imbalance_balanced},
                   {"imbalance_bound", b->imbalance_bound},
                   {"imbalance_lower_bound", b->imbalance_lower_bound}});
  return out;
}

void print_table(const BalanceReport& b, const std::vector<int64_t>& cu) {
  std::printf("cpattn plan: %zu documents, %lld tokens, cp = %d, split %s\n", cu.size() - 1,
              static_cast<long long>(b.real_tokens), b.cp, std::string(to_string(b.split)).c_str());
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
// The most entries --json writes (about 1 GB of text): every rank lists its
// global_token_index and kv_gather_index, together up to (cp + 1) times the padded batch,
// which at cp = 4096 and many documents is terabytes, and per document its two tasks' lengths
// and key runs (up to 2 cp + 1 a rank, each an object of three numbers: four entries' text).
constexpr int64_t kMaxJsonEntries = int64_t{1} << 27;

// Refuses --json past kMaxJsonEntries, from the boundaries alone (before the balance reports,
// which at cp = 4096 and many documents take seconds themselves). (Counting the index lists
// alone, 100 one-token documents at --cp 256 wrote 488 MB under a bound of about 98 MB.)
void check_json_size(const std::vector<int64_t>& cu, int cp, CpSplit split) {
  const int64_t tokens = split == CpSplit::padded ? pad_cu_seqlens(cu, cp).back() : cu.back();
  const auto docs = static_cast<double>(cu.size() - 1), c = static_cast<double>(cp);
  const double entries = static_cast<double>(tokens) * (c + 1) + docs * c * (4 + 4 * (2 * c + 1));
  CPATTN_CHECK(entries <= static_cast<double>(kMaxJsonEntries), "--json: the plan of ", cu.size() - 1, " documents (",
               tokens, split == CpSplit::padded ? " padded" : "", " tokens) at --cp ", cp, " lists about ",
               static_cast<int64_t>(std::min(entries, 9e18)), " entries ((cp + 1) x ", tokens,
               " index entries, and each rank's tasks and key runs of every document), past --json's bound of ",
               kMaxJsonEntries, " (about 1 GB of text); the table (without --json) summarizes any size");
}

void print_json(const BalanceReport& b, const std::vector<int64_t>& cu, const SplitSummary& both) {
  nlohmann::json head;
  head["cp"] = b.cp;
  head["split"] = to_string(b.split);
  head["cu_seqlens"] = cu;
  head["cu_seqlens_padded"] = b.split == CpSplit::padded ? pad_cu_seqlens(cu, b.cp) : cu;
  head["seq_len"] = b.real_tokens;
  head["padded_tokens"] = b.padded_tokens;
  head["padding_tokens"] = b.padding_tokens();
  head["padding_percent"] = b.padding_percent();
  head["imbalance"] = {{"balanced", b.imbalance_balanced},
                       {"contiguous", b.imbalance_contiguous},
                       {"bound", b.imbalance_bound},
                       {"lower_bound", b.imbalance_lower_bound}};
  head["splits"] = splits_json(both);
  std::string text = head.dump();
  text.pop_back();  // the closing brace: "ranks" follows
  std::cout << text << ",\"ranks\":[";
  RankPlan p;  // reused: one rank's plan in memory at a time
  for (const RankBalance& r : b.ranks) {
    get_thd_load_balanced_cp_metadata(cu, b.cp, r.rank, PlanOptions{.split = b.split}, p);
    std::cout << (r.rank == 0 ? "" : ",") << rank_json(r, p).dump();
    CPATTN_CHECK(std::cout.good(), "--json: writing standard output failed at rank ", r.rank);
  }
  std::cout << "]}\n" << std::flush;
  CPATTN_CHECK(std::cout.good(), "--json: writing standard output failed");
}

// One row per document (the first kMaxSvgDocs), its chunks coloured by rank and drawn to
// scale against the longest document, padding paler; below, each rank's visible pairs.
constexpr std::size_t kMaxSvgDocs = 120;

void write_plan_svg(const std::string& path, const std::vector<int64_t>& cu, const SplitLayout& layout,
                    const BalanceReport& b) {
  static const char* const kColours[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
                                         "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac", "#1f77b4", "#8c564b"};
  const std::size_t docs = cu.size() - 1, shown = std::min(docs, kMaxSvgDocs);
  const int64_t n = chunks_per_document(layout.cp);
  int64_t longest = 1;
  for (std::size_t d = 0; d < docs; ++d)
    longest = std::max(longest, layout.chunks[(d + 1) * n - 1].pos + layout.chunks[(d + 1) * n - 1].len);
  const double left = 70, width = 800, row = 14, top = 40;
  const double bars_top = top + static_cast<double>(shown) * row + 40, bar_h = 18;
  const double height = bars_top + b.cp * (bar_h + 4) + 40;
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << left + width + 40 << "\" height=\"" << height
    << "\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << left << "\" y=\"20\" font-size=\"13\">cpattn plan: " << docs << " documents, "
    << b.real_tokens << " tokens, cp = " << b.cp << ", split " << to_string(b.split) << ", padding "
    << b.padding_tokens() << " tokens; colour = rank" << (shown < docs ? " (first documents only)" : "")
    << "</text>\n";
  for (std::size_t d = 0; d < shown; ++d) {
    const double y = top + static_cast<double>(d) * row;
    const int64_t len = cu[d + 1] - cu[d];
    o << "<text x=\"" << left - 6 << "\" y=\"" << y + 10 << "\" text-anchor=\"end\">doc " << d << "</text>\n";
    for (int64_t m = 0; m < n; ++m) {
      const DocChunk& c = layout.chunks[d * n + m];
      if (c.len == 0) continue;
      const double x = left + width * static_cast<double>(c.pos) / static_cast<double>(longest);
      const double w = std::max(0.5, width * static_cast<double>(c.len) / static_cast<double>(longest));
      const bool padding = c.pos >= len;
      o << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << row - 2 << "\" fill=\""
        << kColours[c.rank % 12] << "\" fill-opacity=\"" << (padding ? 0.3 : 1.0)
        << "\" stroke=\"white\" stroke-width=\"0.5\"><title>document " << d << " chunk " << m << ": rank " << c.rank
        << ", positions " << c.pos << ".." << c.pos + c.len - 1 << (padding ? " (padding)" : "")
        << "</title></rect>\n";
    }
  }
  int64_t most = 1;
  for (const RankBalance& r : b.ranks) most = std::max(most, r.balanced.visible_pairs);
  o << "<text x=\"" << left << "\" y=\"" << bars_top - 8 << "\" font-size=\"13\">visible pairs per rank (imbalance "
    << b.imbalance_balanced << ", bound " << b.imbalance_bound << ")</text>\n";
  for (const RankBalance& r : b.ranks) {
    const double y = bars_top + r.rank * (bar_h + 4);
    const double w = width * 0.8 * static_cast<double>(r.balanced.visible_pairs) / static_cast<double>(most);
    o << "<text x=\"" << left - 6 << "\" y=\"" << y + 13 << "\" text-anchor=\"end\">rank " << r.rank << "</text>\n"
      << "<rect x=\"" << left << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << bar_h << "\" fill=\""
      << kColours[r.rank % 12] << "\"/>\n<text x=\"" << left + w + 6 << "\" y=\"" << y + 13 << "\">"
      << r.balanced.visible_pairs << " pairs, " << r.local_tokens << " tokens</text>\n";
  }
  o << "</svg>\n";
  const std::string text = o.str();
  with_flag("--svg", [&] { write_file_atomically(path, std::as_bytes(std::span(text.data(), text.size()))); });
}

// What planning holds at once, refused with both sizes before it starts (20,000 documents at
// --cp 65536 are 84 GB of chunks: it was a bare std::bad_alloc): one split's chunk table, 2 x cp
// chunks per document (each balance report, and the SVG, build theirs one at a time), and both
// reports' rows of every rank. (--json's per-rank plans are bounded by check_json_size.)
void check_plan_memory(const std::vector<int64_t>& cu, int cp, const std::string& source) {
  const auto docs = static_cast<uint64_t>(cu.size() - 1), ranks = static_cast<uint64_t>(cp);
  const uint64_t chunks = saturating_add(saturating_mul(saturating_mul(docs, 2 * ranks), sizeof(DocChunk)),
                                         (ranks + 1) * sizeof(int64_t));
  const uint64_t rows = 2 * ranks * sizeof(RankBalance);
  check_memory(saturating_add(chunks, rows),
               "cpattn plan of " + std::to_string(docs) + " documents (" + source + ") at --cp " + std::to_string(cp),
               "chunk table " + format_bytes(chunks) + ", per-rank rows " + format_bytes(rows));
}

void run_plan(const PlanArgs& a) {
  std::vector<int64_t> cu;
  const char* source = "the built-in example";  // the flag that gave the boundaries
  if (!a.cu_seqlens.empty()) {
    source = "--cu-seqlens";
    check_cu_seqlens(a.cu_seqlens, kUnknownTokens, source);
    cu = a.cu_seqlens;
  } else if (!a.ends.empty()) {
    source = "--ends";
    cu = cu_seqlens_from_ends(a.ends, kUnknownTokens, source);
  } else if (!a.lengths_file.empty()) {
    source = "--lengths-file";
    cu = cu_seqlens_from_lengths(read_lengths_file(a.lengths_file), source);
  } else if (!a.lengths.empty()) {
    source = "--lengths";
    cu = cu_seqlens_from_lengths(a.lengths, source);
  } else {
    cu = cu_seqlens_from_lengths(kExampleLengths);
  }
  check_cp_size(a.cp, "--cp");
  const CpSplit split = parse_split(a.split);
  if (!a.svg.empty()) {  // before any work
    check_output_path(a.svg, "--svg");
    CPATTN_CHECK(a.lengths_file.empty() || !same_file(a.svg, a.lengths_file), "--svg '", a.svg,
                 "' is the file of --lengths-file '", a.lengths_file, "': the drawing would replace its input");
  }
  if (a.json) check_json_size(cu, a.cp, split);
  check_plan_memory(cu, a.cp, a.lengths_file.empty() ? std::string(source) : "--lengths-file " + a.lengths_file);
  // With --cp and --split checked, what the planner still refuses is the boundaries' own
  // (documents too long to count their pairs in int64): named by the flag that gave them.
  const SplitSummary both = with_flag(source, [&] {
    return SplitSummary{balance_report(cu, a.cp, CpSplit::padded), balance_report(cu, a.cp, CpSplit::padding_free)};
  });
  const BalanceReport& b = split == CpSplit::padded ? both.padded : both.padding_free;
  if (a.json) {
    print_json(b, cu, both);
  } else {
    print_table(b, cu);
    print_splits(both);
  }
  if (!a.svg.empty()) write_plan_svg(a.svg, cu, split_layout(cu, a.cp, split), b);
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
                 ->delimiter(',')->check(int64_value());
  auto* ends = cmd->add_option("--ends", args->ends,
                               "Document ends without the leading 0 (actual_seq_qlen form): 16,40")
                   ->delimiter(',')->check(int64_value());
  auto* lengths = cmd->add_option("--lengths", args->lengths,
                                  "Document lengths, packed in order into one batch: 16,24")
                      ->delimiter(',')->check(int64_value());
  auto* file = cmd->add_option("--lengths-file", args->lengths_file,
                               "File with one document length per line ('#' starts a comment), "
                               "packed in order into one batch")->check(path_flag());
  cu->excludes(ends, lengths, file);
  ends->excludes(lengths, file);
  lengths->excludes(file);
  cmd->add_option("--cp", args->cp, "Context-parallel size (ranks), >= 1")->capture_default_str();
  cmd->add_option("--split", args->split,
                  "How documents are cut: padded (TransformerEngine's, the default) or padding-free; the "
                  "table ends with both side by side")
      ->transform(split_transformer())
      ->capture_default_str();
  cmd->add_option("--svg", args->svg,
                  "Also draw which rank holds which chunk of each document, and the work per rank, into "
                  "this SVG file")->check(path_flag());
  cmd->add_flag("--json", args->json,
                "Print one JSON object: cp, cu_seqlens_padded, ranks (with the metadata of each "
                "rank) and imbalance");
  cmd->callback([args] { run_plan(*args); });
}

}  // namespace cpattn::cli
