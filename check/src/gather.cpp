#include <cpattn/check/gather.hpp>

#include <cpattn/cp.hpp>
#include <cpattn/error.hpp>

#include <cstddef>
#include <numeric>
#include <span>

namespace cpattn::check {

Results gather_results(Communicator& comm, const RankPlan& plan, const LocalResults& local) {
  Results r;
  r.out = gather_global_rows(comm, plan, local.out);
  r.lse = gather_global_rows(comm, plan, contiguous(local.lse, plan.local_tokens, local.out.heads, 1));
  r.dq = gather_global_rows(comm, plan, local.dq);
  r.dk = gather_global_rows(comm, plan, local.dk);
  r.dv = gather_global_rows(comm, plan, local.dv);
  return r;
}

std::vector<std::string> error_on_every_rank(Communicator& comm, const std::function<void()>& f) {
  std::string msg;
  try {
    f();
  } catch (const Error& e) {
    msg = e.message();
  }
  const std::vector<int64_t> lens = comm.all_gather_counts(static_cast<int64_t>(msg.size()));
  std::vector<std::byte> all(std::accumulate(lens.begin(), lens.end(), std::size_t{0}));
  comm.all_gather_v<std::byte>(std::as_bytes(std::span(msg)), lens, all);
  std::vector<std::string> out;
  for (std::size_t r = 0, at = 0; r < lens.size(); at += static_cast<std::size_t>(lens[r]), ++r)
    out.emplace_back(reinterpret_cast<const char*>(all.data()) + at, static_cast<std::size_t>(lens[r]));
  return out;
}

}  // namespace cpattn::check
