// write_file_atomically and check_output_path (include/cpattn/file.hpp): refused targets, a
// followed symlink, a failing write that leaves the old file and no temporary behind; and
// read_regular_file, file_id, same_file, writes_into, lies_below.
#include <cpattn/error.hpp>
#include <cpattn/file.hpp>
#include <cpattn/npy.hpp>

#include "temp_dir.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace cpattn {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using cpattn::testing::TempDir;

std::span<const std::byte> bytes(const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); }

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "no error";
}

// Only the target itself in the folder: no temporary file left behind.
std::size_t entries(const fs::path& d) { return static_cast<std::size_t>(std::distance(fs::directory_iterator(d), {})); }

TEST(SafeFile, WritesAndReplacesARegularFile) {
  TempDir t;
  write_file_atomically(t / "a", bytes("first"));
  EXPECT_EQ(slurp(t / "a"), "first");
  ::chmod((t / "a").c_str(), 0640);
  write_file_atomically(t / "a", bytes("second, longer"));
  EXPECT_EQ(slurp(t / "a"), "second, longer");
  EXPECT_EQ(fs::status(t / "a").permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);  // kept
  EXPECT_EQ(entries(t.dir), 1u);
}

TEST(SafeFile, RefusesAFifoADirectoryAndADeviceBeforeAnyWork) {
  TempDir t;
  ASSERT_EQ(::mkfifo((t / "fifo").c_str(), 0600), 0);
  EXPECT_THAT(message_of([&] { write_file_atomically(t / "fifo", bytes("x")); }), HasSubstr("is a FIFO"));
  EXPECT_TRUE(fs::is_fifo(t / "fifo"));
  fs::create_directory(t / "sub");
  EXPECT_THAT(message_of([&] { write_file_atomically(t / "sub", bytes("x")); }), HasSubstr("is a folder"));
  EXPECT_TRUE(fs::is_directory(t / "sub"));
  EXPECT_THAT(message_of([&] { check_output_path("/dev/full", "--save"); }),
              HasSubstr("--save: '/dev/full' is a character device, not a regular file"));
  EXPECT_THAT(message_of([&] { write_npy("/dev/null", std::vector<float>{1.0f}, {1}); }),
              HasSubstr("character device"));
  EXPECT_THAT(message_of([&] { check_output_path(t / "missing/x", "--json-log"); }),
              HasSubstr("--json-log: the folder"));
  EXPECT_EQ(entries(t.dir), 2u);  // no temporary file
}

TEST(SafeFile, FollowsASymlinkAndKeepsIt) {
  TempDir t;
  fs::create_directory(t / "real");
  write_file_atomically(t / "real/target", bytes("old"));
  fs::create_symlink("real/target", t / "link");  // relative, from the link's folder
  write_file_atomically(t / "link", bytes("new"));
  EXPECT_TRUE(fs::is_symlink(t / "link"));
  EXPECT_EQ(slurp(t / "real/target"), "new");
  EXPECT_EQ(entries(t.dir / "real"), 1u);
  fs::create_symlink(t / "real/fresh", t / "dangling");  // a link to a file not there yet
  write_file_atomically(t / "dangling", bytes("made"));
  EXPECT_TRUE(fs::is_symlink(t / "dangling"));
  EXPECT_EQ(slurp(t / "real/fresh"), "made");
  ASSERT_EQ(::mkfifo((t / "real/fifo").c_str(), 0600), 0);
  fs::create_symlink(t / "real/fifo", t / "to-fifo");
  EXPECT_THAT(message_of([&] { write_file_atomically(t / "to-fifo", bytes("x")); }), HasSubstr("is a FIFO"));
}

TEST(SafeFile, ReadsOnlyARegularFileWhole) {
  TempDir t;
  write_file_atomically(t / "a", bytes("contents"));
  const std::vector<std::byte> got = read_regular_file(t / "a");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(got.data()), got.size()), "contents");
  write_file_atomically(t / "empty", bytes(""));
  EXPECT_TRUE(read_regular_file(t / "empty").empty());
  ASSERT_EQ(::mkfifo((t / "fifo").c_str(), 0600), 0);  // no writer: open() must not wait for one
  EXPECT_THAT(message_of([&] { read_regular_file(t / "fifo"); }), HasSubstr("is a FIFO, not a regular file"));
  EXPECT_THAT(message_of([&] { read_regular_file(t.dir.string()); }), HasSubstr("is a folder, not a regular file"));
  EXPECT_THAT(message_of([&] { read_regular_file("/dev/zero"); }),
              HasSubstr("'/dev/zero' is a character device, not a regular file"));
  EXPECT_THAT(message_of([&] { read_regular_file(t / "missing"); }), HasSubstr("cannot read it: No such file"));
}

