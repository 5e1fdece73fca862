// The communicator's collectives against hand-computed results, at any number of ranks (CTest
// runs 1, 2, 3 and 4), for both algorithms and with calls split into tiny pieces.
// Plain MPI calls here are deliberate: checks of the duplicate (MPI_Comm_compare) and fault
// injection (a raw trio and messages that hold a rank back) outside the Communicator under test.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "error_of.hpp"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mpi_world.hpp"
#include "cpattn/comm.hpp"
#include "cpattn/node_buffer.hpp"
#include "cpattn/error.hpp"

namespace cpattn {
namespace {

using ::cpattn::mpi_test::world_rank;
using ::cpattn::mpi_test::world_size;

// A test that fails on one rank must not leave the others waiting for the default 300 s.
constexpr double kTestTimeoutS = 60;

struct Setup {
  CommAlgorithm algorithm;
  std::int64_t max_count_per_call;
};

std::string setup_name(const ::testing::TestParamInfo<Setup>& info) {
  return std::string(info.param.algorithm == CommAlgorithm::ring ? "ring" : "mpi") + "_chunk" +
         (info.param.max_count_per_call == INT_MAX
              ? std::string("Max")
              : std::to_string(info.param.max_count_per_call));
}

class Collectives : public ::testing::TestWithParam<Setup> {
 protected:
  Communicator make() const {
    return Communicator(MPI_COMM_WORLD,
                        {.timeout_s = kTestTimeoutS,
                         .on_timeout = TimeoutAction::throw_error,
                         .max_count_per_call = GetParam().max_count_per_call,
                         .reduce_scatter_algorithm = GetParam().algorithm,
                         .all_gather_algorithm = GetParam().algorithm});
  }
};

TEST_P(Collectives, RankSizeAndPrivateDuplicate) {
  Communicator comm = make();
  EXPECT_EQ(comm.rank(), world_rank());
  EXPECT_EQ(comm.size(), world_size());
  int cmp = MPI_UNEQUAL;
  MPI_Comm_compare(comm.mpi_comm(), MPI_COMM_WORLD, &cmp);
  EXPECT_EQ(cmp, MPI_CONGRUENT);  // same group, its own context
  EXPECT_EQ(comm.calls(), 0);
  comm.barrier();
  comm.barrier();
  EXPECT_EQ(comm.calls(), 2);
}

// Rank q's block holds q * 100 + i; the gather puts block q at q * n.
template <class T>
void check_all_gather(Communicator& comm, std::int64_t n, bool in_place) {
  const int p = comm.size(), r = comm.rank();
  std::vector<T> send(n), recv(n * p, T{});
  for (std::int64_t i = 0; i < n; ++i) send[i] = static_cast<T>(r * 100 + i);
  const auto before = comm.calls();
  if (in_place) {
    std::copy(send.begin(), send.end(), recv.begin() + r * n);
    comm.all_gather<T>(std::span<const T>(recv.data() + r * n, n), recv);
  } else {
    comm.all_gather<T>(send, recv);
  }
  EXPECT_EQ(comm.calls(), before + 1);  // one call number however many MPI calls it took
  for (int q = 0; q < p; ++q)
    for (std::int64_t i = 0; i < n; ++i)
      ASSERT_EQ(recv[q * n + i], static_cast<T>(q * 100 + i)) << "block " << q << " elem " << i;
}

TEST_P(Collectives, AllGatherEveryType) {
  Communicator comm = make();
  for (const std::int64_t n : {0, 1, 7, 64}) {
    check_all_gather<float>(comm, n, false);
    check_all_gather<double>(comm, n, false);
    check_all_gather<std::int32_t>(comm, n, false);
    check_all_gather<std::int64_t>(comm, n, false);
    check_all_gather<std::uint16_t>(comm, n, false);
    check_all_gather<float>(comm, n, true);
  }
}

TEST_P(Collectives, AllGatherBytesAndFp16Bits) {
  Communicator comm = make();
  const int p = comm.size(), r = comm.rank();
  // fp16/bf16 storage moves bit for bit: 0x7e00 (a NaN), 0xffff, 0x8000 (-0).
  std::vector<std::uint16_t> bits{0x7e00, 0xffff, 0x8000, static_cast<std::uint16_t>(r)};
  std::vector<std::uint16_t> all_bits(4 * p);
  comm.all_gather<std::uint16_t>(bits, all_bits);
  std::vector<std::byte> blob{std::byte{0xab}, static_cast<std::byte>(r), std::byte{0}};
  std::vector<std::byte> blobs(3 * p);
  comm.all_gather<std::byte>(blob, blobs);
  for (int q = 0; q < p; ++q) {
    EXPECT_EQ(all_bits[4 * q + 0], 0x7e00);
    EXPECT_EQ(all_bits[4 * q + 1], 0xffff);
    EXPECT_EQ(all_bits[4 * q + 2], 0x8000);
    EXPECT_EQ(all_bits[4 * q + 3], q);
    EXPECT_EQ(blobs[3 * q + 0], std::byte{0xab});
    EXPECT_EQ(blobs[3 * q + 1], static_cast<std::byte>(q));
    EXPECT_EQ(blobs[3 * q + 2], std::byte{0});
  }
}

// counts[q]: rank q sends counts[q] values q * 1000 + i.
void check_all_gather_v(Communicator& comm, const std::vector<std::int64_t>& counts) {
  const int p = comm.size(), r = comm.rank();
  std::vector<float> send(counts[r]);
  for (std::int64_t i = 0; i < counts[r]; ++i) send[i] = static_cast<float>(r * 1000 + i);
  std::int64_t total = 0;
  for (auto c : counts) total += c;
  std::vector<float> recv(total, -1.0f);
  const auto sent = comm.bytes_sent(), recvd = comm.bytes_received();
  comm.all_gather_v<float>(send, counts, recv);
  std::int64_t at = 0;
  for (int q = 0; q < p; ++q)
    for (std::int64_t i = 0; i < counts[q]; ++i, ++at)
      ASSERT_EQ(recv[at], static_cast<float>(q * 1000 + i)) << "rank " << q << " elem " << i;
  // The bytes a ring moves, whichever algorithm ran: each rank passes on every block but its
  // right neighbour's (the last one it receives) and receives every block but its own.
  const auto fs = static_cast<std::int64_t>(sizeof(float));
  EXPECT_EQ(comm.bytes_sent() - sent, (total - counts[(r + 1) % p]) * fs);
  EXPECT_EQ(comm.bytes_received() - recvd, (total - counts[r]) * fs);
}

TEST_P(Collectives, AllGatherVaryingCountsWithZeros) {
  Communicator comm = make();
  const int p = comm.size();
  std::vector<std::int64_t> counts(p);
  for (int q = 0; q < p; ++q) counts[q] = q % 2 == 1 ? 0 : 2 * q + 3;  // 3, 0, 7, 0
  check_all_gather_v(comm, counts);
  for (int q = 0; q < p; ++q) counts[q] = q == p - 1 ? 11 : 0;  // only the last rank
  check_all_gather_v(comm, counts);
  std::fill(counts.begin(), counts.end(), 0);  // nothing at all
  check_all_gather_v(comm, counts);
  for (int q = 0; q < p; ++q) counts[q] = 5 + q;  // all different, none zero
  check_all_gather_v(comm, counts);
}

TEST_P(Collectives, AllGatherCounts) {
  Communicator comm = make();
  const auto counts = comm.all_gather_counts(int64_t{1} << 40 | comm.rank());
  ASSERT_EQ(static_cast<int>(counts.size()), comm.size());
  for (int q = 0; q < comm.size(); ++q) EXPECT_EQ(counts[q], int64_t{1} << 40 | q);
}

// x[q][b][i] = (q + 1) * (b + 1) + (q + 1)^2 * i / 2, so rank b receives
// (b + 1) * p(p+1)/2 + i/2 * p(p+1)(2p+1)/6: halves and small integers, exact in fp32.
TEST_P(Collectives, ReduceScatterSumHandComputed) {
  Communicator comm = make();
  const int p = comm.size(), r = comm.rank();
  for (const std::int64_t n : {1, 7, 100}) {
    std::vector<float> send(n * p), recv(n, -1.0f);
    for (int b = 0; b < p; ++b)
      for (std::int64_t i = 0; i < n; ++i)
        send[b * n + i] = static_cast<float>((r + 1) * (b + 1) + (r + 1) * (r + 1) * 0.5 * static_cast<double>(i));
    comm.reduce_scatter_sum(send, recv);
    const double s1 = p * (p + 1) / 2.0, s2 = p * (p + 1) * (2 * p + 1) / 6.0;
    for (std::int64_t i = 0; i < n; ++i)
      ASSERT_EQ(recv[i], static_cast<float>((r + 1) * s1 + 0.5 * static_cast<double>(i) * s2)) << "n " << n << " i " << i;
  }
  std::vector<float> none;
  comm.reduce_scatter_sum(none, none);  // n = 0 is fine
}

// The ring's documented order: block b is ((x[b+1] + x[b+2]) + ...) + x[b]. With x[b+1] = 1e8,
// x[b+2] = -1e8 and 1 elsewhere the big terms cancel first and every 1 survives (summing in
// rank order instead would lose the 1s added to 1e8: fp32's spacing there is 8).
TEST_P(Collectives, RingReduceScatterOrderIsFixed) {
  if (GetParam().algorithm != CommAlgorithm::ring) GTEST_SKIP() << "order is MPI's";
  Communicator comm = make();
  const int p = comm.size(), r = comm.rank();
  if (p < 3) GTEST_SKIP() << "needs 3 ranks";
  const std::int64_t n = 5;
  std::vector<float> send(n * p);
  for (int b = 0; b < p; ++b) {
    const float x = r == (b + 1) % p ? 1e8f : r == (b + 2) % p ? -1e8f : 1.0f;
    std::fill_n(send.begin() + b * n, n, x);
  }
  std::vector<float> first(n), again(n);
  comm.reduce_scatter_sum(send, first);
  for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(first[i], static_cast<float>(p - 2));
  for (int rep = 0; rep < 10; ++rep) {
    comm.reduce_scatter_sum(send, again);
    ASSERT_EQ(std::memcmp(first.data(), again.data(), n * sizeof(float)), 0);
  }
}

TEST_P(Collectives, AllReduceSumMax) {
  Communicator comm = make();
  const int p = comm.size(), r = comm.rank();
  const std::int64_t n = 9;
  std::vector<float> f(n);
  std::vector<double> d(n);
  std::vector<std::int64_t> l(n);
  auto fill = [&] {
    for (std::int64_t i = 0; i < n; ++i) {
      f[i] = static_cast<float>((r + 1) * i);
      d[i] = static_cast<double>((r + 1) * i) + 0.25;
      l[i] = (int64_t{1} << 40) * (r + 1) + i;  // past 2^32: 64-bit all the way
    }
  };
  fill();
  comm.all_reduce<float>(f, ReduceOp::sum);
  comm.all_reduce<double>(d, ReduceOp::sum);
  comm.all_reduce<std::int64_t>(l, ReduceOp::sum);
  const std::int64_t s1 = p * (p + 1) / 2;
  for (std::int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(f[i], static_cast<float>(s1 * i));
    EXPECT_EQ(d[i], static_cast<double>(s1 * i) + 0.25 * p);
    EXPECT_EQ(l[i], (int64_t{1} << 40) * s1 + p * i);
  }
  fill();
  comm.all_reduce<float>(f, ReduceOp::max);
  comm.all_reduce<double>(d, ReduceOp::max);
  comm.all_reduce<std::int64_t>(l, ReduceOp::max);
  for (std::int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(f[i], static_cast<float>(p * i));
    EXPECT_EQ(d[i], static_cast<double>(p * i) + 0.25);
    EXPECT_EQ(l[i], (int64_t{1} << 40) * p + i);
  }
}

TEST_P(Collectives, BroadcastFromLastRank) {
  Communicator comm = make();
  const int p = comm.size(), r = comm.rank();
  std::vector<std::int64_t> l(13, r);
  std::vector<std::uint16_t> h(6, static_cast<std::uint16_t>(r));
  if (r == p - 1)
    for (int i = 0; i < 13; ++i) l[i] = 1000 + i;
  comm.broadcast<std::int64_t>(l, p - 1);
  comm.broadcast<std::uint16_t>(h, p - 1);
  for (int i = 0; i < 13; ++i) EXPECT_EQ(l[i], 1000 + i);
  for (auto v : h) EXPECT_EQ(v, p - 1);
  EXPECT_THROW(comm.broadcast<std::int64_t>(l, p), Error);
}

TEST_P(Collectives, ShiftAroundTheRingWithTwoInFlightAndCountsBytes) {
  Communicator comm = make();
  const int p = comm.size(), r = comm.rank();
  const int right = (r + 1) % p, left = (r + p - 1) % p;
  for (const std::int64_t n : {0, 1, 7, 300}) {
    std::vector<float> a(n), ra(n, -1.0f);
    std::vector<std::uint16_t> b(2 * n), rb(2 * n, 0);
    for (std::int64_t i = 0; i < n; ++i) a[i] = static_cast<float>(r * 1000 + i);
    for (std::int64_t i = 0; i < 2 * n; ++i) b[i] = static_cast<std::uint16_t>(r * 7 + i);
    const auto calls = comm.calls();
    const auto sent = comm.bytes_sent(), recvd = comm.bytes_received();
    CommRequest qa = comm.start_shift<float>(a, right, ra, left);
    CommRequest qb = comm.start_shift<std::uint16_t>(b, right, rb, left);
    comm.wait(qb);  // any order of waits
    comm.wait(qa);
    EXPECT_FALSE(qa.active());
    EXPECT_EQ(comm.calls(), calls + 2);
    for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(ra[i], static_cast<float>(left * 1000 + i));
    for (std::int64_t i = 0; i < 2 * n; ++i) ASSERT_EQ(rb[i], static_cast<std::uint16_t>(left * 7 + i));
    const std::int64_t bytes = p == 1 ? 0 : n * 4 + 2 * n * 2;  // to itself: a copy, not counted
    EXPECT_EQ(comm.bytes_sent() - sent, bytes);
    EXPECT_EQ(comm.bytes_received() - recvd, bytes);
  }
  std::vector<float> x(4), y(4);
  EXPECT_THROW(comm.shift<float>(x, p, y, 0), Error);  // no such rank
}

// Rank r sends (q + r) % 3 elements to rank q (zeros included): element i of the block from
// rank r to q is r * 10000 + q * 100 + i, so every receiver checks the sender and its place.
TEST_P(Collectives, AllToAllVaryingCountsWithZeros) {
  Communicator comm = make();
  const int p = comm.size(), r = comm.rank();
  std::vector<std::int64_t> sc(p);
  for (int q = 0; q < p; ++q) sc[q] = (q + r) % 3;
  const auto rc = comm.all_to_all_counts(sc);
  ASSERT_EQ(static_cast<int>(rc.size()), p);
  for (int q = 0; q < p; ++q) EXPECT_EQ(rc[q], (r + q) % 3) << "from rank " << q;
  std::vector<std::int32_t> send, recv;
  for (int q = 0; q < p; ++q)
    for (std::int64_t i = 0; i < sc[q]; ++i) send.push_back(r * 10000 + q * 100 + static_cast<int>(i));
  std::int64_t total = 0;
  for (const auto c : rc) total += c;
  recv.assign(static_cast<std::size_t>(total), -1);
  const auto sent = comm.bytes_sent();
  comm.all_to_all_v<std::int32_t>(send, sc, recv, rc);
  std::size_t at = 0;
  for (int q = 0; q < p; ++q)
    for (std::int64_t i = 0; i < rc[q]; ++i, ++at)
      ASSERT_EQ(recv[at], q * 10000 + r * 100 + static_cast<int>(i)) << "from rank " << q;
  std::int64_t others = 0;
  for (int q = 0; q < p; ++q) others += q == r ? 0 : sc[q];
  EXPECT_EQ(comm.bytes_sent() - sent, others * 4);  // its own block is a copy
  std::vector<std::int64_t> wrong(rc);
  wrong[r] += 1;  // own block's counts disagree: refused before any message
  std::vector<std::int32_t> big(recv.size() + 1);
  EXPECT_THROW(comm.all_to_all_v<std::int32_t>(send, sc, big, wrong), Error);
  comm.barrier();  // still usable
}

// One-directional messages: rank r sends to r + 1 on two tags, started in one order and
// received in the other; the tags keep the streams apart.
TEST_P(Collectives, SendRecvOnTagsAlongTheLine) {
  Communicator comm = make();
  const int p = comm.size(), r = comm.rank();
  if (p < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<double> a(5), b(3), ra(5, -1), rb(3, -1);
  for (int i = 0; i < 5; ++i) a[i] = r + 0.25 * i;
  for (int i = 0; i < 3; ++i) b[i] = -r - 0.5 * i;
  std::vector<CommRequest> reqs;
  if (r + 1 < p) {
    reqs.push_back(comm.start_send<double>(a, r + 1, 1));
    reqs.push_back(comm.start_send<double>(b, r + 1, 2));
  }
  if (r > 0) {
    reqs.push_back(comm.start_recv<double>(rb, r - 1, 2));
    reqs.push_back(comm.start_recv<double>(ra, r - 1, 1));
  }
  for (auto& q : reqs) comm.wait(q);
  if (r > 0) {
    for (int i = 0; i < 5; ++i) EXPECT_EQ(ra[i], (r - 1) + 0.25 * i);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(rb[i], -(r - 1) - 0.5 * i);
  }
  // Bad arguments: the error names the call, the argument and the rule.
  using cpattn::testing::error_of;
  const std::string others =
      "must be another rank in [0, " + std::to_string(p) + "), this is rank " + std::to_string(r);
  const std::string to_itself = error_of([&] { (void)comm.start_send<double>(a, r, 0); });
  const std::string no_rank = error_of([&] { (void)comm.start_recv<double>(ra, p, 0); });
  const std::string tag_high = error_of([&] { (void)comm.start_send<double>(a, (r + 1) % p, 1000); });
  const std::string tag_low = error_of([&] { (void)comm.start_recv<double>(ra, (r + 1) % p, -1); });
  EXPECT_NE(to_itself.find("send: dest (" + std::to_string(r) + ") " + others), std::string::npos) << to_itself;
  EXPECT_NE(no_rank.find("recv: source (" + std::to_string(p) + ") " + others), std::string::npos) << no_rank;
  EXPECT_NE(tag_high.find("send: tag must be in [0, 1000), got 1000"), std::string::npos) << tag_high;
  EXPECT_NE(tag_low.find("recv: tag must be in [0, 1000), got -1"), std::string::npos) << tag_low;
  comm.barrier();
}

TEST_P(Collectives, BadSizesThrowBeforeCommunicating) {
  Communicator comm = make();
  std::vector<float> a(3), b(3 * comm.size() + 1);
  EXPECT_THROW(comm.all_gather<float>(a, b), Error);
  EXPECT_THROW(comm.reduce_scatter_sum(b, a), Error);
  std::vector<std::int64_t> counts(comm.size() + 1, 0);
  EXPECT_THROW(comm.all_gather_v<float>(a, counts, b), Error);
  // Counts whose sum wraps past int64 to the buffers' sizes (two peers' INT64_MAX: -2, plus
  // this rank's): refused, where they passed the size checks and the copies went before the
  // buffers (a heap write at recv - 2 in all_gather_v).
  if (const int p = comm.size(), r = comm.rank(); p >= 3) {
    std::vector<std::int64_t> wrap(static_cast<std::size_t>(p), 0);
    wrap[static_cast<std::size_t>((r + 1) % p)] = wrap[static_cast<std::size_t>((r + 2) % p)] = INT64_MAX;
    wrap[static_cast<std::size_t>(r)] = 5;
    std::vector<float> five(5), three(3);
    EXPECT_THAT(cpattn::testing::error_of([&] { comm.all_gather_v<float>(five, wrap, three); }),
                ::testing::HasSubstr("takes sum(counts) past int64"));
    wrap[static_cast<std::size_t>(r)] = 2;
    std::vector<std::int64_t> recv_counts(static_cast<std::size_t>(p), 0);
    recv_counts[static_cast<std::size_t>(r)] = 2;
    std::vector<float> none, two(2);
    EXPECT_THAT(cpattn::testing::error_of([&] { comm.all_to_all_v<float>(none, wrap, two, recv_counts); }),
                ::testing::HasSubstr("take a sum of counts past int64"));
  }
  comm.barrier();  // still usable
}

// drain() takes a deadline in [0, 1e7] seconds: NaN and infinity were undefined conversions
// (infinity, "wait for ever", returned after one test).
TEST(Deadline, DrainRefusesATimeoutOutsideItsRange) {
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS});
  using cpattn::testing::error_of;
  for (const double t : {std::nan(""), std::numeric_limits<double>::infinity(), -1.0, 1e8})
    EXPECT_THAT(error_of([&] { (void)comm.drain(t); }), ::testing::HasSubstr("drain: timeout_s must be in [0, "))
        << t;
  EXPECT_TRUE(comm.drain(0.0));  // nothing pending
}

TEST(NodeBufferTest, ASizePastTheLargestMappingIsRefusedBeforeCommunicating) {
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS});
  for (const std::size_t bytes : {std::numeric_limits<std::size_t>::max(), std::size_t{1} << 63})
    EXPECT_THAT(cpattn::testing::error_of([&] { (void)NodeBuffer::create(comm, bytes); }),
                ::testing::HasSubstr("NodeBuffer::create: bytes must be at most 2^63 - 65, got " +
                                     std::to_string(bytes)));
  comm.barrier();  // nothing sent: still in step
}

