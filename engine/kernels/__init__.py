"""Numeric kernels that know no architecture: the native CPU SIMD kernels (:mod:`.cpu`), the worker pool of
the numpy towers (:mod:`.threads`) and the CUDA plumbing (:mod:`.cuda_kernels`, :mod:`.cuda_context`,
:mod:`.cuda_buffers`, :mod:`.cuda_layout`)."""
