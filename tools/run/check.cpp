// `cpattn run`'s check: the CP results against a single-process run of the whole batch, by the
// checking library's comparison and pass rule (check/tolerance.hpp).
#include "run.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace cpattn::cli::run_cmd {

RunCheck check_against_single_process(const check::Batch& b, const AttnOptions& options,
                                      const check::Results& got) {
  RunCheck c;
  const auto t0 = std::chrono::steady_clock::now();
  const check::Results ref = check::single_process(b, options);
  c.single_process_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const struct {
    const char* name;
    const std::vector<float>* got;
    const std::vector<float>* ref;
    check::TensorShape shape;
  } tensors[] = {{"out", &got.out, &ref.out, b.out_shape()},
                 {"dq", &got.dq, &ref.dq, b.q_shape()},
                 {"dk", &got.dk, &ref.dk, b.k_shape()},
                 {"dv", &got.dv, &ref.dv, b.v_shape()}};
  for (const auto& t : tensors) {
    // Rows of one head's dim values: the worst row is (global token, head).
    c.tensors.push_back(check::compare(t.name, *t.got, *t.ref, b.dtype, t.shape.dim));
    const int64_t row = std::max<int64_t>(c.tensors.back().worst_row, 0);
    c.worst.push_back({row / t.shape.heads, static_cast<int>(row % t.shape.heads)});
    if (!c.tensors.back().pass) c.pass = false;
  }
  for (std::size_t i = 0; i < got.lse.size(); ++i)
    c.lse_max_abs = std::max(c.lse_max_abs, double{std::abs(got.lse[i] - ref.lse[i])});
  return c;
}

}  // namespace cpattn::cli::run_cmd
