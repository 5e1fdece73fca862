// The avx2 kernel path: kernel_impl.hpp compiled with 8-float vectors.
#define CPATTN_KNS avx2
#define CPATTN_VW 8
#define CPATTN_TARGET "avx2,fma,f16c"
#include "kernel_isa.inc"
