// The MPI communicator of cpattn: the collectives the context-parallel algorithms need, each
// with a deadline, on typed spans.
//
// A Communicator borrows an MPI_Comm: it duplicates it (MPI_Comm_dup, so its messages never
// mix with the caller's), frees only that duplicate, and never calls MPI_Init or MPI_Finalize;
// the program does, through an MpiSession (below) or by hand. This header and src/comm are
// the only parts of cpattn that include <mpi.h>.
//
//   int main(int argc, char** argv) {
//     cpattn::MpiSession mpi(argc, argv);              // MPI_Init_thread .. MPI_Finalize
//     cpattn::Communicator comm(MPI_COMM_WORLD, {.timeout_s = 120});
//     std::vector<float> k_local(n), k_all(n * comm.size());
//     comm.all_gather<float>(k_local, k_all);          // rank-major: rank r's block at r * n
//     cpattn::Communicator half = comm.split(comm.rank() % 2, comm.rank());  // sub-groups
//   }                      // frees the duplicates, then finalizes (reverse order of creation)
//
// Deadlines. Every collective is issued non-blocking and polled until it completes or its
// deadline passes. On timeout one line goes to stderr, naming the operation, its call number
// (a per-communicator count of collectives, from 1), this rank and the deadline; then, by
// default, MPI_Abort ends the whole job. TimeoutAction::throw_error throws cpattn::Error with
// the same text instead (for tests and programs that end the job themselves); see poisoned().
// The deadline is CommOptions::timeout_s when set, else the environment variable
// CPATTN_COMM_TIMEOUT_S (seconds, > 0), else 300 s; the timeout line names both ways to set it
// (CommOptions::timeout_name: the CLI's --timeout flag).
//
// Large payloads. No single MPI call moves more than CommOptions::max_count_per_call elements
// per rank block (default INT_MAX, MPI's int count limit); larger ones are split into several
// calls. Counts and offsets are 64-bit throughout.
//
// Determinism. reduce_scatter_sum adds in a fixed order that does not depend on timing (see
// there), so the same inputs give bitwise the same result on every run.
//
// Not thread-safe: one thread at a time per Communicator (MPI_THREAD_FUNNELED is enough).
#pragma once

#include <mpi.h>

#include <cpattn/error.hpp>

#include <climits>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace cpattn {

// What a collective that misses its deadline does.
enum class TimeoutAction {
  abort,        // print the line to stderr, then MPI_Abort(comm, abort_code): every rank ends
  throw_error,  // print the line, then throw cpattn::Error; the Communicator is poisoned
};

// How an operation moves its data. Both give the same layout; `ring` is hand-written on
// MPI_Isend/MPI_Irecv, `mpi` is the MPI library's non-blocking collective.
enum class CommAlgorithm {
  ring,
  mpi,
};

// Element types the collectives accept. std::uint16_t carries fp16 and bf16 storage (moved
// bit for bit; every operation but reduce_scatter_sum and all_reduce accepts it).
template <class T>
concept CommElement = std::same_as<T, float> || std::same_as<T, double> ||
                      std::same_as<T, std::int32_t> || std::same_as<T, std::int64_t> ||
                      std::same_as<T, std::uint16_t> || std::same_as<T, std::byte>;

// Element types all_reduce accepts.
template <class T>
concept CommReduceElement =
    std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, std::int64_t>;

enum class ReduceOp { sum, max };

class Communicator;

// A point-to-point exchange in flight (Communicator::start_shift): wait() completes it under
// the deadline its start set. Move-only; must not outlive its Communicator. Destroyed while
// still in flight (an exception between start and wait), its MPI requests are handed to the
// communicator's pending list, which is then poisoned, as after a timeout.
class CommRequest {
 public:
  CommRequest() = default;
  ~CommRequest();
  CommRequest(CommRequest&& o) noexcept;
  CommRequest& operator=(CommRequest&& o) noexcept;
  CommRequest(const CommRequest&) = delete;
  CommRequest& operator=(const CommRequest&) = delete;
  bool active() const { return !reqs_.empty(); }

