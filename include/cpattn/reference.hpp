// The plain reference of attention_forward/backward: the same parameters and work list, the
// obviously correct loops of docs/design.md section 5, no blocking, no SIMD, no threads
// (options.num_threads and options.path do not change the result; the path is validated as
// the kernels validate it: a path this CPU runs, and CPATTN_KERNEL_PATH under automatic).
// Tests compare every fast path against it with RefAccum::f64; RefAccum::f32 is the "naive
// implementation in the same precision" that grounds the fp16/bf16 tolerances. Outputs are rounded once to the storage dtype.
// The kernels' cooperation with peer processes (AttnInputs::kv_pack_share,
// AttnBwdParams::grad_share) is theirs alone: the reference refuses both (cpattn::Error).
#pragma once

#include <cpattn/attention.hpp>

namespace cpattn {

enum class RefAccum { f64, f32 };

void attention_forward_reference(const AttnFwdParams& p, RefAccum accum = RefAccum::f64);
void attention_backward_reference(const AttnBwdParams& p, RefAccum accum = RefAccum::f64);

}  // namespace cpattn
