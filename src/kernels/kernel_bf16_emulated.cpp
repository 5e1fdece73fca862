// The bf16_emulated kernel path: the avx512_bf16 path's algorithm (bf16 dot products with fp32
// accumulation for bf16 storage) with vdpbf16ps emulated in plain vector arithmetic
// (CPATTN_BF16_DOT 2) on 8-float AVX2 vectors, so that the kernel case table checks the
// bf16-rounding algorithm on CPUs without AVX512_BF16. Never chosen by `automatic` (it is
// slower than avx2); fp32/fp16 storage runs the avx2 path's code.
#define CPATTN_KNS bf16_emulated
#define CPATTN_VW 8
#define CPATTN_TARGET "avx2,fma,f16c"
#define CPATTN_BF16_DOT 2
#include "kernel_isa.inc"