 private:
  friend class Communicator;
  void* impl_ = nullptr;  // the Communicator's Impl
  const char* name_ = nullptr;
  std::int64_t call_ = 0;
  std::int64_t deadline_ns_ = 0;  // steady_clock, since its epoch
  std::vector<MPI_Request> reqs_;
};

struct CommOptions {
  // Deadline of each collective, seconds (> 0). Unset: CPATTN_COMM_TIMEOUT_S, else 300.
  std::optional<double> timeout_s = std::nullopt;
  // How this program's users set timeout_s, named in the timeout line and in the error for an
  // invalid value (a command line passes its flag, "--timeout").
  std::string timeout_name = "CommOptions::timeout_s";
  TimeoutAction on_timeout = TimeoutAction::abort;
  // throw_error only: false leaves the timeout line to the caller (it is the Error's message)
  // instead of printing it, for a caller to whom a timeout is an answer, not a failure.
  bool print_timeout = true;
  int abort_code = 3;  // the error code passed to MPI_Abort on timeout
  // Most elements one MPI call moves per rank block (1..INT_MAX); larger payloads are split.
  std::int64_t max_count_per_call = INT_MAX;
  // Chosen from docs/benchmarks.md "Communication" (Open MPI 4.1.4, shared memory).
  CommAlgorithm reduce_scatter_algorithm = CommAlgorithm::ring;
  CommAlgorithm all_gather_algorithm = CommAlgorithm::ring;
};

namespace detail {
// What Communicator::keep_if_poisoned takes: types whose move keeps the buffer's address.
template <class T>
inline constexpr bool keeps_storage_when_moved = false;
template <class T, class A>
inline constexpr bool keeps_storage_when_moved<std::vector<T, A>> = true;
template <class T>
inline constexpr bool keeps_storage_when_moved<std::shared_ptr<T>> = true;
template <class T, class D>
inline constexpr bool keeps_storage_when_moved<std::unique_ptr<T, D>> = true;
}  // namespace detail

class Communicator {
 public:
  // Duplicates `comm` (collective over `comm`, under the deadline; a timeout here always
  // aborts) and checks that every rank passed the same max_count_per_call and algorithms.
  // Throws cpattn::Error when MPI is not initialized, the options are invalid or differ
  // between ranks, or CPATTN_COMM_TIMEOUT_S is malformed.
  explicit Communicator(MPI_Comm comm, CommOptions options = {});
  ~Communicator();  // frees the duplicate (if MPI is not finalized yet)
  Communicator(Communicator&&) noexcept;  // a moved-from Communicator may only be destroyed
  Communicator& operator=(Communicator&&) noexcept;  // or assigned to
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int size() const;
  double timeout_s() const;             // the deadline in effect, seconds
  std::int64_t calls() const;           // collectives issued so far (the last call number)
  const CommOptions& options() const;
  MPI_Comm mpi_comm() const;            // the duplicate, for the comm layer's own tools

  // Sub-groups, as MPI_Comm_split: the ranks that pass the same color (>= 0) form one new
  // Communicator, ordered by key (ties by rank here), with this one's options and deadline.
  // Collective over every rank of this Communicator (one call number), under the deadline:
  // the colors are first
  // all-gathered (a rank that never calls split() times out there, as in any
  // collective; that timeout aborts the job in throw_error mode too, since a late rank would
  // then find the gather complete and wait in MPI_Comm_split alone), then MPI_Comm_split runs
  // on ranks known to be present (a blocking call: a rank that stalls between the two, a
  // narrow window, holds the others without a deadline; MPI 3.1, which Open MPI 4
  // implements, has no non-blocking split). The split
  // communicator is freed once the new Communicator has its own duplicate. Throws
  // cpattn::Error on every rank when any rank passes a negative color.
  Communicator split(int color, int key) const;

  // All ranks pass the same send.size() = n; recv.size() = n * size(), rank-major: rank r's
  // block lands at recv[r * n, (r + 1) * n). send may be exactly recv's own block (in place).
  template <CommElement T>
  void all_gather(std::span<const T> send, std::span<T> recv);

