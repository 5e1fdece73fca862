// Uses cpattn's MPI-free core the way a user's program would, and checks one known value.
// Built against cpattn::core alone: MPI must not be reachable at all.
#include <cpattn/core.hpp>

#if __has_include(<mpi.h>)
#error "cpattn::core put MPI on the include path"
#endif

#include <cstdint>
#include <cstdio>
#include <vector>

static_assert(CPATTN_VERSION_MAJOR >= 0 && CPATTN_VERSION_MINOR >= 0 && CPATTN_VERSION_PATCH >= 0);

int main() {
  const std::vector<int64_t> cu{0, 16, 40};
  const cpattn::RankPlan plan = cpattn::get_thd_load_balanced_cp_metadata(cu, 2, 1);
  const float x[2] = {1.5f, -2.0f};
  std::uint16_t h[2] = {};
  float back[2] = {};
  cpattn::from_float(x, 2, cpattn::DType::bf16, h);  // the common layer
  cpattn::to_float(h, cpattn::DType::bf16, 2, back);
  const bool ok = plan.actual_seq_kvlen == std::vector<int64_t>{8, 20, 32, 50} && back[0] == x[0] &&
                  back[1] == x[1];
  std::printf("cpattn %s core: rank 1 of 2: %lld local tokens, %s\n", CPATTN_VERSION_STRING,
              static_cast<long long>(plan.local_tokens), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
