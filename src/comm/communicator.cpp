// Communicator: non-blocking MPI collectives polled under a deadline, split into calls of at
// most max_count_per_call elements, with hand-written ring algorithms beside MPI's own.
#include "cpattn/comm.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <thread>

#include "cpattn/error.hpp"

namespace cpattn {

namespace {

using Clock = std::chrono::steady_clock;

constexpr double kDefaultTimeoutS = 300.0;
constexpr const char* kTimeoutEnv = "CPATTN_COMM_TIMEOUT_S";

// Tags of the ring algorithms' point-to-point messages on the private duplicate.
constexpr int kTagAllGather = 101;
constexpr int kTagReduceScatter = 102;
constexpr int kTagShift = 103;
constexpr int kTagAllToAll = 104;
constexpr int kTagUser = 1000;  // start_send/start_recv: kTagUser + tag
// Ring reduce-scatter message size, elements (1 MiB of fp32): small enough that adding one
// segment overlaps the transfer of the next, large enough to keep per-message costs low.
constexpr std::int64_t kReduceScatterSegment = std::int64_t{1} << 18;

template <class T>
MPI_Datatype mpi_type() {
  if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, std::uint16_t>) return MPI_UINT16_T;
  else return MPI_BYTE;
}

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::sum ? MPI_SUM : MPI_MAX; }

// Deadlines past this (about 116 days) are a mistake, and inf would overflow the clock.
constexpr double kMaxTimeoutS = 1e7;

double resolve_timeout(const CommOptions& o) {
  if (o.timeout_s) {
    CPATTN_CHECK(*o.timeout_s > 0 && *o.timeout_s <= kMaxTimeoutS,
                 o.timeout_name, " must be in (0, ", kMaxTimeoutS, "] seconds, got ", *o.timeout_s);
    return *o.timeout_s;
  }
  const char* env = std::getenv(kTimeoutEnv);
  if (env == nullptr || *env == '\0') return kDefaultTimeoutS;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(env, &end);
  CPATTN_CHECK(errno == 0 && end != env && *end == '\0' && v > 0 && v <= kMaxTimeoutS, kTimeoutEnv,
               " must be a number of seconds in (0, ", kMaxTimeoutS, "], got '", env, "'");
  return v;
}

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

// What the pending requests of a call (timed out, or dropped before its wait) may still read or
// write could not be kept (out of memory for the record of the requests, the object that keeps
// the buffers or its slot): ends the job with those buffers alive, since freeing them would let
// MPI write into freed memory. `call` < 0: `op` names the call whole. Allocates nothing.
[[noreturn]] void end_job_unkept(int rank, const char* op, std::int64_t call, int abort_code) noexcept {
  std::fprintf(stderr, "cpattn comm: rank %d: out of memory keeping the buffers of %s", rank, op);
  if (call >= 0) std::fprintf(stderr, " (call #%lld)", static_cast<long long>(call));
  std::fprintf(stderr, " alive for its pending requests: ending the job rather than freeing memory that MPI may "
                       "still write\n");
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, abort_code);
  std::abort();  // (MPI_Abort does not return)
}

}  // namespace

struct Communicator::Impl {
  MPI_Comm comm = MPI_COMM_NULL;  // the private duplicate
  int rank = 0;
  int size = 1;
  CommOptions opts;
  double timeout_s = kDefaultTimeoutS;
  std::int64_t calls = 0;
  std::int64_t bytes_sent = 0, bytes_received = 0;
  bool poisoned = false;
  std::string poisoned_by;              // the failed operation and why, for later errors
  std::vector<MPI_Request> pending;     // requests left by a timeout in throw_error mode
  std::vector<float> scratch;           // ring reduce-scatter buffers, [2][len]
  std::vector<float> pack;              // mpi reduce-scatter staging when split, [size][len]
  // Owners of buffers that `pending` may still read or write (retain_while_pending): freed
  // with this Impl, which outlives the Communicator while requests are pending.
  std::vector<std::shared_ptr<void>> retained;

  // What MPI reads while a request is pending must outlive it: the int counts and
  // displacements of MPI_Iallgatherv, and all_gather_counts' and all_to_all_counts' receive
  // buffers, live here.
  std::vector<int> v_count, v_displ;
  std::vector<std::int64_t> counts;
  std::vector<std::int64_t> a2a_counts;  // all_to_all_counts' receive buffer (split uses counts)

