// Row-wise and elementwise kernels of the Qwen3.5/3.6 forward pass (docs/spec/qwen35.md
// section 3): RMSNorm, per-head RMSNorm + M-RoPE, the Gated DeltaNet conv/norm/gate steps, SwiGLU,
// the MoE router and the MoE combine. All activations float32, row-major. Each kernel mirrors the
// numpy op of engine/ops/reference.py named in its comment, including where that op works in float64.

#include "common.cuh"

// reference.sigmoid: float64 logistic, stable for large |x|.
__device__ __forceinline__ float sigmoid_d(float x) {
    const double xd = x;
    const double e = exp(-fabs(xd));
    return (float)(xd >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e));
}

// reference.silu: x * sigmoid(x), the product in float32.
__device__ __forceinline__ float silu_f(float x) { return x * sigmoid_d(x); }

// reference.rmsnorm over rows of d: y = x * (1 / sqrt(mean(x^2) + eps)) * w. One block per row.
extern "C" __global__ void rmsnorm_rows(const float* __restrict__ x, int x_stride, const float* __restrict__ w,
                                        float* __restrict__ y, int y_stride, int d, float eps) {
    const float* xr = x + (long long)blockIdx.x * x_stride;
    float* yr = y + (long long)blockIdx.x * y_stride;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss);
    const float inv = 1.f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = (xr[i] * inv) * w[i];
}

// Per-head RMSNorm then partial NEOX rotation with interleaved M-RoPE positions
// (reference.rmsnorm + reference.rope_multi, spec 3.1 steps 3-4). Block (token t, head); the head's
// hd values are read from x + t*x_row + head*x_head and written to y + t*y_row + head*y_head.
// pos: (3, n) int32 t/h/w positions. Angles and the rotation are computed in float64.
extern "C" __global__ void qk_norm_rope(const float* __restrict__ x, int x_row, int x_head,
                                        const float* __restrict__ w, const int* __restrict__ pos, int n, int hd,
                                        int rope_dims, double theta, int sec1, int sec2, float eps,
                                        float* __restrict__ y, long long y_row, int y_head) {
    __shared__ float buf[512];
    const int t = blockIdx.x, head = blockIdx.y;
    const float* xr = x + (long long)t * x_row + (long long)head * x_head;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss);
    const float inv = 1.f / sqrtf(ss / (float)hd + eps);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) buf[i] = (xr[i] * inv) * w[i];
    __syncthreads();
    const int half = rope_dims / 2;
    float* yr = y + (long long)t * y_row + (long long)head * y_head;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        if (i >= rope_dims) {
            yr[i] = buf[i];
            continue;
        }
        const int p = i < half ? i : i - half;
        const int comp = (p % 3 == 1 && p < 3 * sec1) ? 1 : ((p % 3 == 2 && p < 3 * sec2) ? 2 : 0);
        const double angle = (double)pos[comp * n + t] * pow(theta, -2.0 * p / rope_dims);
        double s, c;
        sincos(angle, &s, &c);
        const double x1 = buf[p], x2 = buf[p + half];
        yr[i] = (float)(i < half ? x1 * c - x2 * s : x1 * s + x2 * c);
    }
}

// reference.causal_conv1d + silu (spec 3.2 step 2): u[t][c] = silu(sum_j w[c][j] * m_{t-K+1+j}[c]),
// inputs before the sequence taken from state_in (K-1, C). Grid (ceil(C/256), n).
extern "C" __global__ void conv1d_silu(const float* __restrict__ mixed, const float* __restrict__ state_in,
                                       const float* __restrict__ w, float* __restrict__ u, int n, int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (c >= C) return;
    float acc = 0.f;
    for (int j = 0; j < K; ++j) {
        const int s = t - (K - 1) + j;
        const float v = s >= 0 ? mixed[(long long)s * C + c] : state_in[(long long)(K - 1 + s) * C + c];
        acc += v * w[c * K + j];
    }
    u[(long long)t * C + c] = silu_f(acc);
}

// New conv state: the last K-1 rows of [state_in; mixed] (raw projections, oldest first). Grid (ceil(C/256), K-1).
extern "C" __global__ void conv_state_update(const float* __restrict__ mixed, const float* __restrict__ state_in,
                                             float* __restrict__ state_out, int n, int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    if (c >= C) return;
    const int s = n - (K - 1) + r;
    state_out[(long long)r * C + c] = s >= 0 ? mixed[(long long)s * C + c] : state_in[(long long)(K - 1 + s) * C + c];
}

