// Device helpers shared by the kernels of rows.cu, attention.cu and vision.cu (included by each; pycuda
// builds them with this folder on the include path, and its build cache keys on the preprocessed source,
// so an edit here rebuilds every includer).
#pragma once

#define WARP 32

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block whose size is a multiple of 32 (<= 1024); every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float red[32];
    v = warp_sum(v);
    const int w = threadIdx.x / WARP, l = threadIdx.x % WARP;
    __syncthreads();
    if (l == 0) red[w] = v;
    __syncthreads();
    const int nw = blockDim.x / WARP;
    v = (l < nw) ? red[l] : 0.f;
    return warp_sum(v);
}

// s[a][c] += q[a] * k[c] (fused multiply-add) for a, c < 4: one head dimension of a lane's 4x4 score block.
__device__ __forceinline__ void fma_outer4(float (&s)[4][4], const float (&q)[4], const float (&k)[4]) {
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[a][c] = fmaf(q[a], k[c], s[a][c]);
}

// One online-softmax step of a flash-attention tile for one query row spread over 16 consecutive lanes
// (4 scores per lane, reduced with xor-shuffles over lane offsets 8, 4, 2, 1). s: this lane's 4 scores,
// masked keys -INFINITY (the row must hold at least one finite score over the 16 lanes), replaced by
// exp(s - m_new), each also handed to keep(c, value) as it is computed (the caller's P tile store, or a
// no-op); mx: the maximum of this lane's s; m, l: the row's running maximum and sum of exponentials,
// updated; o: this lane's NQ output accumulators of the row, rescaled by exp(m_old - m_new).
template <int NQ, typename Keep>
__device__ __forceinline__ void online_softmax_row(float (&s)[4], float mx, float& m, float& l, float (&o)[NQ],
                                                   Keep keep) {
#pragma unroll
    for (int k = 8; k > 0; k >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, k));
    const float m_new = fmaxf(m, mx);
    const float corr = expf(m - m_new);
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        s[c] = expf(s[c] - m_new);
        keep(c, s[c]);
        sum += s[c];
    }
#pragma unroll
    for (int k = 8; k > 0; k >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, k);
    l = l * corr + sum;
    m = m_new;
#pragma unroll
    for (int j = 0; j < NQ; ++j) o[j] *= corr;
}
