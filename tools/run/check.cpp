// `cpattn run`'s check: the CP results against a single-process run of the whole batch, by the
// checking library's comparison and pass rule (check/tolerance.hpp).
#include "run.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace cpattn::cli::run_cmd {

Reference single_process_reference(const check::Batch& b, const AttnOptions& options) {
  Reference r;
  const auto t0 = std::chrono::steady_clock::now();
  r.results = check::single_process(b, options);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

double RunCheck::worst_rel_l2() const {
  double w = 0;
  for (const check::TensorReport& t : tensors) w = std::max(w, t.rel_l2);
  return w;
}

RunCheck check_against(const check::Batch& b, const Reference& reference, const check::Results& got) {
  RunCheck c;
  const check::Results& ref = reference.results;
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
