/* The attention kernel (attn_kernel.h) compiled for AVX-512 (build.py gives the flags). */
#define ATTN_SUFFIX avx512
#include "attn_kernel.h"