// reference.l2norm on the n_k q heads and n_k k heads at the start of each conv-output row (in place),
// q heads also multiplied by q_scale = 1/sqrt(dk). One warp per (token, head).
extern "C" __global__ void l2norm_qk(float* __restrict__ u, int C, int nk, int dk, float eps, float q_scale) {
    const int t = blockIdx.x, head = blockIdx.y;
    float* r = u + (long long)t * C + (long long)head * dk;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dk; i += WARP) ss = fmaf(r[i], r[i], ss);
    ss = warp_sum(ss);
    const float inv = 1.f / sqrtf(ss + eps);
    const float scale = head < nk ? q_scale : 1.f;
    for (int i = threadIdx.x; i < dk; i += WARP) r[i] = head < nk ? (r[i] * inv) * scale : r[i] * inv;
}

// Spec 3.2 step 4: beta = sigmoid(b); g = ssm_a * softplus(a + dt_bias), softplus in float64.
extern "C" __global__ void gdn_gates(const float* __restrict__ braw, const float* __restrict__ araw,
                                     const float* __restrict__ ssm_a, const float* __restrict__ dt_bias,
                                     float* __restrict__ beta, float* __restrict__ g, int total, int nv) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int h = i % nv;
    beta[i] = sigmoid_d(braw[i]);
    const double a = (double)(araw[i] + dt_bias[h]);
    const float sp = (float)(fmax(a, 0.0) + log1p(exp(-fabs(a))));
    g[i] = ssm_a[h] * sp;
}

// reference.gated_rmsnorm per (token, v-head) row of dv: y = rmsnorm(o) * w * silu(z). One warp per row.
extern "C" __global__ void gated_rmsnorm(const float* __restrict__ o, const float* __restrict__ w,
                                         const float* __restrict__ z, float* __restrict__ y, int dv, float eps) {
    const long long base = (long long)blockIdx.x * dv;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dv; i += WARP) ss = fmaf(o[base + i], o[base + i], ss);
    ss = warp_sum(ss);
    const float inv = 1.f / sqrtf(ss / (float)dv + eps);
    for (int i = threadIdx.x; i < dv; i += WARP) y[base + i] = ((o[base + i] * inv) * w[i]) * silu_f(z[base + i]);
}

// reference.swiglu middle step: act[i][j] = silu(hg[i][j]) * hg[i][ff + j] (gate | up halves of one row).
extern "C" __global__ void swiglu_rows(const float* __restrict__ hg, float* __restrict__ act, int rows, int ff) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * ff) return;
    const long long r = i / ff, j = i % ff;
    act[i] = silu_f(hg[r * 2 * ff + j]) * hg[r * 2 * ff + ff + j];
}

// reference.topk_route: softmax over E logits (float64), k largest (ties: lower index), weights
// renormalised over the k (sum clamped >= 6.103515625e-5). One block of 256 threads per token; E <= 1024.
extern "C" __global__ void router_topk(const float* __restrict__ logits, int E, int k, int* __restrict__ idx,
                                       float* __restrict__ weights) {
    __shared__ float p[1024];
    __shared__ double dred[32];
    __shared__ float fred[32];
    __shared__ int ired[32];
    __shared__ float topv[64];
    const int t = blockIdx.x, tid = threadIdx.x, lane = tid % WARP, wid = tid / WARP, nw = blockDim.x / WARP;
    const float* l = logits + (long long)t * E;

    float mx = -INFINITY;
    for (int e = tid; e < E; e += blockDim.x) mx = fmaxf(mx, l[e]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) fred[wid] = mx;
    __syncthreads();
    mx = fred[0];
    for (int w = 1; w < nw; ++w) mx = fmaxf(mx, fred[w]);

    double sum = 0.0;
    for (int e = tid; e < E; e += blockDim.x) sum += exp((double)l[e] - (double)mx);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    __syncthreads();
    if (lane == 0) dred[wid] = sum;
    __syncthreads();
    sum = 0.0;
    for (int w = 0; w < nw; ++w) sum += dred[w];
    for (int e = tid; e < E; e += blockDim.x) p[e] = (float)(exp((double)l[e] - (double)mx) / sum);
    __syncthreads();

    for (int s = 0; s < k; ++s) {
        float bv = -1.f;
        int bi = 0x7fffffff;
        for (int e = tid; e < E; e += blockDim.x)
            if (p[e] > bv) { bv = p[e]; bi = e; }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        __syncthreads();
        if (lane == 0) { fred[wid] = bv; ired[wid] = bi; }
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < nw; ++w)
                if (fred[w] > bv || (fred[w] == bv && ired[w] < bi)) { bv = fred[w]; bi = ired[w]; }
            idx[(long long)t * k + s] = bi;
            topv[s] = bv;
            p[bi] = -2.f;
        }
        __syncthreads();
    }
    if (tid == 0) {
        double tot = 0.0;
        for (int s = 0; s < k; ++s) tot += (double)topv[s];
        tot = fmax(tot, 6.103515625e-5);
        for (int s = 0; s < k; ++s) weights[(long long)t * k + s] = (float)((double)topv[s] / tot);
    }
}

