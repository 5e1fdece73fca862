// Documents and packing of the training data (include/cpattn/train.hpp): no MPI.
#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/train.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace cpattn::train {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

// "abc" and "de": the stream is a b c EOD d e EOD | a b c EOD ...
DataStream two_docs() { return DataStream({{"x", bytes("abc")}, {"y", bytes("de")}}); }

TEST(TrainData, PacksDocumentsWithLabelsAndPositions) {
  DataStream s = two_docs();
  const int64_t E = kEndOfDocument, I = kIgnoreIndex;
  const PackedSequence p = s.next(7);
  EXPECT_THAT(p.tokens, ElementsAreArray(std::vector<int64_t>{'a', 'b', 'c', E, 'd', 'e', E}));
  EXPECT_THAT(p.labels, ElementsAreArray(std::vector<int64_t>{'b', 'c', E, I, 'e', E, I}));
  EXPECT_THAT(p.positions, ElementsAreArray(std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2}));
  EXPECT_THAT(p.cu_seqlens, ElementsAreArray(std::vector<int64_t>{0, 4, 7}));
  EXPECT_EQ(s.position(), (DataPosition{0, 0, 1}));  // wrapped: epoch 1
  EXPECT_EQ(s.total_tokens(), 7);
}

TEST(TrainData, DocumentCutAtTheEndContinuesAsANewSegment) {
  DataStream s = two_docs();
  const int64_t E = kEndOfDocument, I = kIgnoreIndex;
  const PackedSequence p1 = s.next(2);
  EXPECT_THAT(p1.tokens, ElementsAreArray(std::vector<int64_t>{'a', 'b'}));
  EXPECT_THAT(p1.labels, ElementsAreArray(std::vector<int64_t>{'b', 'c'}));  // the label crosses the cut
  EXPECT_THAT(p1.cu_seqlens, ElementsAreArray(std::vector<int64_t>{0, 2}));
  EXPECT_EQ(s.position(), (DataPosition{0, 2, 0}));
  const PackedSequence p2 = s.next(6);
  EXPECT_THAT(p2.tokens, ElementsAreArray(std::vector<int64_t>{'c', E, 'd', 'e', E, 'a'}));
  EXPECT_THAT(p2.labels, ElementsAreArray(std::vector<int64_t>{E, I, 'e', E, I, 'b'}));
  EXPECT_THAT(p2.positions, ElementsAreArray(std::vector<int64_t>{0, 1, 0, 1, 2, 0}));  // the continuation restarts at 0
  EXPECT_THAT(p2.cu_seqlens, ElementsAreArray(std::vector<int64_t>{0, 2, 5, 6}));
  // Seeking back replays the same sequence.
  s.seek({0, 2, 0});
  const PackedSequence again = s.next(6);
  EXPECT_EQ(again.tokens, p2.tokens);
  EXPECT_EQ(again.labels, p2.labels);
  EXPECT_THROW(s.seek({2, 0, 0}), Error);
  EXPECT_THROW(s.seek({1, 3, 0}), Error);
}

struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "cpattn-train-data-XXXXXX").string();
    path = mkdtemp(t.data());
  }
  ~TempDir() { fs::remove_all(path); }
  void write(const std::string& name, const std::string& text) const {
    fs::create_directories((path / name).parent_path());
    std::ofstream(path / name, std::ios::binary) << text;
  }
};

TEST(TrainData, LoadsFoldersInSortedOrderSkippingEmptyFilesAndDuplicates) {
  TempDir d;
  d.write("b.txt", "second");
  d.write("a.txt", "first");
  d.write("sub/c.txt", "third");
  d.write("empty.txt", "");
  fs::create_symlink(d.path / "a.txt", d.path / "z-link.txt");
  const std::vector<std::string> paths = {d.path.string(), (d.path / "b.txt").string()};
  const std::vector<Document> docs = load_documents(paths);
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[0].bytes, bytes("first"));
  EXPECT_EQ(docs[1].bytes, bytes("second"));
  EXPECT_EQ(docs[2].bytes, bytes("third"));
}

