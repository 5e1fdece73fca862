#include <cpattn/check/gather.hpp>

#include <cpattn/cp.hpp>

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

}  // namespace cpattn::check