INSTANTIATE_TEST_SUITE_P(Comm, Collectives,
                         ::testing::Values(Setup{CommAlgorithm::ring, INT_MAX},
                                         Setup{CommAlgorithm::mpi, INT_MAX},
                                         Setup{CommAlgorithm::ring, 3},
                                         Setup{CommAlgorithm::mpi, 3},
                                         Setup{CommAlgorithm::ring, 1},
                                         Setup{CommAlgorithm::mpi, 1}),
                         setup_name);

TEST(CommOptionsTest, TimeoutFromEnvironmentAndOptions) {
  ASSERT_EQ(setenv("CPATTN_COMM_TIMEOUT_S", "7.5", 1), 0);
  EXPECT_EQ(Communicator(MPI_COMM_WORLD).timeout_s(), 7.5);
  EXPECT_EQ(Communicator(MPI_COMM_WORLD, {.timeout_s = 2}).timeout_s(), 2);  // explicit wins
  ASSERT_EQ(setenv("CPATTN_COMM_TIMEOUT_S", "soon", 1), 0);
  EXPECT_THROW(Communicator{MPI_COMM_WORLD}, Error);
  ASSERT_EQ(unsetenv("CPATTN_COMM_TIMEOUT_S"), 0);
  EXPECT_EQ(Communicator(MPI_COMM_WORLD).timeout_s(), 300);
  EXPECT_THROW(Communicator(MPI_COMM_WORLD, {.timeout_s = 0}), Error);
  EXPECT_THROW(Communicator(MPI_COMM_WORLD, {.timeout_s = 2, .max_count_per_call = 0}), Error);
  EXPECT_THROW(Communicator(MPI_COMM_NULL), Error);
}

