// Output files written safely (include/cpattn/file.hpp).
#include <cpattn/error.hpp>
#include <cpattn/file.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <limits>
#include <system_error>
#include <vector>

namespace cpattn {

namespace {

const char* kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a folder";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

std::string folder_of(const std::string& path) {
  const std::filesystem::path p(path);
  const std::string d = p.parent_path().string();
  return d.empty() ? "." : d;
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

std::string resolve_output_path(const std::string& path) {
  std::string p = path;
  for (int hops = 0; hops < 40; ++hops) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return p;
    std::string target(PATH_MAX, '\0');
    const ssize_t n = ::readlink(p.c_str(), target.data(), target.size());
    CPATTN_CHECK(n >= 0, "'", path, "': cannot read the symbolic link '", p, "': ", errno_text());
    target.resize(static_cast<std::size_t>(n));
    p = target.starts_with('/') ? target : (std::filesystem::path(folder_of(p)) / target).string();
  }
  CPATTN_CHECK(false, "'", path, "': too many levels of symbolic links");
  return p;
}

void check_output_path(const std::string& path, std::string_view what) {
  const std::string pre = what.empty() ? std::string() : std::string(what) + ": ";
  CPATTN_CHECK(!path.empty(), pre, "the output path is empty");
  const std::string target = resolve_output_path(path);
  struct stat st {};
  if (::stat(target.c_str(), &st) == 0)
    CPATTN_CHECK(S_ISREG(st.st_mode), pre, "'", path, "' is ", kind_of(st.st_mode),
                 ", not a regular file: refusing to replace it");
  const std::string dir = folder_of(target);
  struct stat ds {};
  CPATTN_CHECK(::stat(dir.c_str(), &ds) == 0 && S_ISDIR(ds.st_mode), pre, "the folder '", dir, "' of '", path,
               "' does not exist");
  CPATTN_CHECK(::access(dir.c_str(), W_OK | X_OK) == 0, pre, "the folder '", dir, "' of '", path,
               "' is not writable: ", errno_text());
}

std::optional<FileId> file_id(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return FileId{static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}

bool same_file(const std::string& a, const std::string& b) {
  const std::string ra = resolve_output_path(a), rb = resolve_output_path(b);
  const std::optional<FileId> ia = file_id(ra), ib = file_id(rb);
  if (ia || ib) return ia == ib;
  // Neither exists yet: the same name in the same folder.
  const std::optional<FileId> da = file_id(folder_of(ra));
  return std::filesystem::path(ra).filename() == std::filesystem::path(rb).filename() && da &&
         da == file_id(folder_of(rb));
}

bool writes_into(const std::string& path, const std::string& input) {
  if (same_file(path, input)) return true;
  std::error_code ec;
  if (!std::filesystem::is_directory(input, ec)) return false;
  const std::filesystem::path root = std::filesystem::canonical(input, ec);
  if (ec) return false;
  const std::string out = output_location(path);
  return !out.empty() && lies_below(out, root.string());
}

std::string output_location(const std::string& path) {
  std::error_code ec;
  // (absolute first: weakly_canonical keeps a relative name whose first component does not exist
  // relative, which no canonical folder is a prefix of)
  const std::filesystem::path abs = std::filesystem::absolute(resolve_output_path(path), ec);
  if (ec) return {};
  const std::filesystem::path out = std::filesystem::weakly_canonical(abs, ec);
  return ec ? std::string() : out.string();
}

bool lies_below(const std::string& path, const std::string& folder) {
  const std::filesystem::path p(path), f(folder);
  // Component by component: /data2/x is not below /data. A trailing separator is an empty last
  // component: not one of the folder's to match.
  auto f_end = f.end();
  if (f_end != f.begin() && std::prev(f_end)->empty()) --f_end;
  return std::mismatch(f.begin(), f_end, p.begin(), p.end()).first == f_end;
}

std::vector<std::byte> read_regular_file(const std::string& path) {
  std::uint64_t size = 0;
  return read_file_prefix(path, std::numeric_limits<std::size_t>::max(), size);
}

std::vector<std::byte> read_file_prefix(const std::string& path, std::size_t max_bytes, std::uint64_t& size) {
  // O_NONBLOCK: opening a FIFO does not wait for a writer (it is then refused by its kind).
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  CPATTN_CHECK(fd >= 0, "'", path, "': cannot read it: ", errno_text());
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  CPATTN_CHECK(::fstat(fd, &st) == 0, "'", path, "': cannot stat it: ", errno_text());
  CPATTN_CHECK(S_ISREG(st.st_mode), "'", path, "' is ", kind_of(st.st_mode), ", not a regular file");
  const int flags = ::fcntl(fd, F_GETFL);  // reads block again (a network filesystem may say EAGAIN)
  CPATTN_CHECK(flags >= 0 && ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) == 0, "'", path, "': fcntl failed: ",
               errno_text());
  size = static_cast<std::uint64_t>(st.st_size);
  std::vector<std::byte> bytes(static_cast<std::size_t>(std::min<std::uint64_t>(size, max_bytes)));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    CPATTN_CHECK(n >= 0, "'", path, "': read failed after ", done, " of ", bytes.size(), " bytes: ", errno_text());
    CPATTN_CHECK(n > 0, "'", path, "' shrank while it was read: ", done, " of ", bytes.size(), " bytes");
    done += static_cast<std::size_t>(n);
  }
  return bytes;
}

void write_all(int fd, std::span<const std::byte> bytes, const std::string& path) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    CPATTN_CHECK(n > 0, "'", path, "': write failed after ", done, " of ", bytes.size(), " bytes: ",
                 n < 0 ? errno_text() : std::string("no progress"));
    done += static_cast<std::size_t>(n);
  }
}

