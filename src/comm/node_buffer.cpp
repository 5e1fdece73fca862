#include "cpattn/node_buffer.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <random>
#include <string_view>
#include <vector>

#include "cpattn/comm.hpp"

namespace cpattn {
namespace {

constexpr std::size_t kHeader = 64;  // the token, then padding: data() stays 64-byte aligned

std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

// The host name and this boot's id: containers on different machines may share a host name.
std::int64_t host_hash() {
  std::array<char, 256> host{};
  if (gethostname(host.data(), host.size() - 1) != 0) return 0;
  std::string id(host.data());
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    std::array<char, 64> boot{};
    if (std::fgets(boot.data(), static_cast<int>(boot.size()), f)) id += boot.data();
    std::fclose(f);
  }
  return static_cast<std::int64_t>(std::hash<std::string>{}(id));
}

// A descriptor and a mapping, released however create() leaves.
struct Mapping {
  int fd = -1;
  void* map = nullptr;
  std::size_t bytes = 0;
  ~Mapping() {
    if (map) munmap(map, bytes);
    if (fd >= 0) close(fd);
  }
  void map_fd(std::string& err) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) err = errno_text("mmap");
    else map = p;
  }
};

// What the collectives read and write: kept alive with the communicator when one times out in
// throw_error mode (its requests stay pending), so that a late peer never writes freed memory.
struct Wire {
  std::int64_t mine = 0;
  std::vector<std::int64_t> all;
  std::array<std::int64_t, 6> head{};  // token, pid, fd (-1: none), st_dev, st_ino, file size
};

}  // namespace

// Rank 0's memory file (memfd_create) has no name: the others open it through /proc/<pid>/fd,
// so nothing is ever left in /dev/shm, even when a rank dies half-way (the memory goes with the
// last process that maps it).
std::unique_ptr<NodeBuffer> NodeBuffer::create(Communicator& comm, std::size_t bytes, std::string* why) {
  // (Past it, kHeader + bytes wrapped: SIZE_MAX mapped one page of a buffer ~2^64 long.)
  constexpr auto kMaxBytes = static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()) - kHeader;
  CPATTN_CHECK(bytes <= kMaxBytes, "NodeBuffer::create: bytes must be at most 2^63 - 65, got ", bytes);
  auto w = std::make_shared<Wire>();
  const auto collective = [&](auto&& call) {
    try {
      call();
    } catch (...) {
      comm.keep_if_poisoned(w);
      throw;
    }
  };
  const auto gather = [&](std::int64_t value) {  // every rank's value, in w->all
    w->mine = value;
    w->all.assign(static_cast<std::size_t>(comm.size()), 0);
    collective([&] { comm.all_gather<std::int64_t>(std::span(&w->mine, 1), w->all); });
  };
  const auto fail = [&](std::string text) {
    if (why) *why = std::move(text);
    return std::unique_ptr<NodeBuffer>();
  };

  // One host? Asked first, so that a job over several hosts allocates nothing.
  gather(host_hash());
  for (const std::int64_t h : w->all)
    if (h != w->all[0]) return fail("the ranks run on several hosts");

  Mapping m{.bytes = kHeader + bytes};
  std::string err;
  std::uint64_t token = 0;
  if (comm.rank() == 0) {
    try {  // anything thrown here still reaches the broadcast: the others must not wait for it
      std::random_device rd;
      token = (std::uint64_t{rd()} << 32) ^ rd();
      m.fd = memfd_create("cpattn-node-buffer", MFD_CLOEXEC);
      int rc = m.fd < 0 ? errno : 0;
      if (rc != 0) {
        err = std::string("memfd_create: ") + std::strerror(rc);
      } else {
        do rc = posix_fallocate(m.fd, 0, static_cast<off_t>(m.bytes));
        while (rc == EINTR);
        if (rc != 0) err = "posix_fallocate of " + std::to_string(m.bytes) + " bytes: " + std::strerror(rc);
        else m.map_fd(err);
      }
      struct stat st {};
      if (err.empty() && fstat(m.fd, &st) != 0) err = errno_text("fstat");
      if (err.empty()) {
        std::memcpy(m.map, &token, sizeof token);
        w->head = {static_cast<std::int64_t>(token), getpid(), m.fd, static_cast<std::int64_t>(st.st_dev),
                   static_cast<std::int64_t>(st.st_ino), static_cast<std::int64_t>(m.bytes)};
      }
    } catch (const std::exception& e) {
      err = e.what();
    }
    if (!err.empty()) w->head = {0, 0, -1, 0, 0, 0};
  }
  collective([&] { comm.broadcast<std::int64_t>(w->head, 0); });
  if (comm.rank() != 0) {
    try {
      token = static_cast<std::uint64_t>(w->head[0]);
      const std::string path = "/proc/" + std::to_string(w->head[1]) + "/fd/" + std::to_string(w->head[2]);
      struct stat st {};
      if (w->head[2] < 0) err = "rank 0 made no buffer";
      else if (w->head[5] != static_cast<std::int64_t>(m.bytes))
        err = "rank 0 made " + std::to_string(w->head[5]) + " bytes, this rank asked for " + std::to_string(m.bytes);
      else if ((m.fd = open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOCTTY | O_NONBLOCK)) < 0)
        err = errno_text("open " + path);  // e.g. another pid namespace
      else if (fstat(m.fd, &st) != 0) err = errno_text("fstat");
      else if (static_cast<std::int64_t>(st.st_dev) != w->head[3] || static_cast<std::int64_t>(st.st_ino) != w->head[4] ||
               static_cast<std::size_t>(st.st_size) != m.bytes)
        err = path + " is not rank 0's buffer";  // the same pid in another pid namespace
      else m.map_fd(err);
      std::uint64_t seen = 0;
      if (m.map) std::memcpy(&seen, m.map, sizeof seen);
      if (m.map && seen != token) err = "the buffer holds another token than rank 0's";
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  gather(err.empty() ? 1 : 0);
  for (int q = 0; q < comm.size(); ++q)
    if (w->all[static_cast<std::size_t>(q)] == 0)
      return fail("rank " + std::to_string(q) + " could not map the buffer" + (err.empty() ? "" : " (this rank: " + err + ")"));
  // Every rank has mapped it: the mappings keep the memory, the descriptor can go.
  auto* data = static_cast<std::byte*>(m.map) + kHeader;
  std::unique_ptr<NodeBuffer> b(new NodeBuffer(m.map, m.bytes, data, bytes));
  m.map = nullptr;
  return b;
}

NodeBuffer::~NodeBuffer() {
  if (map_) munmap(map_, map_bytes_);
}

}  // namespace cpattn