  // Tests the pending requests once. true: none is left (or MPI is finalized, after which
  // nothing can touch their buffers); false: some are pending; an MPI error sets *failed and
  // leaves them (and what they may use) in place.
  bool settle(bool* failed = nullptr) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) pending.clear();
    if (pending.empty()) return true;
    int done = 0;
    if (MPI_Testall(static_cast<int>(pending.size()), pending.data(), &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
      if (failed) *failed = true;
      return false;
    }
    if (done) pending.clear();
    return pending.empty();
  }

  // One collective in flight: its name, call number and deadline.
  struct Op {
    const char* name;
    std::int64_t call;
    Clock::time_point deadline;
  };

  Op begin(const char* name) {
    if (poisoned) {
      std::ostringstream os;
      os << "cpattn comm: " << name << " refused on rank " << rank
         << ": the communicator is poisoned by an earlier failure in " << poisoned_by;
      throw Error(os.str());
    }
    ++calls;
    return Op{name, calls, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(timeout_s))};
  }

  // begin() for start_send / start_recv (`name`), after checking the other rank (`peer`,
  // the argument `peer_arg`) and the user's tag.
  Op begin_p2p(const char* name, const char* peer_arg, int peer, int tag) {
    const Op op = begin(name);
    CPATTN_CHECK(peer >= 0 && peer < size && peer != rank, name, ": ", peer_arg, " (", peer,
                 ") must be another rank in [0, ", size, "), this is rank ", rank);
    CPATTN_CHECK(tag >= 0 && tag < 1000, name, ": tag must be in [0, 1000), got ", tag);
    return op;
  }

  // A request for `op`, to be completed by Communicator::wait under op's deadline.
  CommRequest request(const Op& op) {
    CommRequest r;
    r.impl_ = this;
    r.name_ = op.name;
    r.call_ = op.call;
    r.deadline_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(op.deadline.time_since_epoch()).count();
    return r;
  }

  void check(int rc, const Op& op, const char* fn) const {
    if (rc == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    std::ostringstream os;
    os << "cpattn comm: " << fn << " failed in " << op.name << " (call #" << op.call
       << ") on rank " << rank << " of " << size << ": " << std::string(text, len);
    throw Error(os.str());
  }

  // Polls `reqs` until all complete or op's deadline passes. Spins for the first 1 ms and
  // yields until 2 ms, so short operations keep their latency, then sleeps 20 us doubling up
  // to 250 us so that a rank waiting on a late peer leaves the core to others. On a
  // timeout in throw_error mode the requests in `in_flight` (default: `reqs`) stay pending.
  // `between` (optional): called after each poll that leaves reqs in flight (Communicator::wait).
  void wait(const Op& op, MPI_Request* reqs, int n, MPI_Comm abort_comm,
            std::span<MPI_Request> in_flight = {}, const std::function<void()>* between = nullptr) {
    if (n == 0) return;
    const auto start = Clock::now();
    auto nap = std::chrono::microseconds(20);
    for (;;) {
      int done = 0;
      check(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE), op, "MPI_Testall");
      if (done) return;
      if (between) {
        try {
          (*between)();
        } catch (...) {  // (MPI_Testall left every request as it was: all still to complete)
          keep_pending(op, std::span<MPI_Request>(reqs, n), "left in flight by a throw while waiting");
          throw;
        }
      }
      const auto now = Clock::now();
      if (now >= op.deadline) break;
      if (now - start < std::chrono::milliseconds(1)) {
        continue;  // busy-poll like a blocking MPI call: most operations end here
      }
      if (now - start < std::chrono::milliseconds(2)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(nap);
        nap = std::min(nap * 2, std::chrono::microseconds(250));
      }
    }
    if (in_flight.empty()) in_flight = std::span<MPI_Request>(reqs, n);
    timed_out(op, in_flight, abort_comm);
  }

  // Requests whose buffers must outlive them: kept until they complete (drain, or the
  // destructor), the communicator poisoned for any later call, by `op` (and `why`, null for a
  // timeout: the out-of-memory line names the call as the timeout's does) unless it was
  // already (the first failure is the cause).
  void keep_pending(const Op& op, std::span<MPI_Request> reqs, const char* why) {
    try {
      for (MPI_Request req : reqs)
        if (req != MPI_REQUEST_NULL) pending.push_back(req);
      if (!poisoned) {
        poisoned = true;
        poisoned_by = std::string(op.name) + " (call #" + std::to_string(op.call) + (why ? ", " : "") +
                      (why ? why : "") + ")";
      }
    } catch (...) {  // out of memory: a request not recorded would let its buffers be freed under it
      end_job_unkept(rank, op.name, op.call, opts.abort_code);
    }
  }

  [[noreturn]] void timed_out(const Op& op, std::span<MPI_Request> reqs, MPI_Comm abort_comm) {
    const bool abort = opts.on_timeout == TimeoutAction::abort;
    std::string msg;
    std::optional<Error> error;  // made here: a bad_alloc past the record would unwind callers that catch Error
    try {
      // the requests recorded first: one not recorded would let its buffers be freed under it
      if (!abort) keep_pending(op, reqs, nullptr);
      std::ostringstream os;
      os << "cpattn comm: timeout: " << op.name << " (call #" << op.call << ") on rank " << rank << " of " << size
         << " did not complete within the deadline of " << timeout_s << " s (set by " << opts.timeout_name
         << ", else " << kTimeoutEnv << ", else " << kDefaultTimeoutS << " s); "
         << (abort ? "aborting the job" : "throwing");
      msg = os.str();
      if (!abort) error.emplace(msg);
    } catch (...) {  // out of memory: the line could not be made, or a request not recorded
      if (abort) std::fprintf(stderr, "cpattn comm: timeout: %s on rank %d; aborting the job\n", op.name, rank);
      else end_job_unkept(rank, op.name, op.call, opts.abort_code);
    }
    if (!msg.empty() && (abort || opts.print_timeout)) std::fprintf(stderr, "%s\n", msg.c_str());
    std::fflush(stderr);
    if (abort) {
      MPI_Abort(abort_comm, opts.abort_code);
      std::abort();  // MPI_Abort does not return; never continue past a timeout
    }
    throw std::move(*error);  // (moving an Error allocates nothing)
  }

  void wait(const Op& op, std::vector<MPI_Request>& reqs) {
    wait(op, reqs.data(), static_cast<int>(reqs.size()), comm);
    reqs.clear();
  }
  void wait(const Op& op, MPI_Request& req) { wait(op, &req, 1, comm); }

  std::int64_t chunk() const { return opts.max_count_per_call; }

  // Posts the messages moving `count` elements at `buf` to or from `peer`, split into calls of
  // at most `piece` (default chunk()) elements.
  template <class T>
  void post_send(const Op& op, const T* buf, std::int64_t count, int peer, int tag,
                 std::vector<MPI_Request>& reqs, std::int64_t piece = 0) {
    bytes_sent += count * static_cast<std::int64_t>(sizeof(T));
    post_pieces(op, buf, count, piece, reqs, "MPI_Isend", [&](const T* at, int len, MPI_Request* req) {
      return MPI_Isend(at, len, mpi_type<T>(), peer, tag, comm, req);
    });
  }
  template <class T>
  void post_recv(const Op& op, T* buf, std::int64_t count, int peer, int tag,
                 std::vector<MPI_Request>& reqs, std::int64_t piece = 0) {
    bytes_received += count * static_cast<std::int64_t>(sizeof(T));
    post_pieces(op, buf, count, piece, reqs, "MPI_Irecv", [&](T* at, int len, MPI_Request* req) {
      return MPI_Irecv(at, len, mpi_type<T>(), peer, tag, comm, req);
    });
  }
  // The split both share: post(at, len, request) is MPI call `fn` on `len` elements at `at`.
  template <class T, class Post>
  void post_pieces(const Op& op, T* buf, std::int64_t count, std::int64_t piece, std::vector<MPI_Request>& reqs,
                   const char* fn, Post post) {
    if (piece == 0) piece = chunk();
    for (std::int64_t off = 0; off < count; off += piece) {
      const int len = static_cast<int>(std::min(piece, count - off));
      reqs.emplace_back();
      check(post(buf + off, len, &reqs.back()), op, fn);
    }
  }

  // Ring all-gather of blocks already in place in `recv` (block q: offset[q], count[q]):
  // at step s rank r forwards block (r - s) mod p to r + 1 and takes block (r - s - 1) mod p
  // from r - 1.
  template <class T>
  void ring_all_gather(const Op& op, T* recv, const std::vector<std::int64_t>& offset,
                       const std::vector<std::int64_t>& count) {
    const int p = size;
    const int right = (rank + 1) % p;
    const int left = (rank + p - 1) % p;
    std::vector<MPI_Request> reqs;
    for (int s = 0; s < p - 1; ++s) {
      const int sb = (rank - s + p) % p;
      const int rb = (rank - s - 1 + 2 * p) % p;
      post_recv(op, recv + offset[rb], count[rb], left, kTagAllGather, reqs);
      post_send(op, recv + offset[sb], count[sb], right, kTagAllGather, reqs);
      wait(op, reqs);
    }
  }
};

