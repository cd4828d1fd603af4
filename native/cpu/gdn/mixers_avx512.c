/* The Gated DeltaNet kernel (gdn_kernel.h) compiled for AVX-512 (build.py gives the flags). */
#define GDN_SUFFIX avx512
#include "gdn_kernel.h"