// read_npy reads through read_regular_file: a FIFO blocked it for ever (seen: the test ran
// into its time limit), a folder said "basic_filebuf::underflow"; now both are named at once.
TEST(SafeFile, ReadNpyRefusesAFifoAndAFolder) {
  TempDir t;
  ASSERT_EQ(::mkfifo((t / "q.npy").c_str(), 0600), 0);
  EXPECT_EQ(message_of([&] { read_npy(t / "q.npy"); }), "'" + t / "q.npy" + "' is a FIFO, not a regular file");
  EXPECT_EQ(message_of([&] { read_npy(t.dir.string()); }), "'" + t.dir.string() + "' is a folder, not a regular file");
}

TEST(SafeFile, SameFileByInodeOrByFolderAndName) {
  TempDir t;
  write_file_atomically(t / "a", bytes("x"));
  write_file_atomically(t / "b", bytes("x"));
  fs::create_directory(t / "sub");
  fs::create_symlink("../a", t / "sub/link");
  EXPECT_TRUE(same_file(t / "a", t / "a"));
  EXPECT_TRUE(same_file(t / "a", t / "sub/../a"));
  EXPECT_TRUE(same_file(t / "sub/link", t / "a"));  // through the link
  EXPECT_FALSE(same_file(t / "a", t / "b"));        // the same bytes, another file
  EXPECT_TRUE(same_file(t / "new", t / "sub/../new"));  // neither exists: the folder and the name
  EXPECT_FALSE(same_file(t / "new", t / "sub/new"));
  EXPECT_FALSE(same_file(t / "new", t / "a"));  // one exists, the other not
  // file_id: the identity stat gives, through links and hard links; none for a missing name.
  struct stat st {};
  ASSERT_EQ(::stat((t / "a").c_str(), &st), 0);
  const std::optional<FileId> a = file_id(t / "a");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->device, static_cast<std::uint64_t>(st.st_dev));
  EXPECT_EQ(a->inode, static_cast<std::uint64_t>(st.st_ino));
  fs::create_hard_link(t / "a", t / "hard");
  EXPECT_EQ(file_id(t / "hard"), a);
  EXPECT_EQ(file_id(t / "sub/link"), a);
  EXPECT_NE(file_id(t / "b"), a);
  EXPECT_EQ(file_id(t / "new"), std::nullopt);
  EXPECT_EQ(file_id(t / "sub"), file_id(t / "sub/../sub"));  // a folder too
}

// A name of 250 bytes (NAME_MAX is 255) is written whole: the temporary name was the name
// plus 12 bytes, "File name too long" only when the write came (seen failing before the fix).
TEST(SafeFile, WritesALongValidName) {
  TempDir t;
  const std::string name(250, 'n');
  write_file_atomically(t / name, bytes("long"));
  EXPECT_EQ(slurp(t / name), "long");
  EXPECT_EQ(entries(t.dir), 1u);
}

// An output into an input: its file (by name or link), or any file below its folder, there or
// not yet; beside it (a sibling folder whose name starts the same) is not.
TEST(SafeFile, WritesIntoAFileOrBelowAFolder) {
  TempDir t;
  fs::create_directories(t / "data/sub");
  write_file_atomically(t / "data/doc.txt", bytes("x"));
  fs::create_directory(t / "data2");
  fs::create_symlink(t / "data/doc.txt", t / "link");
  fs::create_directory_symlink(t / "data", t / "data-link");
  EXPECT_TRUE(writes_into(t / "data/doc.txt", t / "data/doc.txt"));
  EXPECT_TRUE(writes_into(t / "link", t / "data/doc.txt"));
  EXPECT_TRUE(writes_into(t / "data/new.ckpt", t / "data"));
  EXPECT_TRUE(writes_into(t / "data/sub/new.ckpt", t / "data-link"));
  EXPECT_TRUE(writes_into(t / "data-link/sub/../new.ckpt", t / "data/"));
  EXPECT_TRUE(writes_into(t / "link", t / "data"));  // the link's target lies in the folder
  EXPECT_FALSE(writes_into(t / "data2/new.ckpt", t / "data"));
  EXPECT_FALSE(writes_into(t / "new.ckpt", t / "data"));
  EXPECT_FALSE(writes_into(t / "data/new.ckpt", t / "data/doc.txt"));
  EXPECT_FALSE(writes_into(t / "new.ckpt", t / "missing"));
  // A relative name from inside the folder (`cd data && ... --save new.ckpt`): it was compared
  // as written, relative, and no folder is a prefix of that.
  const fs::path cwd = fs::current_path();
  fs::current_path(t / "data");
  const std::string where = output_location("new.ckpt");
  const bool into = writes_into("new.ckpt", t / "data");
  fs::current_path(cwd);
  EXPECT_EQ(where, (fs::canonical(t / "data") / "new.ckpt").string());
  EXPECT_TRUE(into);
}