Communicator::Communicator(MPI_Comm comm, CommOptions options)
    : impl_(std::make_unique<Impl>()) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  CPATTN_CHECK(initialized && !finalized,
               "Communicator needs MPI initialized and not finalized: the program calls "
               "MPI_Init before and MPI_Finalize after (initialized=", initialized,
               ", finalized=", finalized, ")");
  CPATTN_CHECK(comm != MPI_COMM_NULL, "Communicator needs a valid MPI_Comm, got MPI_COMM_NULL");
  Impl& im = impl();
  im.opts = options;
  // While constructing: a timeout always aborts (in throw mode the pending requests would
  // outlive this constructor's buffers), and the options check below moves its data the same
  // way on every rank whatever the options say.
  im.opts.on_timeout = TimeoutAction::abort;
  im.opts.max_count_per_call = INT_MAX;
  im.opts.all_gather_algorithm = CommAlgorithm::mpi;
  // A bad deadline (the option, or the variable of this rank's environment) fails every rank,
  // after the duplication under the default deadline: thrown here, the other ranks would wait
  // in the duplication until theirs.
  std::string timeout_error;
  try {
    im.timeout_s = resolve_timeout(options);
  } catch (const Error& e) {
    timeout_error = e.message();
    im.timeout_s = kDefaultTimeoutS;
  }
  MPI_Comm_rank(comm, &im.rank);
  MPI_Comm_size(comm, &im.size);

  // Duplicate under the deadline too: a rank that never constructs its Communicator is the
  // first hang a user meets. Call number 0; errors here follow the borrowed comm's handler.
  const Impl::Op op{"comm_dup", 0,
                    Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(im.timeout_s))};
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request req = MPI_REQUEST_NULL;
  im.check(MPI_Comm_idup(comm, &dup, &req), op, "MPI_Comm_idup");
  im.wait(op, &req, 1, comm);
  im.comm = dup;
  im.check(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN), op, "MPI_Comm_set_errhandler");

  // Ranks must agree on how collectives move data: other chunk sizes or algorithms would
  // misplace data or hang. The options are checked here, after the duplication every rank
  // joins, so that one rank's bad value fails every rank with the same message (checked
  // before it, the others waited in the duplication until the deadline); the duplicate is
  // freed before the throw.
  constexpr int kFields = 4;  // the three compared options, and whether the deadline was valid
  const std::int64_t mine[kFields] = {options.max_count_per_call,
                                      static_cast<std::int64_t>(options.reduce_scatter_algorithm),
                                      static_cast<std::int64_t>(options.all_gather_algorithm), timeout_error.empty()};
  std::vector<std::int64_t> all(kFields * static_cast<std::size_t>(im.size));
  all_gather<std::int64_t>(mine, all);
  try {
    std::string bad_deadline;  // the ranks whose deadline was invalid
    for (int r = 0; r < im.size; ++r)
      if (all[kFields * r + 3] == 0) {
        if (!bad_deadline.empty()) bad_deadline += ',';
        bad_deadline += std::to_string(r);
      }
    CPATTN_CHECK(bad_deadline.empty(), "the deadline (", options.timeout_name, ", else ", kTimeoutEnv,
                 ") is invalid on rank(s) ", bad_deadline, timeout_error.empty() ? "" : ": " + timeout_error);
    for (int r = 0; r < im.size; ++r)
      CPATTN_CHECK(all[kFields * r] >= 1 && all[kFields * r] <= INT_MAX,
                   "CommOptions::max_count_per_call must be in [1, INT_MAX], got ", all[kFields * r], " on rank ", r);
    for (int r = 0; r < im.size; ++r)
      for (int f = 0; f < 3; ++f)
        CPATTN_CHECK(all[kFields * r + f] == all[f], "ranks disagree on CommOptions::",
                     f == 0 ? "max_count_per_call" : f == 1 ? "reduce_scatter_algorithm" : "all_gather_algorithm",
                     ": rank 0 has ", all[f], ", rank ", r, " has ", all[kFields * r + f]);
  } catch (const Error&) {
    MPI_Comm_free(&im.comm);
    throw;
  }
  im.opts = options;
  im.calls = 0;  // the caller's first collective is call #1
}

