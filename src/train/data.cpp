// Documents, the token stream and sequence packing (include/cpattn/train.hpp).
#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/train.hpp>

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <system_error>
#include <utility>

namespace cpattn::train {

namespace fs = std::filesystem;

namespace {

std::vector<uint8_t> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  CPATTN_CHECK(in.good(), "cannot read data file '", p.string(), "'");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CPATTN_CHECK(!in.bad(), "error while reading data file '", p.string(), "'");
  return bytes;
}

}  // namespace

DataTree data_tree(std::span<const std::string> paths) {
  std::vector<std::string> roots(paths.begin(), paths.end());
  if (roots.empty()) roots.emplace_back(kDefaultDataDir);
  std::map<fs::path, FileId> files;  // canonical, sorted, each once
  DataTree tree;
  // A regular file by its canonical name and identity; on an error `ec` says which, nothing added
  // (each caller then fails naming the file).
  const auto add_file = [&files](const fs::path& p, std::error_code& ec) {
    fs::path canonical = fs::canonical(p, ec);
    if (ec) return;
    const std::optional<FileId> id = file_id(canonical.string());
    if (!id) {
      ec.assign(errno, std::generic_category());
      return;
    }
    files.emplace(std::move(canonical), *id);
  };
  // Folder links are followed, each folder entered once over all roots (tree.folders, by
  // identity, is the walk's guard): two links back to a folder (d/l1 -> ., d/l2 -> .) made the
  // walk exponential in the depth, a run that never started. A folder whose identity cannot be
  // read is walked (its listing then fails, naming it).
  const auto first_entry = [&tree](const fs::path& dir) {
    const std::optional<FileId> id = file_id(dir.string());
    if (!id) return true;
    std::error_code cec;
    const fs::path canonical = fs::canonical(dir, cec);
    return tree.folders.try_emplace(*id, cec ? dir.string() : canonical.string()).second;
  };
  for (const std::string& root : roots) {
    std::error_code ec;
    const fs::file_status st = fs::status(root, ec);
    CPATTN_CHECK(!ec && fs::exists(st), "load_documents: paths: no such file or folder '", root, "'");
    if (fs::is_directory(st)) {
      first_entry(root);
      for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::follow_directory_symlink, ec);
           !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        if (it->is_directory(ec) && !first_entry(it->path())) it.disable_recursion_pending();
        if (it->is_regular_file(ec)) {  // (a dangling link is none: its error is cleared by the next step)
          add_file(it->path(), ec);
          CPATTN_CHECK(!ec, "load_documents: paths: cannot resolve '", it->path().string(), "' in folder '", root,
                       "': ", ec.message());
        }
      }
      CPATTN_CHECK(!ec, "load_documents: paths: cannot list folder '", root, "': ", ec.message());
    } else {
      CPATTN_CHECK(fs::is_regular_file(st), "load_documents: paths: '", root, "' is neither a file nor a folder");
      add_file(root, ec);
      CPATTN_CHECK(!ec, "load_documents: paths: cannot read '", root, "': ", ec.message());
    }
  }
  for (const auto& [f, id] : files) {
    tree.files.push_back(f.string());
    tree.file_ids.push_back(id);
  }
  return tree;
}

std::vector<Document> load_documents(std::span<const std::string> paths) {
  std::vector<std::string> roots(paths.begin(), paths.end());
  if (roots.empty()) roots.emplace_back(kDefaultDataDir);
  const DataTree tree = data_tree(roots);
  std::vector<Document> docs;
  for (const std::string& f : tree.files) {
    Document d{f, read_file(f)};
    if (!d.bytes.empty()) docs.push_back(std::move(d));
  }
  std::string where;
  for (const std::string& r : roots) where += (where.empty() ? "'" : ", '") + r + "'";
  CPATTN_CHECK(!docs.empty(), "load_documents: paths: no non-empty document in ", where, " (", tree.files.size(),
               " file(s) found, all empty)");
  return docs;
}

DataStream::DataStream(std::vector<Document> docs) : docs_(std::move(docs)) {
  CPATTN_CHECK(!docs_.empty(), "DataStream needs at least one document");
}

int64_t DataStream::total_tokens() const {
  int64_t n = 0;
  for (const Document& d : docs_) n += static_cast<int64_t>(d.bytes.size()) + 1;
  return n;
}

void DataStream::seek(const DataPosition& pos) {
  CPATTN_CHECK(pos.doc >= 0 && pos.doc < static_cast<int64_t>(docs_.size()) && pos.offset >= 0 &&
                   pos.offset <= static_cast<int64_t>(docs_[pos.doc].bytes.size()) && pos.epoch >= 0,
               "data position (document ", pos.doc, ", token ", pos.offset,
               ") lies outside these documents (", docs_.size(),
               "): the position comes from a run over other data");
  pos_ = pos;
}

PackedSequence DataStream::next(int64_t seq_len) {
  CPATTN_CHECK(seq_len >= 1, "DataStream::next: seq_len must be >= 1, got ", seq_len);
  PackedSequence s;
  s.tokens.reserve(seq_len);
  s.labels.reserve(seq_len);
  s.positions.reserve(seq_len);
  s.cu_seqlens.push_back(0);
  while (static_cast<int64_t>(s.tokens.size()) < seq_len) {
    const std::vector<uint8_t>& b = docs_[pos_.doc].bytes;
    const auto n = static_cast<int64_t>(b.size());  // document tokens: n bytes, then end-of-document
    const int64_t take = std::min(seq_len - static_cast<int64_t>(s.tokens.size()), n + 1 - pos_.offset);
    for (int64_t i = pos_.offset; i < pos_.offset + take; ++i) {
      s.tokens.push_back(i < n ? int64_t{b[i]} : kEndOfDocument);
      s.labels.push_back(i + 1 < n ? int64_t{b[i + 1]} : i + 1 == n ? kEndOfDocument : kIgnoreIndex);
      s.positions.push_back(i - pos_.offset);
    }
    s.cu_seqlens.push_back(static_cast<int64_t>(s.tokens.size()));
    pos_.offset += take;
    if (pos_.offset == n + 1) {
      pos_.offset = 0;
      if (++pos_.doc == static_cast<int64_t>(docs_.size())) {
        pos_.doc = 0;
        ++pos_.epoch;
      }
    }
  }
  return s;
}

}  // namespace cpattn::train