  // Varying counts: counts[r] elements from rank r (zero allowed), the same `counts` on every
  // rank, send.size() == counts[rank()]; recv.size() == sum(counts), rank-major with rank r at
  // offset counts[0] + ... + counts[r - 1]. all_gather_counts() finds the counts.
  template <CommElement T>
  void all_gather_v(std::span<const T> send, std::span<const std::int64_t> counts,
                    std::span<T> recv);
  std::vector<std::int64_t> all_gather_counts(std::int64_t count);

  // send: [size()][n] rank-major blocks, recv: [n]. recv on rank r = sum over ranks q of
  // q's block r, in fp32. Deterministic: with the ring algorithm block r is summed as
  // ((x[r+1] + x[r+2]) + ... + x[r+size-1]) + x[r] (ranks mod size) whatever the timing;
  // the mpi algorithm leaves the order to the MPI library.
  void reduce_scatter_sum(std::span<const float> send, std::span<float> recv);

  // In place over all ranks; same data.size() everywhere.
  template <CommReduceElement T>
  void all_reduce(std::span<T> data, ReduceOp op);

  // root's data is copied to every rank; same data.size() everywhere.
  template <CommElement T>
  void broadcast(std::span<T> data, int root);

  void barrier();

  // Point to point, for ring algorithms: sends `send` to rank `dest` and receives
  // recv.size() elements from rank `source` (which sends the same count), non-blocking. One
  // call number; wait() polls under a deadline that runs from the later of this start and the
  // wait (the rank's own work between them is not the peer's delay), with the same timeout
  // line and action as the collectives. Ranks must start their shifts in the same order (messages
  // of one source match in order). send and recv must not overlap and stay valid until
  // wait() returns. shift() is start and wait together. dest == source == rank() copies.
  template <CommElement T>
  [[nodiscard]] CommRequest start_shift(std::span<const T> send, int dest, std::span<T> recv, int source);
  void wait(CommRequest& req);
  // wait(), calling `between` after each poll that finds `req` still in flight, under the same
  // deadline: what the caller must keep moving while it waits (the overlapped all-gather posts
  // each peer's next sends from it as the last ones complete). `between` may start and test
  // other requests, not this one; what it throws reaches the caller with `req`'s transfers
  // recorded as pending and the communicator poisoned, as after a throw-mode timeout.
  void wait(CommRequest& req, const std::function<void()>& between);
  // Whether `req` has completed, without waiting: one MPI_Testall, which also moves every
  // transfer in flight along (Open MPI's shared-memory transport progresses a message only
  // inside MPI calls, so a scheme that computes between a start and its wait calls test()
  // between and inside its kernel calls: AttnInputs::progress). true: done, as after wait(); false: still in flight, to be
  // waited on (wait() keeps the deadline). A test never times out.
  bool test(CommRequest& req);
  template <CommElement T>
  void shift(std::span<const T> send, int dest, std::span<T> recv, int source) {
    CommRequest r = start_shift<T>(send, dest, recv, source);
    wait(r);
  }

  // One direction of a point-to-point exchange, for pipelines and other asymmetric patterns:
  // start_send posts `send` to `dest`, start_recv posts a receive of recv.size() elements from
  // `source` (which sends exactly that count). Each is one call number with its own deadline,
  // waited on by wait(); messages from one source to one destination match in the order they
  // were started. `tag` (>= 0, < 1000) separates independent streams (activations, gradients).
  // The buffer stays valid until wait() returns. dest/source must differ from rank().
  template <CommElement T>
  [[nodiscard]] CommRequest start_send(std::span<const T> send, int dest, int tag = 0);
  template <CommElement T>
  [[nodiscard]] CommRequest start_recv(std::span<T> recv, int source, int tag = 0);