TEST(CommOptionsTest, RanksThatDisagreeOnOptionsFailTogether) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size < 2) GTEST_SKIP() << "needs two ranks";
  CommOptions mine{.timeout_s = 30.0};
  if (rank == size - 1) mine.max_count_per_call = 2;  // would misplace ring segments
  try {
    Communicator comm(MPI_COMM_WORLD, mine);
    ADD_FAILURE() << "no error on rank " << rank;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ranks disagree on CommOptions::max_count_per_call"), std::string::npos)
        << e.what();
  }
  // A value only one rank rejects: every rank fails with its message, at once (checked before
  // the duplication, the other ranks waited in it until the deadline and aborted).
  CommOptions bad{.timeout_s = 30.0, .on_timeout = TimeoutAction::throw_error};
  if (rank == size - 1) bad.max_count_per_call = 0;
  const auto start = std::chrono::steady_clock::now();
  try {
    Communicator comm(MPI_COMM_WORLD, bad);
    ADD_FAILURE() << "no error on rank " << rank;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CommOptions::max_count_per_call must be in [1, INT_MAX], got 0 on rank " +
                                         std::to_string(size - 1)),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
  // The same for a deadline only one rank finds invalid (its own environment's variable).
  if (rank == size - 1) {
    ASSERT_EQ(setenv("CPATTN_COMM_TIMEOUT_S", "soon", 1), 0);
  }
  const auto start2 = std::chrono::steady_clock::now();
  try {
    Communicator comm(MPI_COMM_WORLD, {.on_timeout = TimeoutAction::throw_error});
    ADD_FAILURE() << "no error on rank " << rank;
  } catch (const Error& e) {
    const std::string what = e.what();
    std::string want = "the deadline (CommOptions::timeout_s, else CPATTN_COMM_TIMEOUT_S) is invalid on rank(s) ";
    want += std::to_string(size - 1);
    EXPECT_NE(what.find(want), std::string::npos) << what;
    if (rank == size - 1) {
      EXPECT_NE(what.find("got 'soon'"), std::string::npos) << what;
    }
  }
  if (rank == size - 1) {
    ASSERT_EQ(unsetenv("CPATTN_COMM_TIMEOUT_S"), 0);
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start2).count(), 10.0);
  CommOptions algo{.timeout_s = 30.0};
  if (rank == 0) algo.reduce_scatter_algorithm = CommAlgorithm::mpi;
  EXPECT_THROW(Communicator(MPI_COMM_WORLD, algo), Error);
  EXPECT_THROW(Communicator(MPI_COMM_WORLD, CommOptions{.timeout_s = std::numeric_limits<double>::infinity()}),
               Error);
}