Communicator::~Communicator() {
  if (!impl_ || impl_->comm == MPI_COMM_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  const bool settled = impl_->settle();
  MPI_Comm_free(&impl_->comm);  // pending operations, if any, still complete
  if (!settled) {
    // Requests of a timed-out call (throw_error mode) still point into the scratch buffers
    // and the retained owners: they must never be freed while MPI may use them. Kept for
    // the life of the process, reachable (not a leak to LeakSanitizer).
    try {
      static auto* graveyard = new std::vector<std::unique_ptr<Impl>>;
      graveyard->push_back(std::move(impl_));  // (moves impl_ only once its slot is allocated)
    } catch (...) {
      end_job_unkept(impl_->rank, impl_->poisoned_by.c_str(), -1, impl_->opts.abort_code);
    }
  }
}

Communicator::Communicator(Communicator&&) noexcept = default;
Communicator& Communicator::operator=(Communicator&& other) noexcept {
  if (this != &other) {
    Communicator old(std::move(*this));  // frees our duplicate on scope exit
    impl_ = std::move(other.impl_);
  }
  return *this;
}

Communicator::Impl& Communicator::impl() const {
  CPATTN_CHECK(impl_ != nullptr, "Communicator: used after it was moved from (a moved-from Communicator may only be "
               "destroyed or assigned to; an object that borrowed it, such as a CpAttention, must not outlive it)");
  return *impl_;
}

int Communicator::rank() const { return impl().rank; }
int Communicator::size() const { return impl().size; }
double Communicator::timeout_s() const { return impl().timeout_s; }
std::int64_t Communicator::calls() const { return impl().calls; }
const CommOptions& Communicator::options() const { return impl().opts; }
MPI_Comm Communicator::mpi_comm() const { return impl().comm; }
bool Communicator::poisoned() const { return impl().poisoned; }

Communicator Communicator::split(int color, int key) const {
  Impl& im = impl();
  const auto op = im.begin("split");
  // Every rank's color first, under the deadline; in place in a buffer of the Impl, so that a
  // timed-out request (throw_error mode) never points into this frame.
  im.counts.assign(static_cast<std::size_t>(im.size), 0);
  im.counts[static_cast<std::size_t>(im.rank)] = color;
  MPI_Request req = MPI_REQUEST_NULL;
  im.check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, im.counts.data(), 1, MPI_INT64_T,
                          im.comm, &req),
           op, "MPI_Iallgather");
  // Its timeout aborts whatever on_timeout says: thrown, it let a late rank, its gather then
  // complete, enter the blocking MPI_Comm_split alone and wait there for ever.
  const TimeoutAction action = im.opts.on_timeout;
  im.opts.on_timeout = TimeoutAction::abort;
  try {
    im.wait(op, req);
  } catch (...) {
    im.opts.on_timeout = action;
    throw;
  }
  im.opts.on_timeout = action;
  for (int r = 0; r < im.size; ++r)
    CPATTN_CHECK(im.counts[r] >= 0, "split: every color must be >= 0, rank ", r, " passed ",
                 im.counts[r]);

  // Every rank is here and every color is valid: MPI_Comm_split (blocking) cannot wait on a
  // missing rank. The new Communicator duplicates the split communicator, which is then freed.
  MPI_Comm raw = MPI_COMM_NULL;
  im.check(MPI_Comm_split(im.comm, color, key, &raw), op, "MPI_Comm_split");
  struct Free {
    MPI_Comm* c;
    ~Free() { MPI_Comm_free(c); }
  } free_raw{&raw};
  CommOptions options = im.opts;
  options.timeout_s = im.timeout_s;  // the deadline in effect here, whatever the environment says later
  return Communicator(raw, options);
}

void Communicator::retain_while_pending(std::shared_ptr<void> owner) {
  Impl& im = impl();
  if (im.settle()) return;
  try {
    im.retained.push_back(std::move(owner));  // moves `owner` only once its slot is allocated
  } catch (...) {
    keeping_failed();  // `owner` still holds the buffers, never freed under the requests
  }
}

void Communicator::keeping_failed() const noexcept {
  end_job_unkept(impl_->rank, impl_->poisoned_by.c_str(), -1, impl_->opts.abort_code);
}

bool Communicator::requests_pending() const { return !impl().settle(); }

