// The Qwen3.5/3.6 vision tower's kernels besides the weight GEMMs (those are gemm.cu's qgemm_*), used by
// engine/arch/qwen3vl/cuda.py; numpy twins in engine/ops/vision_reference.py (docs/spec/qwen3vl.md
// section 5). All activations float32, row-major, one image per launch.
//
//   vis_layernorm   LayerNorm with weight and bias over rows (vision_reference.layer_norm)
//   vis_bias_act    x[r, :n] = act(x[r, :n] + b): no activation, GELU tanh or GELU erf (gelu_tanh, gelu_erf)
//   vis_rope        2-D vision RoPE in place on the q and k parts of the fused qkv rows (apply_rope)
//   vis_attn_<HDP>  non-causal softmax attention over all S tokens of one image (attention), flash style

#include "common.cuh"

// LayerNorm of row r (d floats at x + r*x_ld): y = (x - mean) / sqrt(var + eps) * w + b, biased variance.
// Row r is written at y + (r / y_group) * y_ld + (r % y_group) * d: y_group = 1 gives plain rows of stride
// y_ld; y_group = merge^2 writes each run of merge^2 tokens as one concatenated merger row (docs/spec/qwen3vl.md 5.5).
// Grid (rows), 256 threads.
extern "C" __global__ void vis_layernorm(const float* __restrict__ x, int x_ld, const float* __restrict__ w,
                                         const float* __restrict__ b, float* __restrict__ y, int y_group, int y_ld,
                                         int d, float eps) {
    const int r = blockIdx.x;
    const float* xr = x + (long long)r * x_ld;
    float* yr = y + (long long)(r / y_group) * y_ld + (long long)(r % y_group) * d;
    float s = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i];
    const float mean = block_sum(s) / (float)d;
    float v = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float c = xr[i] - mean;
        v = fmaf(c, c, v);
    }
    const float rstd = 1.f / sqrtf(block_sum(v) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = (xr[i] - mean) * rstd * w[i] + b[i];
}

// vision_reference.gelu_tanh: x * (0.5 + 0.5 tanh(x (c0 + c1 x^2))), c0 = sqrt(2/pi), c1 = c0 * 0.044715.
__device__ __forceinline__ float gelu_tanh(float x) {
    const float c0 = 0.797884583f, c1 = 0.0356774069f;
    return (0.5f + 0.5f * tanhf(x * (c0 + c1 * x * x))) * x;
}

// vision_reference.gelu_erf: 0.5 x erfc(-x / sqrt 2), in float64.
__device__ __forceinline__ float gelu_erf(float x) {
    const double xd = x;
    return (float)(0.5 * xd * erfc(-xd * 0.70710678118654752440));
}

// x[r][c] = act(x[r][c] + b[c]) for r < rows, c < n (row stride ld); act 0 = none, 1 = GELU tanh,
// 2 = GELU erf. Grid-stride over rows * n values, 256 threads.
extern "C" __global__ void vis_bias_act(float* __restrict__ x, int ld, const float* __restrict__ b, int rows, int n,
                                        int act) {
    const long long total = (long long)rows * n;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const long long r = i / n;
        const int c = (int)(i - r * n);
        float* p = x + r * ld + c;
        const float v = *p + b[c];
        *p = act == 0 ? v : (act == 1 ? gelu_tanh(v) : gelu_erf(v));
    }
}