// Two links back to the folder (and one from a subfolder up to it): each folder is entered
// once, each file counted once. The walk was exponential in the depth (it never returned: the
// test ran into its time limit).
TEST(TrainData, FolderLinkLoopsAreWalkedOnce) {
  TempDir d;
  d.write("a.txt", "first");
  d.write("sub/b.txt", "second");
  fs::create_directory_symlink(".", d.path / "l1");
  fs::create_directory_symlink(".", d.path / "l2");
  fs::create_directory_symlink("..", d.path / "sub" / "up");
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> paths = {d.path.string()};
  const std::vector<Document> docs = load_documents(paths);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs[0].bytes, bytes("first"));
  EXPECT_EQ(docs[1].bytes, bytes("second"));
}

// data_tree: what the loading reads and the folders its walk enters, canonical, each once.
// A folder outside the root reached through a link is among the folders (an output there would
// become a document), a root named twice (as a folder and as its file) counts each file once, a
// link loop enters each folder once, and a dangling link is neither a file nor an error.
TEST(TrainData, DataTreeNamesEveryFileAndFolderTheWalkReaches) {
  TempDir d;
  d.write("data/a.txt", "first");
  d.write("data/sub/b.txt", "second");
  d.write("outside/c.txt", "third");
  fs::create_directory_symlink(d.path / "outside", d.path / "data" / "ext");
  fs::create_directory_symlink("..", d.path / "data" / "sub" / "up");
  fs::create_symlink(d.path / "missing.txt", d.path / "data" / "gone.txt");
  const fs::path root = fs::canonical(d.path);
  const std::vector<std::string> paths = {(d.path / "data").string(), (d.path / "data" / "a.txt").string()};
  const DataTree tree = data_tree(paths);
  EXPECT_THAT(tree.files, ElementsAreArray(std::vector<std::string>{
                              (root / "data/a.txt").string(), (root / "data/sub/b.txt").string(),
                              (root / "outside/c.txt").string()}));
  // Each folder by its identity, as a stat of its canonical name gives it.
  std::vector<std::string> folders;
  for (const auto& [id, name] : tree.folders) {
    EXPECT_EQ(file_id(name), id) << name;
    folders.push_back(name);
  }
  std::sort(folders.begin(), folders.end());
  EXPECT_THAT(folders, ElementsAreArray(std::vector<std::string>{
                           (root / "data").string(), (root / "data/sub").string(), (root / "outside").string()}));
  // Each file's identity, as a hard link to it has.
  ASSERT_EQ(tree.file_ids.size(), tree.files.size());
  fs::create_hard_link(d.path / "outside" / "c.txt", d.path / "hard.txt");
  EXPECT_EQ(file_id((d.path / "hard.txt").string()), tree.file_ids[2]);
  EXPECT_NE(tree.file_ids[0], tree.file_ids[2]);
  // A root below another, named first: its folders are entered once over both walks, and the
  // second walk still lists its own files.
  const std::vector<std::string> nested = {(d.path / "data" / "sub").string(), (d.path / "data").string()};
  const DataTree again = data_tree(nested);
  EXPECT_EQ(again.files, tree.files);
  EXPECT_EQ(again.file_ids, tree.file_ids);
  EXPECT_EQ(again.folders, tree.folders);
  // load_documents reads exactly these files.
  const std::vector<Document> docs = load_documents(paths);
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[2].bytes, bytes("third"));
}

TEST(TrainData, MissingOrEmptyDataIsAClearError) {
  TempDir d;
  const std::vector<std::string> missing = {(d.path / "nope").string()};
  try {
    load_documents(missing);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("no such file or folder"));
  }
  d.write("empty.txt", "");
  const std::vector<std::string> empty = {d.path.string()};
  try {
    load_documents(empty);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("no non-empty document"));
  }
}

TEST(TrainData, DefaultDataIsTheLicenseTexts) {
  if (!fs::exists(kDefaultDataDir)) GTEST_SKIP() << kDefaultDataDir << " is missing";
  const std::vector<Document> docs = load_documents({});
  EXPECT_GE(docs.size(), 5u);
  DataStream s(docs);
  EXPECT_GT(s.total_tokens(), 100000);
}

TEST(TrainData, ModelConfigDerivedSizes) {
  const ModelConfig m{.dim = 128, .heads = 4};
  EXPECT_EQ(m.head_dim(), 32);
  EXPECT_EQ(m.ffn_dim(), 352);
  EXPECT_EQ(min_seq_len(4), 8);
}

}  // namespace
}  // namespace cpattn::train