bool Communicator::drain(double timeout_s) {
  // (NaN, inf or a huge value made the duration conversion undefined: inf returned at once)
  CPATTN_CHECK(timeout_s >= 0 && timeout_s <= kMaxTimeoutS, "drain: timeout_s must be in [0, ", kMaxTimeoutS,
               "] seconds, got ", timeout_s);
  Impl& im = impl();
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  auto nap = std::chrono::microseconds(20);
  bool failed = false;
  while (!im.settle(&failed)) {
    if (failed || Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
  }
  im.retained.clear();  // MPI no longer touches their buffers
  return true;
}

template <CommElement T>
void Communicator::all_gather(std::span<const T> send, std::span<T> recv) {
  Impl& im = impl();
  const auto op = im.begin("all_gather");
  const auto n = static_cast<std::int64_t>(send.size());
  const int p = im.size;
  CPATTN_CHECK(static_cast<std::int64_t>(recv.size()) == n * p, "all_gather: recv.size() must be ",
               "send.size() * size() = ", n, " * ", p, ", got ", recv.size());
  T* own = recv.data() + n * im.rank;
  const bool in_place = send.data() == own;
  CPATTN_CHECK(in_place || !overlaps(send.data(), send.size_bytes(), recv.data(),
                                     recv.size_bytes()),
               "all_gather: send overlaps recv other than exactly at this rank's block");
  if (n == 0) return;
  if (!in_place) std::copy(send.begin(), send.end(), own);
  if (p == 1) return;

  if (im.opts.all_gather_algorithm == CommAlgorithm::ring) {
    std::vector<std::int64_t> offset(p), count(p, n);
    for (int q = 0; q < p; ++q) offset[q] = n * q;
    im.ring_all_gather(op, recv.data(), offset, count);
    return;
  }
  im.bytes_sent += (p - 1) * n * static_cast<std::int64_t>(sizeof(T));
  im.bytes_received += (p - 1) * n * static_cast<std::int64_t>(sizeof(T));
  // MPI_Iallgather in place, one call per chunk; a split call's receive type strides over
  // the rank blocks ([len] elements every n).
  for (std::int64_t off = 0; off < n; off += im.chunk()) {
    const std::int64_t len = std::min(im.chunk(), n - off);
    MPI_Datatype type = mpi_type<T>();
    bool derived = false;
    if (len != n) {
      MPI_Datatype block = MPI_DATATYPE_NULL;
      im.check(MPI_Type_contiguous(static_cast<int>(len), mpi_type<T>(), &block), op,
               "MPI_Type_contiguous");
      im.check(MPI_Type_create_resized(block, 0, static_cast<MPI_Aint>(n * sizeof(T)), &type),
               op, "MPI_Type_create_resized");
      MPI_Type_free(&block);
      im.check(MPI_Type_commit(&type), op, "MPI_Type_commit");
      derived = true;
    }
    MPI_Request req = MPI_REQUEST_NULL;
    const int rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv.data() + off,
                                  derived ? 1 : static_cast<int>(len), type, im.comm, &req);
    if (derived) MPI_Type_free(&type);  // pending operations keep it alive
    im.check(rc, op, "MPI_Iallgather");
    im.wait(op, req);
  }
}

template <CommElement T>
void Communicator::all_gather_v(std::span<const T> send, std::span<const std::int64_t> counts,
                                std::span<T> recv) {
  Impl& im = impl();
  const auto op = im.begin("all_gather_v");
  const int p = im.size;
  CPATTN_CHECK(static_cast<int>(counts.size()) == p, "all_gather_v: counts.size() must be size() = ",
               p, ", got ", counts.size());
  std::vector<std::int64_t> offset(p), count(counts.begin(), counts.end());
  std::int64_t total = 0;
  for (int q = 0; q < p; ++q) {
    CPATTN_CHECK(count[q] >= 0, "all_gather_v: counts[", q, "] must be >= 0, got ", count[q]);
    CPATTN_CHECK(count[q] <= INT64_MAX - total, "all_gather_v: counts[", q, "] = ", count[q],
                 " takes sum(counts) past int64");  // (a wrapped sum passed the size checks)
    offset[q] = total;
    total += count[q];
  }
  CPATTN_CHECK(static_cast<std::int64_t>(send.size()) == count[im.rank], "all_gather_v: send.size() ",
               "must be counts[", im.rank, "] = ", count[im.rank], ", got ", send.size());
  CPATTN_CHECK(static_cast<std::int64_t>(recv.size()) == total, "all_gather_v: recv.size() must ",
               "be sum(counts) = ", total, ", got ", recv.size());
  T* own = recv.data() + offset[im.rank];
  const bool in_place = send.data() == own;
  CPATTN_CHECK(in_place || !overlaps(send.data(), send.size_bytes(), recv.data(),
                                     recv.size_bytes()),
               "all_gather_v: send overlaps recv other than exactly at this rank's block");
  if (total == 0) return;
  if (!in_place) std::copy(send.begin(), send.end(), own);
  if (p == 1) return;

  // MPI_Iallgatherv takes int counts and displacements: use it only when the whole receive
  // fits one call; otherwise the ring splits each block.
  if (im.opts.all_gather_algorithm == CommAlgorithm::mpi && total <= im.chunk()) {
    // What the ring would move (bytes_sent's contract): every block but the right neighbour's
    // out, every block but this rank's in.
    im.bytes_sent += (total - count[(im.rank + 1) % p]) * static_cast<std::int64_t>(sizeof(T));
    im.bytes_received += (total - count[im.rank]) * static_cast<std::int64_t>(sizeof(T));
    im.v_count.resize(p);
    im.v_displ.resize(p);
    for (int q = 0; q < p; ++q) {
      im.v_count[q] = static_cast<int>(count[q]);
      im.v_displ[q] = static_cast<int>(offset[q]);
    }
    MPI_Request req = MPI_REQUEST_NULL;
    im.check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv.data(), im.v_count.data(),
                             im.v_displ.data(), mpi_type<T>(), im.comm, &req),
             op, "MPI_Iallgatherv");
    im.wait(op, req);
    return;
  }
  im.ring_all_gather(op, recv.data(), offset, count);
}

