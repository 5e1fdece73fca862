// The amx kernel path: kernel_impl.hpp compiled with 16-float vectors (the avx512 path's code
// for fp32 storage, which has no tiles) and AMX tile products (CPATTN_AMX 1): TDPBF16PS for
// bf16 storage, TDPFP16PS for fp16 storage where the CPU has AMX-FP16 (else the FMA code). The
// tile instructions are inline assembly (binutils assembles them whatever the target; GCC 12
// has no AMX-FP16 intrinsic); the target is the avx512_bf16 path's (every CPU with AMX-BF16
// has AVX512_BF16, whose VCVTNE2PS2BF16 rounds the tiles' operands). Built by GCC only, as
// avx512_bf16 (under clang kernel_path_supported(amx) is false).
#define CPATTN_KNS amx
#define CPATTN_VW 16
#define CPATTN_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c"
#define CPATTN_AMX 1
#define CPATTN_GCC_ONLY
#include "kernel_isa.inc"