TEST(CommOptionsTest, MoveKeepsOneDuplicate) {
  Communicator a(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS});
  Communicator b(std::move(a));
  b.barrier();
  a = std::move(b);
  a.barrier();
  EXPECT_EQ(a.calls(), 2);
  // The moved-from one (which a borrower such as a CpAttention may still hold): an error, not a
  // read through null.
  EXPECT_THROW((void)b.rank(), Error);
  EXPECT_THROW(b.barrier(), Error);
}

// ---- agreement ----

TEST(Agree, DescribeDisagreementText) {
  Fingerprint fp;
  fp.add("tokens", 0).add("num_heads_q", 0).add("dtype", 0);
  // 6 ranks; num_heads_q differs on rank 4, dtype on ranks 1 and 5.
  const std::vector<std::int64_t> all{100, 8, 1, 100, 8, 2, 100, 8, 1,
                                      100, 8, 1, 100, 4, 1, 100, 8, 2};
  EXPECT_EQ(describe_disagreement(fp, all, 6, "attention forward").value(),
            "ranks disagree on attention forward: num_heads_q: ranks 0-3,5 have 8, rank 4 has 4; "
            "dtype: ranks 0,2-4 have 1, ranks 1,5 have 2");
  const std::vector<std::int64_t> same{1, 2, 3, 1, 2, 3};
  EXPECT_FALSE(describe_disagreement(fp, same, 2, "x").has_value());
  EXPECT_THROW(describe_disagreement(fp, same, 3, "x"), Error);
}