// lies_below on canonical names: by components, the folder itself included.
TEST(SafeFile, LiesBelowComparesComponents) {
  EXPECT_TRUE(lies_below("/data", "/data"));
  EXPECT_TRUE(lies_below("/data/sub/x.ckpt", "/data"));
  EXPECT_TRUE(lies_below("/x", "/"));
  EXPECT_FALSE(lies_below("/data2/x.ckpt", "/data"));
  EXPECT_FALSE(lies_below("/dat", "/data"));
  EXPECT_FALSE(lies_below("/other/data/x", "/data"));
  EXPECT_TRUE(lies_below("/data/x", "/data/"));  // a trailing separator is no component
  EXPECT_TRUE(lies_below("/data/", "/data"));
  EXPECT_FALSE(lies_below("/data2/", "/data/"));
}

// message_of(f) with files limited to 4096 bytes (RLIMIT_FSIZE; SIGXFSZ ignored: the write
// fails with EFBIG, as one on a full disk with ENOSPC).
std::string under_4096_byte_files(const std::function<void()>& f) {
  rlimit old{};
  EXPECT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 4096;
  EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string msg = message_of(f);
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  return msg;
}

// A write that fails midway (the file-size limit, as a full disk would: EFBIG like ENOSPC):
// an error naming the path, the old file intact, no temporary file left.
TEST(SafeFile, AFailingWriteLeavesTheOldFileAndNoTemporary) {
  TempDir t;
  write_file_atomically(t / "keep", bytes("precious"));
  const std::string big(100000, 'x');
  const std::string msg = under_4096_byte_files([&] { write_file_atomically(t / "keep", bytes(big)); });
  EXPECT_THAT(msg, HasSubstr(t / "keep"));
  EXPECT_THAT(msg, HasSubstr("write failed after 4096 of 100000 bytes"));
  EXPECT_EQ(slurp(t / "keep"), "precious");
  EXPECT_EQ(entries(t.dir), 1u);
}

// A set of files (cpattn run --npy-out's five): the third failing to write (EFBIG, as a full
// disk) leaves all three old files as they were and no temporary file (write_npy one file at a
// time replaced the first two: a set part new, part old). Then the whole set is replaced.
TEST(SafeFile, ASetOfFilesIsReplacedOnlyWhenEveryOneIsWritten) {
  TempDir t;
  for (const char* name : {"a", "b", "c"}) write_file_atomically(t / name, bytes(std::string("old ") + name));
  const std::string big(100000, 'x'), new_a = "new a", new_b = "new b", new_c = "new c", x = "x";
  const std::string a = t / "a", b = t / "b", c = t / "c";
  // (the spans view these strings: each alive for the whole test)
  const FileBytes set[] = {{a, bytes(new_a)}, {b, bytes(new_b)}, {c, bytes(big)}};
  const std::string msg = under_4096_byte_files([&] { write_files_atomically(set); });
  EXPECT_THAT(msg, HasSubstr(c));
  EXPECT_THAT(msg, HasSubstr("write failed after 4096 of 100000 bytes"));
  EXPECT_EQ(slurp(a), "old a");
  EXPECT_EQ(slurp(b), "old b");
  EXPECT_EQ(slurp(c), "old c");
  EXPECT_EQ(entries(t.dir), 3u);
  // A refused path (a folder) fails the set before any file is written (every path is checked
  // first): no temporary file either.
  fs::create_directory(t / "d");
  const FileBytes refused[] = {{a, bytes(new_a)}, {t / "d", bytes(x)}};
  EXPECT_THAT(message_of([&] { write_files_atomically(refused); }), HasSubstr("is a folder"));
  EXPECT_EQ(slurp(a), "old a");
  EXPECT_EQ(entries(t.dir), 4u);
  const FileBytes fits[] = {{a, bytes(new_a)}, {b, bytes(new_b)}, {c, bytes(new_c)}};
  write_files_atomically(fits);
  EXPECT_EQ(slurp(a) + slurp(b) + slurp(c), "new anew bnew c");
  EXPECT_EQ(entries(t.dir), 4u);
}

TEST(SafeFile, AnUnwritableFolderIsFoundUpFront) {
  if (::geteuid() == 0) GTEST_SKIP() << "root writes into any folder";
  TempDir t;
  fs::create_directory(t / "ro");
  fs::permissions(t / "ro", fs::perms::owner_read | fs::perms::owner_exec);
  EXPECT_THAT(message_of([&] { check_output_path(t / "ro/x", "--save"); }), HasSubstr("is not writable"));
  fs::permissions(t / "ro", fs::perms::owner_all);
}

}  // namespace
}  // namespace cpattn