std::vector<std::int64_t> Communicator::all_gather_counts(std::int64_t count) {
  impl().counts.resize(static_cast<std::size_t>(impl().size));
  all_gather<std::int64_t>(std::span<const std::int64_t>(&count, 1), impl().counts);
  return impl().counts;
}

void Communicator::reduce_scatter_sum(std::span<const float> send, std::span<float> recv) {
  Impl& im = impl();
  const auto op = im.begin("reduce_scatter_sum");
  const int p = im.size;
  const auto n = static_cast<std::int64_t>(recv.size());
  CPATTN_CHECK(static_cast<std::int64_t>(send.size()) == n * p, "reduce_scatter_sum: send.size() ",
               "must be recv.size() * size() = ", n, " * ", p, ", got ", send.size());
  CPATTN_CHECK(!overlaps(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()),
               "reduce_scatter_sum: send and recv must not overlap");
  if (n == 0) return;
  if (p == 1) {
    std::copy(send.begin(), send.end(), recv.begin());
    return;
  }
  const float* x = send.data();
  const int r = im.rank;

  if (im.opts.reduce_scatter_algorithm == CommAlgorithm::mpi) {
    im.bytes_sent += (p - 1) * n * static_cast<std::int64_t>(sizeof(float));
    im.bytes_received += (p - 1) * n * static_cast<std::int64_t>(sizeof(float));
    for (std::int64_t off = 0; off < n; off += im.chunk()) {
      const std::int64_t len = std::min(im.chunk(), n - off);
      const float* src = x;
      if (len != n) {  // split: stage this chunk of every block contiguously, [p][len]
        im.pack.resize(static_cast<std::size_t>(len * p));
        for (int q = 0; q < p; ++q)
          std::copy_n(x + q * n + off, len, im.pack.data() + q * len);
        src = im.pack.data();
      }
      MPI_Request req = MPI_REQUEST_NULL;
      im.check(MPI_Ireduce_scatter_block(src, recv.data() + off, static_cast<int>(len),
                                         MPI_FLOAT, MPI_SUM, im.comm, &req),
               op, "MPI_Ireduce_scatter_block");
      im.wait(op, req);
    }
    return;
  }

  // Ring, in passes over [off, off + len) of every block. At step s rank r sends its
  // partial sum of block (r - 1 - s) mod p to r + 1, receives the partial of block
  // (r - 2 - s) mod p from r - 1 and adds its own term last. Block b thus starts at rank b + 1
  // and ends at rank b: ((x[b+1] + x[b+2]) + ...) + x[b], an order fixed by the ranks alone.
  // A step moves its block in segments and adds each as it arrives, while later ones fly.
  // Passes of at most 64 segments bound the scratch to 2 x 64 segments (128 MiB).
  const int right = (r + 1) % p;
  const int left = (r + p - 1) % p;
  const std::int64_t seg = std::min(im.chunk(), kReduceScatterSegment);
  const std::int64_t pass = 64 * seg;
  std::vector<MPI_Request> reqs;
  for (std::int64_t off = 0; off < n; off += pass) {
    const std::int64_t len = std::min(pass, n - off);
    if (p > 2) im.scratch.resize(static_cast<std::size_t>(2 * len));
    float* buf[2] = {im.scratch.data(), p > 2 ? im.scratch.data() + len : nullptr};  // p == 2: unused
    const float* out = x + ((r - 1 + p) % p) * n + off;  // step 0 sends own term
    for (int s = 0; s < p - 1; ++s) {
      const int rb = (r - 2 - s + 2 * p) % p;
      float* in = s == p - 2 ? recv.data() + off : buf[s % 2];
      const float* own = x + rb * n + off;
      im.post_recv(op, in, len, left, kTagReduceScatter, reqs, seg);  // reqs[k]: segment k
      const std::size_t nseg = reqs.size();
      im.post_send(op, out, len, right, kTagReduceScatter, reqs, seg);
      for (std::size_t k = 0; k < nseg; ++k) {
        im.wait(op, &reqs[k], 1, im.comm, reqs);
        const std::int64_t lo = static_cast<std::int64_t>(k) * seg;
        const std::int64_t hi = std::min(len, lo + seg);
        for (std::int64_t i = lo; i < hi; ++i) in[i] += own[i];
      }
      im.wait(op, reqs);
      out = in;
    }
  }
}

template <CommReduceElement T>
void Communicator::all_reduce(std::span<T> data, ReduceOp rop) {
  Impl& im = impl();
  const auto op = im.begin(rop == ReduceOp::sum ? "all_reduce(sum)" : "all_reduce(max)");
  const auto n = static_cast<std::int64_t>(data.size());
  if (n == 0 || im.size == 1) return;
  for (std::int64_t off = 0; off < n; off += im.chunk()) {
    const int len = static_cast<int>(std::min(im.chunk(), n - off));
    MPI_Request req = MPI_REQUEST_NULL;
    im.check(MPI_Iallreduce(MPI_IN_PLACE, data.data() + off, len, mpi_type<T>(), mpi_op(rop),
                            im.comm, &req),
             op, "MPI_Iallreduce");
    im.wait(op, req);
  }
}