  // Personalized exchange with varying counts (MPI_Alltoallv's meaning, 64-bit counts):
  // send holds [sum(send_counts)] elements, rank-major (the block for rank q at offset
  // send_counts[0] + ... + send_counts[q - 1]); recv receives recv_counts[q] elements from
  // rank q, rank-major the same way. Rank q's send_counts[r] must equal rank r's
  // recv_counts[q] (all_to_all_counts() finds recv_counts). The own block is copied.
  // send and recv must not overlap. Pairwise non-blocking messages under the deadline.
  template <CommElement T>
  void all_to_all_v(std::span<const T> send, std::span<const std::int64_t> send_counts,
                    std::span<T> recv, std::span<const std::int64_t> recv_counts);
  // recv_counts[q] = rank q's send_counts[rank()]: one all-to-all of size() int64 values.
  std::vector<std::int64_t> all_to_all_counts(std::span<const std::int64_t> send_counts);

  // Payload bytes this rank has sent to and received from other ranks, over every call
  // (point to point, the ring algorithms; for the MPI library's all-gathers and reduce-scatter,
  // the bytes a ring moves for the same result: an all_gather_v sends every block but the
  // right neighbour's and receives every block but its own). Its own block is not counted, nor
  // are all_reduce, broadcast, barrier and split, whose volume is the MPI library's own
  // algorithm's (the training's gradient all-reduce, a reduce-scatter and an all-gather, is
  // counted).
  std::int64_t bytes_sent() const;
  std::int64_t bytes_received() const;

  // After a timeout in throw_error mode (or a request dropped before its wait, or a throw
  // from wait()'s `between`) the Communicator is poisoned: those requests are still pending
  // (the buffers of that call must stay valid) and every later collective throws at once,
  // naming the first failure. drain() waits up to `timeout_s` for those requests (they
  // finish when the late ranks join the same operation) and returns true when none is left
  // pending.
  bool poisoned() const;
  bool drain(double timeout_s);
  // Keeps `owner` alive while timed-out requests are pending, even past this Communicator's
  // own end (it then lives until the process exits); freed at once when none is pending.
  // For objects that own buffers a timed-out call used (CpAttention hands its state here).
  // The scratch buffers of the Communicator itself are kept the same way. Out of memory for
  // the slot that keeps it, the job ends (MPI_Abort, a line naming the timed-out operation)
  // with `owner` alive: freeing it would let the pending requests write into freed memory.
  void retain_while_pending(std::shared_ptr<void> owner);
  // Where a call on this Communicator threw (its catch block, or the destructor of what it
  // left): when the Communicator is poisoned, that call's requests may still read or write
  // `bufs`, whose storage then moves into one object kept as above; otherwise `bufs` are left as
  // they are. Vectors and smart pointers only: a moved vector keeps its heap block and a moved
  // pointer its object, so the requests' addresses stay valid (a moved std::string or std::array
  // would not keep them). Nothing is kept once those requests have completed. Out of memory for
  // the object that keeps them, the job ends as retain_while_pending's does, `bufs` untouched.
  template <class... B>
  void keep_if_poisoned(B&... bufs) {
    static_assert(((!std::is_const_v<B> && detail::keeps_storage_when_moved<B>) && ...),
                  "keep_if_poisoned takes non-const std::vector, std::shared_ptr or std::unique_ptr");
    if (!poisoned() || !requests_pending()) return;
    std::shared_ptr<void> owner;
    try {
      owner = std::make_shared<std::tuple<B...>>(std::move(bufs)...);  // moves only once allocated
    } catch (...) {
      keeping_failed();
    }
    retain_while_pending(std::move(owner));
  }

 private:
  // Ends the job: what a timed-out call's requests may still use could not be kept.
  [[noreturn]] void keeping_failed() const noexcept;
  // Whether requests of a timed-out call are still pending (tested once; none after MPI_Finalize).
  bool requests_pending() const;
  friend class CommRequest;
  struct Impl;
  // The state, or cpattn::Error when this object was moved from (a CpAttention that borrowed
  // it would otherwise read through null).
  Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

// MPI for the life of a program, for programs that have no other owner of MPI (the library
// itself never initializes MPI). The constructor calls MPI_Init_thread with
// MPI_THREAD_FUNNELED, only if MPI is not initialized yet; the destructor calls MPI_Finalize
// only if this session initialized MPI and it is not finalized yet. Create it first in main()
// so that it outlives every Communicator. Throws cpattn::Error when MPI_Init_thread fails or
// provides less than MPI_THREAD_FUNNELED.
class MpiSession {
 public:
  MpiSession();                        // MPI_Init_thread(nullptr, nullptr, ...)
  MpiSession(int& argc, char**& argv);  // passes the program's arguments to MPI
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  bool initialized_here() const { return owner_; }  // this session called MPI_Init_thread
  // Whether this process has initialized MPI (finalized or not), by anyone.
  static bool ever_initialized();

