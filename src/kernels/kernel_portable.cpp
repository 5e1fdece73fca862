// The portable kernel path: kernel_impl.hpp compiled with 4-float vectors, the x86-64 baseline
// (no target switch).
#define CPATTN_KNS portable
#define CPATTN_VW 4
#include "kernel_isa.inc"
