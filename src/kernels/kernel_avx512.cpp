// The avx512 kernel path: kernel_impl.hpp compiled with 16-float vectors.
#define CPATTN_KNS avx512
#define CPATTN_VW 16
#define CPATTN_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"
#include "kernel_isa.inc"