template <CommElement T>
void Communicator::broadcast(std::span<T> data, int root) {
  Impl& im = impl();
  const auto op = im.begin("broadcast");
  CPATTN_CHECK(root >= 0 && root < im.size, "broadcast: root must be in [0, ", im.size,
               "), got ", root);
  const auto n = static_cast<std::int64_t>(data.size());
  if (n == 0 || im.size == 1) return;
  for (std::int64_t off = 0; off < n; off += im.chunk()) {
    const int len = static_cast<int>(std::min(im.chunk(), n - off));
    MPI_Request req = MPI_REQUEST_NULL;
    im.check(MPI_Ibcast(data.data() + off, len, mpi_type<T>(), root, im.comm, &req), op,
             "MPI_Ibcast");
    im.wait(op, req);
  }
}

void Communicator::barrier() {
  Impl& im = impl();
  const auto op = im.begin("barrier");
  MPI_Request req = MPI_REQUEST_NULL;
  im.check(MPI_Ibarrier(im.comm, &req), op, "MPI_Ibarrier");
  im.wait(op, req);
}

std::int64_t Communicator::bytes_sent() const { return impl().bytes_sent; }
std::int64_t Communicator::bytes_received() const { return impl().bytes_received; }

template <CommElement T>
CommRequest Communicator::start_shift(std::span<const T> send, int dest, std::span<T> recv, int source) {
  Impl& im = impl();
  const auto op = im.begin("shift");
  CPATTN_CHECK(dest >= 0 && dest < im.size && source >= 0 && source < im.size, "shift: dest (", dest,
               ") and source (", source, ") must be ranks in [0, ", im.size, ")");
  CPATTN_CHECK(!overlaps(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()),
               "shift: send and recv must not overlap");
  CommRequest r = im.request(op);
  if (dest == im.rank && source == im.rank) {
    CPATTN_CHECK(send.size() == recv.size(), "shift: to itself, send.size() (", send.size(),
                 ") must equal recv.size() (", recv.size(), ")");
    std::copy(send.begin(), send.end(), recv.begin());
    return r;
  }
  im.post_recv(op, recv.data(), static_cast<std::int64_t>(recv.size()), source, kTagShift, r.reqs_);
  im.post_send(op, send.data(), static_cast<std::int64_t>(send.size()), dest, kTagShift, r.reqs_);
  return r;
}

template <CommElement T>
CommRequest Communicator::start_send(std::span<const T> send, int dest, int tag) {
  Impl& im = impl();
  const auto op = im.begin_p2p("send", "dest", dest, tag);
  CommRequest r = im.request(op);
  im.post_send(op, send.data(), static_cast<std::int64_t>(send.size()), dest, kTagUser + tag, r.reqs_);
  return r;
}

template <CommElement T>
CommRequest Communicator::start_recv(std::span<T> recv, int source, int tag) {
  Impl& im = impl();
  const auto op = im.begin_p2p("recv", "source", source, tag);
  CommRequest r = im.request(op);
  im.post_recv(op, recv.data(), static_cast<std::int64_t>(recv.size()), source, kTagUser + tag, r.reqs_);
  return r;
}

template <CommElement T>
void Communicator::all_to_all_v(std::span<const T> send, std::span<const std::int64_t> send_counts,
                                std::span<T> recv, std::span<const std::int64_t> recv_counts) {
  Impl& im = impl();
  const auto op = im.begin("all_to_all_v");
  const int p = im.size;
  CPATTN_CHECK(static_cast<int>(send_counts.size()) == p && static_cast<int>(recv_counts.size()) == p,
               "all_to_all_v: send_counts.size() and recv_counts.size() must be size() = ", p,
               ", got ", send_counts.size(), " and ", recv_counts.size());
  std::vector<std::int64_t> soff(p), roff(p);
  std::int64_t stotal = 0, rtotal = 0;
  for (int q = 0; q < p; ++q) {
    CPATTN_CHECK(send_counts[q] >= 0 && recv_counts[q] >= 0, "all_to_all_v: counts for rank ", q,
                 " must be >= 0, got send ", send_counts[q], ", recv ", recv_counts[q]);
    CPATTN_CHECK(send_counts[q] <= INT64_MAX - stotal && recv_counts[q] <= INT64_MAX - rtotal,
                 "all_to_all_v: counts for rank ", q, " (send ", send_counts[q], ", recv ", recv_counts[q],
                 ") take a sum of counts past int64");  // (a wrapped sum passed the size checks)
    soff[q] = stotal;
    roff[q] = rtotal;
    stotal += send_counts[q];
    rtotal += recv_counts[q];
  }
  CPATTN_CHECK(static_cast<std::int64_t>(send.size()) == stotal, "all_to_all_v: send.size() must be ",
               "sum(send_counts) = ", stotal, ", got ", send.size());
  CPATTN_CHECK(static_cast<std::int64_t>(recv.size()) == rtotal, "all_to_all_v: recv.size() must be ",
               "sum(recv_counts) = ", rtotal, ", got ", recv.size());
  CPATTN_CHECK(send_counts[im.rank] == recv_counts[im.rank], "all_to_all_v: this rank's own block: ",
               "send_counts[", im.rank, "] = ", send_counts[im.rank], " but recv_counts[", im.rank,
               "] = ", recv_counts[im.rank]);
  CPATTN_CHECK(!overlaps(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()),
               "all_to_all_v: send and recv must not overlap");
  std::copy_n(send.data() + soff[im.rank], send_counts[im.rank], recv.data() + roff[im.rank]);
  if (p == 1) return;
  std::vector<MPI_Request> reqs;
  // Receives first, then sends in the order rank+1, rank+2, ...: every pair posts its
  // messages early and no rank waits on one peer before it has posted to the others.
  for (int s = 1; s < p; ++s) {
    const int q = (im.rank - s + p) % p;
    if (recv_counts[q] > 0) im.post_recv(op, recv.data() + roff[q], recv_counts[q], q, kTagAllToAll, reqs);
  }
  for (int s = 1; s < p; ++s) {
    const int q = (im.rank + s) % p;
    if (send_counts[q] > 0) im.post_send(op, send.data() + soff[q], send_counts[q], q, kTagAllToAll, reqs);
  }
  im.wait(op, reqs);
}