 private:
  void init(int* argc, char*** argv);
  bool owner_ = false;
};

// A generic fingerprint for agreement checks: named 64-bit fields, the same names in the same
// order on every rank (the CP layer fills it with shapes, dtypes, heads, cp, a hash of the
// boundaries and a call counter).
struct Fingerprint {
  std::vector<std::pair<std::string, std::int64_t>> fields;
  // Fields the ranks need not share (add_min, add_and): their indices into fields, and
  // whether each is reduced by minimum (else by bitwise AND).
  std::vector<std::pair<std::size_t, bool>> reduced;
  Fingerprint& add(std::string name, std::int64_t value) {
    fields.emplace_back(std::move(name), value);
    return *this;
  }
  // A field the ranks need not share: agree() does not compare it and returns its minimum
  // over the ranks (e.g. whether a resource is free on every rank: 1 or 0) ...
  Fingerprint& add_min(std::string name, std::int64_t value) {
    reduced.emplace_back(fields.size(), true);
    return add(std::move(name), value);
  }
  // ... or its bitwise AND over the ranks (up to 64 such flags in one field).
  Fingerprint& add_and(std::string name, std::int64_t value) {
    reduced.emplace_back(fields.size(), false);
    return add(std::move(name), value);
  }
};

// Compares all ranks' values (all_values: [nranks][fields.size()] rank-major) and returns
// nothing when they agree, else a message naming every field that differs and which ranks
// hold which value (add_min's and add_and's fields are not compared), e.g.
//   "ranks disagree on attention forward: num_heads_q: ranks 0,2,3 have 8, rank 1 has 4"
// The same inputs give the same text on every rank.
std::optional<std::string> describe_disagreement(const Fingerprint& mine,
                                                 std::span<const std::int64_t> all_values,
                                                 int nranks, std::string_view what);

// A collective: one all-gather when all is well. When any rank passes a non-empty
// `local_error` (what it found wrong locally, for example in its arguments), every rank
// throws cpattn::Error with every rank's message, identical ones grouped:
//   "CP attention rejected its arguments: [rank 1] forward: q must not be null"
// Otherwise it checks that every rank has the same number of fields and the same names and
// reduced fields (add_min, add_and; through one hash, named "fingerprint field names and
// reductions (hash)"), then the values, and throws describe_disagreement's message on every
// rank when any differs. A rank with an error takes part all the same, so that the others
// fail with its message instead of waiting for it.
// Returns each add_min field's minimum and each add_and field's AND over the ranks, in the
// order they were added.
std::vector<std::int64_t> agree(Communicator& comm, const Fingerprint& fp, std::string_view what,
                                std::string_view local_error = {});

// Runs `f` on every rank; when it throws on any rank (cpattn::Error, or any std::exception as
// "unexpected error: ..."), every rank throws cpattn::Error with the lowest failing rank's
// message, so that no rank is left waiting in a later collective. For checks a rank makes
// alone (its node's free memory, a file it reads) before work the ranks do together. Collective:
// an all-reduce, and two broadcasts when a rank failed.
template <class F>
void on_every_rank(Communicator& comm, F&& f);

void rethrow_agreed(Communicator& comm, const std::string& local_error);  // its collective half

template <class F>
void on_every_rank(Communicator& comm, F&& f) {
  std::string err;
  try {
    f();
  } catch (const Error& e) {
    err = e.message();
    if (err.empty()) err = "error";
  } catch (const std::exception& e) {  // bad_alloc, a stream's failure: still every rank's error
    err = std::string("unexpected error: ") + e.what();
  }
  rethrow_agreed(comm, err);
}

}  // namespace cpattn