// Half-split (NeoX) rotation of the q and k heads of each fused qkv row, in place: token s has q head h at
// columns h*hd .. and k head h at D + h*hd = (H + h)*hd (D = H*hd), row stride ld. With k < hd/2:
//   x'[k] = x[k] cos[s][k] - x[k + hd/2] sin[s][k],  x'[k + hd/2] = x[k + hd/2] cos[s][k] + x[k] sin[s][k]
// cos, sin: (S, hd/2) (vision_reference.rope_2d_cos_sin). Grid-stride over S * 2H * hd/2 pairs.
extern "C" __global__ void vis_rope(float* __restrict__ qkv, int ld, const float* __restrict__ cs,
                                    const float* __restrict__ sn, int S, int H, int hd) {
    const int half = hd / 2;
    const long long total = (long long)S * 2 * H * half;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const int k = (int)(i % half);
        const long long rest = i / half;
        const int head = (int)(rest % (2 * H));
        const long long s = rest / (2 * H);
        float* p = qkv + s * ld + (long long)head * hd;
        const float c = cs[s * half + k], si = sn[s * half + k];
        const float x1 = p[k], x2 = p[k + half];
        p[k] = x1 * c - x2 * si;
        p[k + half] = x2 * c + x1 * si;
    }
}

// Non-causal attention of one image: out[s][h*hd + :hd] = softmax_j((q_s . k_j) * scale) v_j over all
// S tokens j, per head h. q, k, v of token s are the head's columns of the fused row qkv + s*ld at offsets
// 0, D and 2D (D = H*hd); out has row stride out_ld. hd <= HDP, hd a multiple of 4 (float4 loads),
// HDP a multiple of 16 (columns hd .. HDP-1 are zero padding).
//
// Block = AQ query rows of one head, grid (ceil(S / AQ), H), 128 threads; thread (ti, tj) = (t / 16,
// t % 16) owns query rows ti*4 .. ti*4+3. The block's scaled Q stays in shared memory (transposed). Per
// tile of AK keys: scores S = Q K^T (keys tj*4 .. tj*4+3 per thread; K staged KC head dims at a time),
// online softmax (running max m and sum l per row, reduced over the 16 threads of a row), P^T to shared
// memory, then O += P V (columns tj + 16*j per thread; V staged KC keys at a time). Scores never leave
// the chip, so memory traffic is O(S * hd) per query tile and time follows S^2 * hd.
#define AQ 32
#define AK 64
#define KC 16

template <int HDP>
__device__ __forceinline__ void vis_attn_body(const float* __restrict__ qkv, int ld, float* __restrict__ out,
                                              int out_ld, int S, int H, int hd, float scale) {
    constexpr int NQ = HDP / 16;
    constexpr int KV = KC * (HDP > AK ? HDP : AK);
    __shared__ __align__(16) float Qs[HDP][AQ];
    __shared__ __align__(16) float KVs[KV];       // K^T chunk [KC][AK], or V chunk [KC][HDP]
    __shared__ __align__(16) float Pt[AK][AQ + 4];

    const int t = threadIdx.x, ti = t >> 4, tj = t & 15;
    const int q0 = blockIdx.x * AQ, head = blockIdx.y;
    const long long D = (long long)H * hd;
    const float* qb = qkv + (long long)head * hd;
    const float* kb = qb + D;
    const float* vb = qb + 2 * D;

    for (int i = t; i < AQ * (HDP / 4); i += blockDim.x) {
        const int r = i / (HDP / 4), x = (i % (HDP / 4)) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (q0 + r < S && x < hd) v = *reinterpret_cast<const float4*>(qb + (long long)(q0 + r) * ld + x);
        Qs[x][r] = v.x * scale;
        Qs[x + 1][r] = v.y * scale;
        Qs[x + 2][r] = v.z * scale;
        Qs[x + 3][r] = v.w * scale;
    }

    float m[4], l[4], O[4][NQ];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        m[a] = -INFINITY;
        l[a] = 0.f;
#pragma unroll
        for (int j = 0; j < NQ; ++j) O[a][j] = 0.f;
    }

    for (int j0 = 0; j0 < S; j0 += AK) {
        float s[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[a][c] = 0.f;
#pragma unroll
        for (int d0 = 0; d0 < HDP; d0 += KC) {
            __syncthreads();
            for (int i = t; i < AK * (KC / 4); i += blockDim.x) {
                const int key = i / (KC / 4), x = (i % (KC / 4)) * 4;
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (j0 + key < S && d0 + x < hd)
                    v = *reinterpret_cast<const float4*>(kb + (long long)(j0 + key) * ld + d0 + x);
                KVs[x * AK + key] = v.x;
                KVs[(x + 1) * AK + key] = v.y;
                KVs[(x + 2) * AK + key] = v.z;
                KVs[(x + 3) * AK + key] = v.w;
            }
            __syncthreads();
#pragma unroll
            for (int x = 0; x < KC; ++x) {
                const float4 qa = *reinterpret_cast<const float4*>(&Qs[d0 + x][ti * 4]);
                const float4 ka = *reinterpret_cast<const float4*>(&KVs[x * AK + tj * 4]);
                const float qv[4] = {qa.x, qa.y, qa.z, qa.w}, kv[4] = {ka.x, ka.y, ka.z, ka.w};
                fma_outer4(s, qv, kv);
            }
        }

        // online softmax; every tile holds key j0 < S, so each row's tile maximum is finite
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            float mx = -INFINITY;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                if (j0 + tj * 4 + c >= S) s[a][c] = -INFINITY;
                mx = fmaxf(mx, s[a][c]);
            }
            online_softmax_row<NQ>(s[a], mx, m[a], l[a], O[a], [](int, float) {});
        }
