// Memory that every rank of a Communicator maps, when they all run on one node: the all-gather
// CP scheme's exchange without copies (docs/cp.md "Shared memory"). Part of the comm layer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace cpattn {

class Communicator;

// One anonymous shared-memory file (memfd), created by rank 0 and mapped by every rank of a
// Communicator at its own address. The ranks order their reads and writes of it themselves
// (the CP layer: a write, std::atomic_thread_fence, a barrier, then the peers' reads).
class NodeBuffer {
 public:
  // Collective over `comm` (two all-gathers and a broadcast, under its deadline); every rank
  // passes the same `bytes`. First the ranks compare their host names and boot ids (hashed):
  // ranks on several hosts get null at once, nothing allocated. Then rank 0 creates a file of `bytes`, reserved up front with posix_fallocate
  // (the memory is taken here, not at the first write). Every other rank opens it through
  // /proc/<rank 0's pid>/fd, checks that it is that file (device, inode, size) and maps it,
  // and checks a random token rank 0 wrote. All learn whether every rank could. Returns null
  // on every rank when any rank could not (other pid namespaces, no memory); `why` then says
  // what failed. The file has no name: nothing is left behind when a rank dies. Throws
  // cpattn::Error, before any communication, for bytes past 2^63 - 65.
  static std::unique_ptr<NodeBuffer> create(Communicator& comm, std::size_t bytes, std::string* why = nullptr);
  ~NodeBuffer();  // unmaps this rank's mapping; no communication
  NodeBuffer(const NodeBuffer&) = delete;
  NodeBuffer& operator=(const NodeBuffer&) = delete;

  std::byte* data() const { return data_; }  // 64-byte aligned
  std::size_t size() const { return size_; }

 private:
  NodeBuffer(void* map, std::size_t map_bytes, std::byte* data, std::size_t size)
      : map_(map), map_bytes_(map_bytes), data_(data), size_(size) {}
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace cpattn