TEST(Agree, SameFingerprintPasses) {
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS});
  Fingerprint fp;
  fp.add("tokens", 4096).add("num_heads_q", 8).add("call", 1);
  EXPECT_NO_THROW(agree(comm, fp, "attention forward"));
}

std::string expected_ranks(int p) {  // all but the last rank, as format_ranks writes them
  if (p == 2) return "rank 0 has";
  if (p == 3) return "ranks 0,1 have";
  return "ranks 0-" + std::to_string(p - 2) + " have";
}

TEST(Agree, OneRankDiffersSameErrorEverywhere) {
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS});
  const int p = comm.size(), r = comm.rank();
  if (p < 2) GTEST_SKIP() << "needs 2 ranks";
  Fingerprint fp;
  fp.add("tokens", 4096).add("num_heads_q", r == p - 1 ? 4 : 8).add("call", 1);
  std::string msg;
  try {
    agree(comm, fp, "attention forward");
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg, "ranks disagree on attention forward: num_heads_q: " + expected_ranks(p) +
                     " 8, rank " + std::to_string(p - 1) + " has 4");
  // Every rank holds the same text: compare lengths and a checksum across ranks.
  std::vector<std::int64_t> sig{static_cast<std::int64_t>(msg.size()),
                                static_cast<std::int64_t>(std::hash<std::string>{}(msg))};
  std::vector<std::int64_t> mx = sig, mn = sig;
  comm.all_reduce<std::int64_t>(mx, ReduceOp::max);
  for (auto& v : mn) v = -v;
  comm.all_reduce<std::int64_t>(mn, ReduceOp::max);
  EXPECT_EQ(mx[0], -mn[0]);
  EXPECT_EQ(mx[1], -mn[1]);
}