// MoE output (spec 3.3) added to the residual stream, one block (256 threads) per token t:
//   h[t] += sum_{slots, ascending expert id} out_sorted[pos] + sigmoid(y[t] . w_shgate) * sh[t]
// out_sorted rows are already scaled by their routing weight; inv[t*k + s] is the sorted row of slot s
// (sorted rows are in ascending expert order, so ascending rows = the reference's expert loop order).
// sh == nullptr: no shared expert.
extern "C" __global__ void moe_combine(float* __restrict__ h, const float* __restrict__ out_sorted,
                                       const int* __restrict__ inv, int k, const float* __restrict__ sh,
                                       const float* __restrict__ y, const float* __restrict__ w_shgate, int d) {
    __shared__ int rows[64];
    const int t = blockIdx.x;
    float gate = 0.f;
    if (sh != nullptr) {
        float dot = 0.f;
        for (int c = threadIdx.x; c < d; c += blockDim.x) dot = fmaf(y[(long long)t * d + c], w_shgate[c], dot);
        gate = sigmoid_d(block_sum(dot));
    }
    if (threadIdx.x == 0) {
        for (int s = 0; s < k; ++s) {
            const int v = inv[(long long)t * k + s];
            int j = s;
            while (j > 0 && rows[j - 1] > v) { rows[j] = rows[j - 1]; --j; }
            rows[j] = v;
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < k; ++s) acc += out_sorted[(long long)rows[s] * d + c];
        if (sh != nullptr) acc = acc + sh[(long long)t * d + c] * gate;
        h[(long long)t * d + c] += acc;
    }
}

// ---- routing tables on the GPU (engine.arch.qwen35.cuda_plan.route_tables without the host round trip) ----
// For nk = n*k token-expert pairs idx[i] (pair i = token i / k, slot i % k):
//   route_count:   counts[e] = pairs choosing e (counts zeroed by the caller)
//   route_plan:    one block of 1024 threads (E <= 1024): expert e's rows start at the exclusive prefix
//                  sum of counts; its ceil(count / tile_rows) tiles (row_start, row_count, e * stride) are
//                  written at the prefix sum of tile counts; *n_tiles = total; cursor[e] = row start
//   route_scatter: pair i goes to row pos = cursor[e]++ (atomic): a_rows[pos] = i / k, row_w[pos] = w[i],
//                  inv[i] = pos. Rows of one expert come in arbitrary order, which changes no result: each
//                  row of the grouped GEMM is computed on its own and moe_combine sums a token's rows in
//                  ascending row order, which is ascending expert order.
extern "C" __global__ void route_count(const int* __restrict__ idx, int nk, int* __restrict__ counts) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < nk) atomicAdd(&counts[idx[i]], 1);
}

extern "C" __global__ void route_plan(const int* __restrict__ counts, int* __restrict__ cursor, int E,
                                      long long stride, int tile_rows, long long* __restrict__ tiles,
                                      int* __restrict__ n_tiles) {
    __shared__ int rows[1024], ntl[1024];
    const int e = threadIdx.x;
    const int c = e < E ? counts[e] : 0;
    const int nt = (c + tile_rows - 1) / tile_rows;
    rows[e] = c;
    ntl[e] = nt;
    __syncthreads();
    for (int off = 1; off < 1024; off <<= 1) {
        const int a = e >= off ? rows[e - off] : 0, b = e >= off ? ntl[e - off] : 0;
        __syncthreads();
        rows[e] += a;
        ntl[e] += b;
        __syncthreads();
    }
    const int row0 = rows[e] - c, tile0 = ntl[e] - nt;
    if (e < E) {
        cursor[e] = row0;
        for (int j = 0; j < nt; ++j) {
            long long* tl = tiles + 3LL * (tile0 + j);
            tl[0] = row0 + j * tile_rows;
            tl[1] = min(tile_rows, c - j * tile_rows);
            tl[2] = (long long)e * stride;
        }
    }
    if (e == 1023) *n_tiles = ntl[1023];
}

extern "C" __global__ void route_scatter(const int* __restrict__ idx, const float* __restrict__ w, int nk, int k,
                                         int* __restrict__ cursor, int* __restrict__ a_rows,
                                         float* __restrict__ row_w, int* __restrict__ inv) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nk) return;
    const int pos = atomicAdd(&cursor[idx[i]], 1);
    a_rows[pos] = i / k;
    row_w[pos] = w[i];
    inv[i] = pos;
}
