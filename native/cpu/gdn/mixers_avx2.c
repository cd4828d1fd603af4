/* The Gated DeltaNet kernel (gdn_kernel.h) compiled for AVX2 (build.py gives the flags). */
#define GDN_SUFFIX avx2
#include "gdn_kernel.h"