std::vector<std::int64_t> Communicator::all_to_all_counts(std::span<const std::int64_t> send_counts) {
  const int p = impl().size;
  CPATTN_CHECK(static_cast<int>(send_counts.size()) == p, "all_to_all_counts: send_counts.size() ",
               "must be size() = ", p, ", got ", send_counts.size());
  const std::vector<std::int64_t> ones(static_cast<std::size_t>(p), 1);
  std::vector<std::int64_t>& recv = impl().a2a_counts;  // (a timed-out receive may land after this call)
  recv.resize(static_cast<std::size_t>(p));
  all_to_all_v<std::int64_t>(send_counts, ones, recv, ones);
  return recv;
}

void Communicator::wait(CommRequest& r) { wait(r, {}); }

void Communicator::wait(CommRequest& r, const std::function<void()>& between) {
  if (r.reqs_.empty()) return;
  Impl& im = impl();
  CPATTN_CHECK(r.impl_ == &im, "wait: the request was started on another Communicator");
  // The deadline runs from the later of the post and this wait: the rank's own work between
  // them (a ring step's compute) is not the peer's delay.
  const Clock::time_point posted_deadline(
      std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(r.deadline_ns_)));
  const Impl::Op op{r.name_, r.call_,
                    std::max(posted_deadline, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                                std::chrono::duration<double>(im.timeout_s)))};
  std::vector<MPI_Request> reqs = std::move(r.reqs_);
  r.reqs_.clear();
  // On a timeout in throw mode, or a throw of `between`, wait() hands the requests to
  // `pending` (poisoned). `r` is not touched past this point: `between` may move it.
  im.wait(op, reqs.data(), static_cast<int>(reqs.size()), im.comm, {}, between ? &between : nullptr);
}

bool Communicator::test(CommRequest& r) {
  if (r.reqs_.empty()) return true;
  Impl& im = impl();
  CPATTN_CHECK(r.impl_ == &im, "test: the request was started on another Communicator");
  const Impl::Op op{r.name_, r.call_, Clock::time_point{}};
  int done = 0;
  im.check(MPI_Testall(static_cast<int>(r.reqs_.size()), r.reqs_.data(), &done, MPI_STATUSES_IGNORE), op,
           "MPI_Testall");
  if (done) r.reqs_.clear();
  return done != 0;
}

CommRequest::~CommRequest() {
  if (reqs_.empty() || impl_ == nullptr) return;
  auto* im = static_cast<Communicator::Impl*>(impl_);
  try {
    for (MPI_Request q : reqs_)
      if (q != MPI_REQUEST_NULL) im->pending.push_back(q);
    if (!im->poisoned) {
      im->poisoned = true;
      im->poisoned_by = std::string(name_) + " (call #" + std::to_string(call_) + ", dropped before wait)";
    }
  } catch (...) {  // out of memory: a request not recorded would let its buffers be freed under it
    end_job_unkept(im->rank, name_, call_, im->opts.abort_code);
  }
}
CommRequest::CommRequest(CommRequest&& o) noexcept
    : impl_(o.impl_), name_(o.name_), call_(o.call_), deadline_ns_(o.deadline_ns_), reqs_(std::move(o.reqs_)) {
  o.reqs_.clear();
}
CommRequest& CommRequest::operator=(CommRequest&& o) noexcept {
  if (this != &o) {
    CommRequest old(std::move(*this));
    impl_ = o.impl_;
    name_ = o.name_;
    call_ = o.call_;
    deadline_ns_ = o.deadline_ns_;
    reqs_ = std::move(o.reqs_);
    o.reqs_.clear();
  }
  return *this;
}

#define CPATTN_COMM_INSTANTIATE(T)                                                          \
  template CommRequest Communicator::start_shift<T>(std::span<const T>, int, std::span<T>, int); \
  template void Communicator::all_gather<T>(std::span<const T>, std::span<T>);             \
  template void Communicator::all_gather_v<T>(std::span<const T>,                          \
                                              std::span<const std::int64_t>, std::span<T>); \
  template void Communicator::broadcast<T>(std::span<T>, int);                               \
  template CommRequest Communicator::start_send<T>(std::span<const T>, int, int);          \
  template CommRequest Communicator::start_recv<T>(std::span<T>, int, int);                \
  template void Communicator::all_to_all_v<T>(std::span<const T>, std::span<const std::int64_t>, \
                                              std::span<T>, std::span<const std::int64_t>);
CPATTN_COMM_INSTANTIATE(float)
CPATTN_COMM_INSTANTIATE(double)
CPATTN_COMM_INSTANTIATE(std::int32_t)
CPATTN_COMM_INSTANTIATE(std::int64_t)
CPATTN_COMM_INSTANTIATE(std::uint16_t)
CPATTN_COMM_INSTANTIATE(std::byte)
#undef CPATTN_COMM_INSTANTIATE
template void Communicator::all_reduce<float>(std::span<float>, ReduceOp);
template void Communicator::all_reduce<double>(std::span<double>, ReduceOp);
template void Communicator::all_reduce<std::int64_t>(std::span<std::int64_t>, ReduceOp);


}  // namespace cpattn
