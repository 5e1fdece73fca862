// The amx_emulated kernel path: the amx path's algorithm (tile products for bf16 and fp16
// storage) with the tile instructions emulated exactly in plain C++ (CPATTN_AMX 2) on 8-float
// AVX2 vectors, so that the kernel case table checks the tiling, padding and VNNI layout on
// CPUs without AMX. Never chosen by `automatic` (it is far slower than avx2); fp32 storage
// runs the avx2 path's code.
#define CPATTN_KNS amx_emulated
#define CPATTN_VW 8
#define CPATTN_TARGET "avx2,fma,f16c"
#define CPATTN_AMX 2
#include "kernel_isa.inc"
