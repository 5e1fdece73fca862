// Uses cpattn's public API the way a user's program would, and checks one known value.
#include <cpattn/cpattn.hpp>

#include <cstdio>
#include <vector>

int main() {
  const std::vector<int64_t> cu{0, 16, 40};
  const cpattn::RankPlan plan = cpattn::get_thd_load_balanced_cp_metadata(cu, 2, 1);
  const bool ok = plan.actual_seq_kvlen == std::vector<int64_t>{8, 20, 32, 50};
  std::printf("rank 1 of 2: %lld local tokens, %s\n", static_cast<long long>(plan.local_tokens),
              ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