// add_min's fields differ freely: not compared, and agree() returns each one's minimum over
// the ranks, in the order added, with fewer fields than fit inline and with more (the second
// all-gather's path).
TEST(Agree, MinFieldsAreNotComparedButReduced) {
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS});
  const int p = comm.size(), r = comm.rank();
  for (const int padding : {0, 60}) {
    SCOPED_TRACE(::testing::Message() << padding << " more fields");
    Fingerprint fp;
    fp.add("tokens", 4096).add_min("rank + 10", r + 10).add_min("free", r == p - 1 ? 0 : 1);
    for (int i = 0; i < padding; ++i) fp.add("field " + std::to_string(i), i);
    const std::vector<std::int64_t> minima = agree(comm, fp, "x");
    EXPECT_EQ(minima, (std::vector<std::int64_t>{10, 0}));  // the last rank has 0
  }
  Fingerprint both;  // bitwise AND: bit r clear on rank r only
  both.add_min("min", 7).add_and("and", ~(std::int64_t{1} << (r % 60)));
  std::int64_t want = ~std::int64_t{0};
  for (int q = 0; q < p; ++q) want &= ~(std::int64_t{1} << (q % 60));
  EXPECT_EQ(agree(comm, both, "x"), (std::vector<std::int64_t>{7, want}));
  Fingerprint fp;
  fp.add("a", 1).add_min("b", r);
  const std::vector<std::int64_t> all{1, 0, 1, 5, 1, 9};  // b differs: no disagreement
  EXPECT_FALSE(describe_disagreement(fp, all, 3, "x").has_value());
  EXPECT_TRUE(agree(comm, Fingerprint{}.add("a", 1), "x").empty());
}

// A field compared on one rank and reduced on another (add against add_min or add_and, under
// one name) is a disagreement on every rank: the ranks that reduced it went on alone and left
// the others waiting.
TEST(Agree, AFieldReducedOnSomeRanksOnlyIsADisagreement) {
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS});
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (const bool by_min : {true, false}) {
    Fingerprint fp;
    fp.add("tokens", 4096);
    if (comm.rank() == 0) fp.add("free", 1);
    else if (by_min) fp.add_min("free", 1);
    else fp.add_and("free", 1);
    EXPECT_THAT(cpattn::testing::error_of([&] { (void)agree(comm, fp, "x"); }),
                ::testing::HasSubstr("fingerprint field names and reductions (hash)"));
  }
  comm.barrier();
}

// A buffer every rank maps: what one rank writes, the others read after a barrier, at their
// own addresses; a second buffer is another file; sizes of 0 and of a few MiB.
TEST(NodeBufferTest, EveryRankSeesTheOthersWritesAfterABarrier) {
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS});
  const int p = comm.size(), r = comm.rank();
  const std::size_t n = 3 << 20;
  std::string why;
  const std::unique_ptr<NodeBuffer> a = NodeBuffer::create(comm, n, &why), b = NodeBuffer::create(comm, 64, &why),
                                    c = NodeBuffer::create(comm, 0, &why);
  ASSERT_NE(a, nullptr) << why;  // the test's ranks share a host
  ASSERT_NE(b, nullptr) << why;
  ASSERT_NE(c, nullptr) << why;
  EXPECT_EQ(a->size(), n);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a->data()) % 64, 0u);
  const std::size_t slot = n / static_cast<std::size_t>(p);
  std::memset(a->data() + r * slot, r + 1, slot);
  if (r == 0) std::memset(b->data(), 0x5a, 64);  // another file: a's bytes stay
  comm.barrier();
  EXPECT_EQ(b->data()[63], std::byte{0x5a});
  for (int q = 0; q < p; ++q) {
    const std::byte* x = a->data() + q * slot;
    EXPECT_EQ(x[0], std::byte(q + 1)) << "rank " << q << "'s slot";
    EXPECT_EQ(x[slot - 1], std::byte(q + 1)) << "rank " << q << "'s slot";
  }
  comm.barrier();  // nobody writes again before everyone has read
}

TEST(Agree, OtherFieldListFailsBeforeGatheringValues) {
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS});
  const int p = comm.size(), r = comm.rank();
  if (p < 2) GTEST_SKIP() << "needs 2 ranks";
  Fingerprint fp;
  fp.add("tokens", 4096);
  if (r == p - 1) fp.add("extra", 1);
  try {
    agree(comm, fp, "attention forward");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fingerprint field count: " + expected_ranks(p) + " 1"),
              std::string::npos)
        << e.what();
  }
  comm.barrier();  // nothing left in flight
}

// ---- deadlines ----