#pragma unroll
        for (int c = 0; c < 4; ++c)
            *reinterpret_cast<float4*>(&Pt[tj * 4 + c][ti * 4]) = make_float4(s[0][c], s[1][c], s[2][c], s[3][c]);

        for (int v0 = 0; v0 < AK; v0 += KC) {
            __syncthreads();
            for (int i = t; i < KC * (HDP / 4); i += blockDim.x) {
                const int jj = i / (HDP / 4), x = (i % (HDP / 4)) * 4;
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (j0 + v0 + jj < S && x < hd)
                    v = *reinterpret_cast<const float4*>(vb + (long long)(j0 + v0 + jj) * ld + x);
                *reinterpret_cast<float4*>(&KVs[jj * HDP + x]) = v;
            }
            __syncthreads();
#pragma unroll
            for (int jj = 0; jj < KC; ++jj) {
                const float4 pa = *reinterpret_cast<const float4*>(&Pt[v0 + jj][ti * 4]);
#pragma unroll
                for (int j = 0; j < NQ; ++j) {
                    const float v = KVs[jj * HDP + tj + 16 * j];
                    O[0][j] = fmaf(pa.x, v, O[0][j]);
                    O[1][j] = fmaf(pa.y, v, O[1][j]);
                    O[2][j] = fmaf(pa.z, v, O[2][j]);
                    O[3][j] = fmaf(pa.w, v, O[3][j]);
                }
            }
        }
    }

#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int r = q0 + ti * 4 + a;
        if (r >= S) continue;
        float* dst = out + (long long)r * out_ld + (long long)head * hd;
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            const int col = tj + 16 * j;
            if (col < hd) dst[col] = O[a][j] / l[a];
        }
    }
}

#define VIS_ATTN_KERNEL(HDP)                                                                                \
    extern "C" __global__ void __launch_bounds__(128)                                                       \
    vis_attn_##HDP(const float* __restrict__ qkv, int ld, float* __restrict__ out, int out_ld, int S, int H, \
                   int hd, float scale) {                                                                   \
        vis_attn_body<HDP>(qkv, ld, out, out_ld, S, H, hd, scale);                                          \
    }

VIS_ATTN_KERNEL(16)
VIS_ATTN_KERNEL(32)
VIS_ATTN_KERNEL(48)
VIS_ATTN_KERNEL(64)
VIS_ATTN_KERNEL(80)
VIS_ATTN_KERNEL(96)
VIS_ATTN_KERNEL(112)
VIS_ATTN_KERNEL(128)
