// The avx512_bf16 kernel path: kernel_impl.hpp compiled with 16-float vectors and bf16 dot
// products (vdpbf16ps, CPATTN_BF16_DOT 1) for bf16 storage; fp32/fp16 storage runs the same
// FMA code as the avx512 path. The intrinsic needs GCC's target pragma: built by GCC only
// (under clang, the fuzz preset's compiler, kernel_path_supported(avx512_bf16) is false).
#define CPATTN_KNS avx512_bf16
#define CPATTN_VW 16
#define CPATTN_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c"
#define CPATTN_BF16_DOT 1
#define CPATTN_GCC_ONLY
#include "kernel_isa.inc"