// The last rank arrives 2.5 s late at an all-reduce whose deadline is 1 s: the others get the
// error naming the operation and its call number, then drain the request the late rank
// completes, so nothing is left hanging.
// A shift under the deadline: the late rank's neighbours time out with the usual line.
TEST(Deadline, LateShiftMakesOthersThrow) {
  const int p = world_size(), r = world_rank();
  if (p < 2) GTEST_SKIP() << "needs 2 ranks";
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = 1.0, .on_timeout = TimeoutAction::throw_error});
  comm.barrier();  // call #1
  std::vector<double> send{static_cast<double>(r)}, recv{-1.0};
  if (r == p - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    comm.shift<double>(send, (r + 1) % p, recv, (r + p - 1) % p);  // the others' messages are pending
    EXPECT_EQ(recv[0], r - 1);
  } else {
    try {
      comm.shift<double>(send, (r + 1) % p, recv, (r + p - 1) % p);
      // only rank 0 (receiving from the late rank) must wait for it; small sends are eager
      EXPECT_NE(r, 0) << "no timeout";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("timeout: shift (call #2) on rank " + std::to_string(r)), std::string::npos) << what;
      EXPECT_TRUE(comm.poisoned());
      EXPECT_THROW(comm.barrier(), Error);
      EXPECT_TRUE(comm.drain(30));
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// wait(req, between): `between` runs while the request is in flight, and what it starts moves
// the peer along. Rank 0 waits for rank 1's data, which rank 1 sends only once it has rank 0's
// "go", which rank 0 sends from `between`: without the calls, a wait until the deadline.
TEST(WaitBetween, CallsWhileInFlightAndWhatTheyStartCompletesTheWait) {
  const int p = world_size(), r = world_rank();
  if (p < 2) GTEST_SKIP() << "needs 2 ranks";
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS, .on_timeout = TimeoutAction::throw_error});
  std::vector<double> data{-1.0, -1.0}, go{-1.0}, go_send{7.0}, data_send{1.5, 2.5};
  if (r == 0) {
    CommRequest got = comm.start_recv<double>(data, 1, 3);
    CommRequest sent;
    int calls = 0;
    const std::function<void()> between = [&] {
      if (calls++ == 0) sent = comm.start_send<double>(go_send, 1, 4);
      (void)comm.test(sent);
    };
    comm.wait(got, between);
    comm.wait(sent);
    EXPECT_GE(calls, 1);
    EXPECT_EQ(data, (std::vector<double>{1.5, 2.5}));
  } else if (r == 1) {
    CommRequest g = comm.start_recv<double>(go, 0, 4);
    comm.wait(g);
    EXPECT_EQ(go[0], 7.0);
    CommRequest d = comm.start_send<double>(data_send, 0, 3);
    comm.wait(d);
  }
  EXPECT_FALSE(comm.poisoned());
  comm.barrier();
}

