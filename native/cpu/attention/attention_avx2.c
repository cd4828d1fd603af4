/* The attention kernel (attn_kernel.h) compiled for AVX2 (build.py gives the flags). */
#define ATTN_SUFFIX avx2
#include "attn_kernel.h"
