// Causal GQA softmax attention with a sigmoid output gate (docs/spec/qwen35.md 3.1 steps 5-6;
// numpy twin engine/ops/reference.py gated_attention), flash style: scores never leave the chip, so
// time grows with the causal area and memory stays flat with length.
//
// Block = up to 64 query rows = TQ consecutive tokens x the `group` q heads that share one kv head
// (TQ = 64 / group), grid (ceil(n / TQ), n_kv). The n new tokens sit at cache rows pos0 .. pos0+n-1;
// token i attends to cache rows 0 .. pos0+i. Per 64-key tile: S = Q K^T / sqrt(HD) (4x4 per thread),
// online softmax (running max m and sum l per row), O += P V (4 rows x HD/16 columns per thread).
//   q:    (n, n_head, HD) after norm + RoPE        k, v: cache (rows, n_kv, HD), rows >= pos0 + n
//   qg:   (n, n_head, 2*HD) projection; the gate of head hq is qg[t][hq][HD:]
//   out:  (n, n_head*HD) = softmax(q k^T / sqrt(HD)) v * sigmoid(gate)

#include "common.cuh"

#define QROWS 64
#define KT 64

__device__ __forceinline__ float sigmoid_att(float x) {
    const double xd = x;
    const double e = exp(-fabs(xd));
    return (float)(xd >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e));
}

template <int HD>
__device__ __forceinline__ void flash_body(const float* __restrict__ q, const float* __restrict__ qg,
                                           const float* __restrict__ kc, const float* __restrict__ vc,
                                           float* __restrict__ out, int n, int pos0, int n_head, int n_kv,
                                           int group) {
    constexpr int NQ = HD / 16;
    __shared__ float qk_smem[2 * QROWS * 33];
    __shared__ float Ps[QROWS][KT + 1];
    float (*Qs)[33] = reinterpret_cast<float (*)[33]>(qk_smem);
    float (*Ks)[33] = reinterpret_cast<float (*)[33]>(qk_smem + QROWS * 33);
    float (*Vs)[HD] = reinterpret_cast<float (*)[HD]>(qk_smem);
    static_assert(16 * HD <= 2 * QROWS * 33, "V staging must fit the Q/K staging area");

    const int tq = QROWS / group;
    const int q0 = blockIdx.x * tq, kvh = blockIdx.y, t = threadIdx.x;
    const int ti = t >> 4, tj = t & 15;
    const int rows = min(tq, n - q0) * group;
    const int kv_end = pos0 + min(q0 + tq, n);
    const float inv_sqrt = sqrtf((float)HD);

    int qpos[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int r = ti * 4 + a;
        qpos[a] = r < rows ? pos0 + q0 + r / group : -1;
    }
    float m[4], l[4], O[4][NQ];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        m[a] = -1e30f;
        l[a] = 0.f;
#pragma unroll
        for (int j = 0; j < NQ; ++j) O[a][j] = 0.f;
    }
    const int sr = t >> 2, sc = (t & 3) * 8;
    const float* q_row = nullptr;
    if (sr < rows) q_row = q + ((long long)(q0 + sr / group) * n_head + kvh * group + sr % group) * HD;

    for (int j0 = 0; j0 < kv_end; j0 += KT) {
        float s[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) s[a][b] = 0.f;
        const int key = j0 + sr;
        const float* k_row = key < kv_end ? kc + ((long long)key * n_kv + kvh) * HD : nullptr;
        for (int d0 = 0; d0 < HD; d0 += 32) {
            __syncthreads();
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                Qs[sr][sc + e] = q_row != nullptr ? q_row[d0 + sc + e] : 0.f;
                Ks[sr][sc + e] = k_row != nullptr ? k_row[d0 + sc + e] : 0.f;
            }
            __syncthreads();
#pragma unroll 8
            for (int x = 0; x < 32; ++x) {
                float qa[4], kb[4];
#pragma unroll
                for (int a = 0; a < 4; ++a) { qa[a] = Qs[ti * 4 + a][x]; kb[a] = Ks[tj * 4 + a][x]; }
                fma_outer4(s, qa, kb);
            }
        }
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            float mx = -INFINITY;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int kj = j0 + tj * 4 + b;
                s[a][b] = (kj <= qpos[a] && kj < kv_end) ? s[a][b] / inv_sqrt : -INFINITY;
                mx = fmaxf(mx, s[a][b]);
            }
            online_softmax_row<NQ>(s[a], mx, m[a], l[a], O[a],
                                   [&](int b, float p) { Ps[ti * 4 + a][tj * 4 + b] = p; });
        }
        for (int js = 0; js < KT; js += 16) {
            __syncthreads();
            for (int i = t; i < 16 * HD; i += blockDim.x) {
                const int jj = i / HD, x = i % HD, kj = j0 + js + jj;
                Vs[jj][x] = kj < kv_end ? vc[((long long)kj * n_kv + kvh) * HD + x] : 0.f;
            }
            __syncthreads();
#pragma unroll 4
            for (int jj = 0; jj < 16; ++jj) {
                float pa[4];
#pragma unroll
                for (int a = 0; a < 4; ++a) pa[a] = Ps[ti * 4 + a][js + jj];
#pragma unroll
                for (int j = 0; j < NQ; ++j) {
                    const float v = Vs[jj][tj + 16 * j];
#pragma unroll
                    for (int a = 0; a < 4; ++a) O[a][j] = fmaf(pa[a], v, O[a][j]);
                }
            }
        }
    }

#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int r = ti * 4 + a;
        if (r >= rows) continue;
        const int tok = q0 + r / group, hq = kvh * group + r % group;
        const float* gate = qg + ((long long)tok * n_head + hq) * 2 * HD + HD;
        float* dst = out + ((long long)tok * n_head + hq) * HD;
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            const int col = tj + 16 * j;
            dst[col] = (O[a][j] / l[a]) * sigmoid_att(gate[col]);
        }
    }
}

#define FLASH_KERNEL(NAME, HD)                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                    \
    NAME(const float* __restrict__ q, const float* __restrict__ qg, const float* __restrict__ kc,        \
         const float* __restrict__ vc, float* __restrict__ out, int n, int pos0, int n_head, int n_kv,   \
         int group) {                                                                                    \
        flash_body<HD>(q, qg, kc, vc, out, n, pos0, n_head, n_kv, group);                                \
    }

FLASH_KERNEL(flash_attn_32, 32)
FLASH_KERNEL(flash_attn_64, 64)
FLASH_KERNEL(flash_attn_128, 128)
FLASH_KERNEL(flash_attn_256, 256)