// A throw from `between` reaches the caller; the request it left in flight is kept (the
// communicator poisoned, as after a throw-mode timeout) until drain() sees it complete.
TEST(WaitBetween, AThrowLeavesTheRequestPendingAndPoisons) {
  const int p = world_size(), r = world_rank();
  if (p < 2) GTEST_SKIP() << "needs 2 ranks";
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS, .on_timeout = TimeoutAction::throw_error});
  std::vector<double> data{-1.0}, data_send{4.5};
  if (r == 0) {
    CommRequest got = comm.start_recv<double>(data, 1, 5);
    // (not a cpattn::Error: an out-of-memory in the overlapped forward's sends is a bad_alloc)
    std::string what;
    try {
      comm.wait(got, [] { throw std::runtime_error("between: stop"); });
    } catch (const Error&) {
      what = "a cpattn::Error";  // (derives from std::runtime_error: not what between threw)
    } catch (const std::runtime_error& e) {
      what = e.what();
    }
    EXPECT_EQ(what, "between: stop");
    EXPECT_TRUE(comm.poisoned());
    EXPECT_FALSE(got.active());
    const std::string refused = cpattn::testing::error_of([&] { comm.barrier(); });
    EXPECT_NE(refused.find("poisoned by an earlier failure in recv (call #1, left in flight by a throw while waiting)"),
              std::string::npos)
        << refused;
  }
  MPI_Barrier(MPI_COMM_WORLD);  // rank 1 sends only now: the receive was still pending
  if (r == 1) {
    CommRequest d = comm.start_send<double>(data_send, 0, 5);
    comm.wait(d);
  }
  if (r == 0) {
    EXPECT_TRUE(comm.drain(30));
    EXPECT_EQ(data[0], 4.5);  // landed in the buffer the pending receive kept
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// The deadline holds with `between` given: a peer that never sends times the wait out (the
// usual line; `between` ran meanwhile), and the refusals after name that call.
TEST(WaitBetween, ThePeerThatNeverSendsStillTimesOut) {
  const int p = world_size(), r = world_rank();
  if (p < 2) GTEST_SKIP() << "needs 2 ranks";
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = 1.0, .on_timeout = TimeoutAction::throw_error,
                                     .print_timeout = false});
  std::vector<double> data{-1.0}, data_send{2.5};
  if (r == 0) {
    CommRequest got = comm.start_recv<double>(data, 1, 6);
    int calls = 0;
    const std::string what = cpattn::testing::error_of([&] { comm.wait(got, [&] { ++calls; }); });
    EXPECT_NE(what.find("timeout: recv (call #1) on rank 0"), std::string::npos) << what;
    EXPECT_GT(calls, 0);
    const std::string refused = cpattn::testing::error_of([&] { comm.barrier(); });
    EXPECT_NE(refused.find("poisoned by an earlier failure in recv (call #1)"), std::string::npos) << refused;
  }
  MPI_Barrier(MPI_COMM_WORLD);  // rank 1 sends only after rank 0's deadline
  if (r == 1) {
    CommRequest d = comm.start_send<double>(data_send, 0, 6);
    comm.wait(d);
  }
  if (r == 0) {
    EXPECT_TRUE(comm.drain(30));
    EXPECT_EQ(data[0], 2.5);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// print_timeout = false: the timeout still throws the line, and stderr gets nothing (the
// caller decides what to say: cpattn train's wait for every rank to meet a step's error).
TEST(Deadline, QuietTimeoutLeavesTheLineToTheCaller) {
  const int p = world_size(), r = world_rank();
  if (p < 2) GTEST_SKIP() << "needs 2 ranks";
  Communicator comm(MPI_COMM_WORLD,
                    {.timeout_s = 1.0, .on_timeout = TimeoutAction::throw_error, .print_timeout = false});
  std::vector<double> x{1.0};
  if (r == p - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    comm.all_reduce<double>(x, ReduceOp::sum);  // the others are draining: completes at once
  } else {
    ::testing::internal::CaptureStderr();
    std::string what;
    try {
      comm.all_reduce<double>(x, ReduceOp::sum);
    } catch (const Error& e) {
      what = e.what();
    }
    const std::string printed = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(what.find("timeout: all_reduce(sum) (call #1) on rank " + std::to_string(r)), std::string::npos)
        << "no timeout, or another line: '" << what << "'";
    EXPECT_EQ(printed, "");
    EXPECT_TRUE(comm.drain(30));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(Deadline, LateRankMakesOthersThrow) {
  const int p = world_size(), r = world_rank();
  if (p < 2) GTEST_SKIP() << "needs 2 ranks";
  Communicator comm(MPI_COMM_WORLD, {.timeout_s = 1.0, .on_timeout = TimeoutAction::throw_error});
  comm.barrier();  // call #1
  std::vector<double> x{1.0};
  const auto start = std::chrono::steady_clock::now();
  if (r == p - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    comm.all_reduce<double>(x, ReduceOp::sum);  // others are draining: completes at once
    EXPECT_FALSE(comm.poisoned());
    EXPECT_EQ(x[0], p);  // the others' contributions were already in flight
  } else {
    try {
      comm.all_reduce<double>(x, ReduceOp::sum);
      ADD_FAILURE() << "no timeout";
    } catch (const Error& e) {
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_GE(waited, 1.0);
      EXPECT_LT(waited, 2.4);
      const std::string what = e.what();
      EXPECT_NE(what.find("timeout: all_reduce(sum) (call #2) on rank " + std::to_string(r)),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("deadline of 1 s"), std::string::npos) << what;
    }
    EXPECT_TRUE(comm.poisoned());
    EXPECT_THROW(comm.barrier(), Error);  // poisoned: refuses at once
    EXPECT_TRUE(comm.drain(30));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Throw mode, three ranks, ring reduce-scatter. Ranks 0 and 1 start without rank 2 and time
// out (1 s): rank 0 waiting in step 0 with a receive posted into the communicator's scratch,
// rank 1 in step 1 with a receive pending on its own recv buffer (which the caller keeps, as
// documented). Both destroy their communicator, rank 0 allocates a buffer of the scratch's
// size, and only then (told so by a message) rank 2 joins: its data must land in the
// retained scratch, not in that new buffer (under AddressSanitizer, a write into freed
// memory is reported).
TEST(Deadline, LateMessagesLandInRetainedScratchNotInFreedMemory) {
  if (world_size() < 3) GTEST_SKIP() << "needs 3 ranks";
  const int wr = world_rank();
  MPI_Comm trio = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, wr < 3 ? 0 : MPI_UNDEFINED, wr, &trio);
  if (trio != MPI_COMM_NULL) {
    constexpr std::size_t n = 512;  // 2 KiB per message: below Open MPI's eager limit
    static std::vector<std::vector<float>> callers_buffers;  // pending receives may target them
    std::vector<float> send(3 * n, 1.0f);
    std::vector<float>& recv = callers_buffers.emplace_back(n, 0.0f);
    std::vector<float> reused;
    std::optional<Communicator> comm;
    comm.emplace(trio, CommOptions{.timeout_s = 1.0, .on_timeout = TimeoutAction::throw_error,
                                   .reduce_scatter_algorithm = CommAlgorithm::ring});
    int go = 1;
    if (wr < 2) {
      EXPECT_THROW(comm->reduce_scatter_sum(send, recv), Error);
      EXPECT_TRUE(comm->poisoned());
      EXPECT_FALSE(comm->drain(0.0));  // rank 2 has not started
      comm.reset();                     // destroyed with requests pending
      if (wr == 0) reused.assign(2 * n, 7.0f);  // the scratch's size: the allocator's first pick
      MPI_Send(&go, 1, MPI_INT, 2, 7, trio);
    } else {
      MPI_Recv(&go, 1, MPI_INT, 0, 7, trio, MPI_STATUS_IGNORE);
      MPI_Recv(&go, 1, MPI_INT, 1, 7, trio, MPI_STATUS_IGNORE);
      try {
        comm->reduce_scatter_sum(send, recv);  // may complete against the pending requests
      } catch (const Error&) {
      }
      comm.reset();
    }
    MPI_Barrier(trio);  // rank 0 makes progress here while rank 2's messages land
    for (std::size_t i = 0; i < reused.size(); ++i) ASSERT_EQ(reused[i], 7.0f) << "element " << i;
    MPI_Comm_free(&trio);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// split(): the world into even and odd world ranks, ordered within each group by a key that
// reverses the world order; each group sums over its own ranks only, and the world still
// works afterwards (at 1 rank the odd group is empty and the even one is the world).
TEST(Split, EvenAndOddRanksReduceWithinTheirOwnGroup) {
  Communicator world(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS});
  const int wr = world.rank(), ws = world.size();
  const int color = wr % 2;
  Communicator half = world.split(color, -wr);
  EXPECT_EQ(world.calls(), 1);  // one collective of the world
  const int group_size = (ws + 1 - color) / 2;  // evens: ceil(ws / 2), odds: floor(ws / 2)
  EXPECT_EQ(half.size(), group_size);
  EXPECT_EQ(half.rank(), group_size - 1 - wr / 2);  // by key: the highest world rank first
  EXPECT_EQ(half.timeout_s(), world.timeout_s());
  EXPECT_EQ(half.calls(), 0);
  std::int64_t expected = 0;
  for (int r = color; r < ws; r += 2) expected += r;
  std::vector<std::int64_t> v{wr, 1};
  half.all_reduce<std::int64_t>(v, ReduceOp::sum);
  EXPECT_EQ(v[0], expected);
  EXPECT_EQ(v[1], group_size);
  std::vector<std::int64_t> w{1};
  world.all_reduce<std::int64_t>(w, ReduceOp::sum);
  EXPECT_EQ(w[0], ws);
}

// A negative color on one rank (MPI_UNDEFINED included) fails on every rank, naming it, and
// leaves the world usable.
TEST(Split, NegativeColorOnOneRankThrowsOnEveryRank) {
  Communicator world(MPI_COMM_WORLD, {.timeout_s = kTestTimeoutS});
  const int bad = world.size() - 1;
  std::string what;
  try {
    world.split(world.rank() == bad ? MPI_UNDEFINED : 0, 0);
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("rank " + std::to_string(bad) + " passed"), std::string::npos) << what;
  world.barrier();
}

}  // namespace
}  // namespace cpattn