namespace {

// The process's umask, read without changing it (/proc/self/status's Umask line, Linux 4.7+):
// umask(0) and back would give files another thread creates meanwhile mode 0666. Falls back to
// that where the line is missing.
mode_t current_umask() {
  if (std::FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    unsigned mask = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof line, f) != nullptr) found = std::sscanf(line, "Umask: %o", &mask) == 1;
    std::fclose(f);
    if (found) return static_cast<mode_t>(mask);
  }
  const mode_t mask = ::umask(0);
  ::umask(mask);
  return mask;
}

// A file written in full, fsynced and closed beside its target, not yet in its place.
struct Staged {
  std::string path, target, tmp;  // as given, after its links, the temporary file
};

Staged stage(const std::string& path, std::span<const std::byte> bytes) {
  check_output_path(path, {});
  Staged s{path, resolve_output_path(path), {}};
  const std::string dir = folder_of(s.target);
  // The temporary name is bounded: "." + name + ".tmp.XXXXXX" was 12 bytes past the name, so
  // a valid name of 244 to 255 bytes failed with "File name too long", after all the work.
  // At most the name's first kTmpNameChars bytes (enough to tell whose a leftover file is).
  constexpr std::size_t kTmpNameChars = 64;
  std::string tmp = dir;
  tmp.append("/.").append(std::filesystem::path(s.target).filename().string().substr(0, kTmpNameChars))
      .append(".tmp.XXXXXX");
  int fd = ::mkstemp(tmp.data());
  CPATTN_CHECK(fd >= 0, "'", path, "': cannot create a temporary file in '", dir, "': ", errno_text());
  try {
    struct stat old {};
    const mode_t mode = ::stat(s.target.c_str(), &old) == 0 ? old.st_mode & 07777 : 0666 & ~current_umask();
    CPATTN_CHECK(::fchmod(fd, mode) == 0, "'", path, "': cannot set the permissions: ", errno_text());
    write_all(fd, bytes, path);
    CPATTN_CHECK(::fsync(fd) == 0, "'", path, "': fsync failed: ", errno_text());
    const int rc = ::close(fd);
    fd = -1;
    CPATTN_CHECK(rc == 0, "'", path, "': close failed: ", errno_text());
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  s.tmp = std::move(tmp);
  return s;
}

}  // namespace

void write_files_atomically(std::span<const FileBytes> files) {
  for (const FileBytes& f : files) check_output_path(f.path, {});  // every path before any write
  std::vector<Staged> staged;
  staged.reserve(files.size());
  try {
    for (const FileBytes& f : files) staged.push_back(stage(f.path, f.bytes));
    for (Staged& s : staged) {
      CPATTN_CHECK(::rename(s.tmp.c_str(), s.target.c_str()) == 0, "'", s.path,
                   "': cannot rename the temporary file over it: ", errno_text());
      s.tmp.clear();  // in place
    }
  } catch (...) {
    for (const Staged& s : staged)
      if (!s.tmp.empty()) ::unlink(s.tmp.c_str());
    throw;
  }
  std::vector<std::string> dirs;
  for (const Staged& s : staged)
    if (const std::string d = folder_of(s.target); std::find(dirs.begin(), dirs.end(), d) == dirs.end()) dirs.push_back(d);
  for (const std::string& d : dirs) {
    const int dfd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {  // the renames themselves durable; best effort (some file systems refuse)
      ::fsync(dfd);
      ::close(dfd);
    }
  }
}

void write_file_atomically(const std::string& path, std::span<const std::byte> bytes) {
  const FileBytes f{path, bytes};
  write_files_atomically(std::span(&f, 1));
}

}  // namespace cpattn
