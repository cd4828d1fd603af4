// Weight GEMM with the dequantization fused into the tile load, float32 accumulation.
//
//   C[c_row(m), n] = (accumulate ? C[c_row(m), n] : 0) + scale(m) * sum_k A[a_row(m), k] * W[n, k]
//
// A: float32 activations, row stride lda (floats); a_row(m) = a_rows[m] when a_rows is given (gather),
//    else m. W: N rows of K values stored as GGML blocks (F32, F16, BF16, Q4_0, Q4_1, Q8_0; layouts of
//    llama.cpp ggml-common.h), w_row_bytes bytes per row. C: float32, row stride ldc; c_row(m) =
//    c_rows[m] or m; scale(m) = row_scale[m] or 1. K must be a multiple of 32 (one quant block).
//
// Grouped form (routed experts, tokens sorted by expert): `tiles` holds one (row_start, row_count,
// w_byte_offset) triple per M tile; block y works on rows row_start .. row_start+row_count-1 against
// the weight matrix at W + w_byte_offset. Without tiles, block y covers rows y*BM .. y*BM+BM-1.
//
// Tile: BM=64 rows x BN=128 weight rows x BK=32, 256 threads, 4x8 outputs per thread (columns
// tn*4..tn*4+3 and 64+tn*4..64+tn*4+3 so a half-warp reads 256 contiguous shared-memory bytes).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define BM 64
#define BN 128
#define BK 32
#define NT 256

// GGML type ids (ggml.h enum ggml_type).
#define QT_F32 0
#define QT_F16 1
#define QT_Q4_0 2
#define QT_Q4_1 3
#define QT_Q8_0 8
#define QT_BF16 30

__device__ __forceinline__ float f16_at(const unsigned char* p) {
    return __half2float(*reinterpret_cast<const __half*>(p));
}

// Dequantize half `h` (0/1) of 32-value block `kb` of one weight row into Ws[k][col] (16 values).
template <int QT>
__device__ __forceinline__ void dequant_half(const unsigned char* __restrict__ row, int kb, int h,
                                             float (*Ws)[BN + 4], int col);

template <>
__device__ __forceinline__ void dequant_half<QT_Q4_0>(const unsigned char* __restrict__ row, int kb, int h,
                                                      float (*Ws)[BN + 4], int col) {
    const unsigned char* blk = row + kb * 18;
    const float d = f16_at(blk);
    const unsigned short* qs = reinterpret_cast<const unsigned short*>(blk + 2) + h * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int w = qs[i];
        const int b0 = w & 0xff, b1 = w >> 8;
        Ws[h * 8 + 2 * i][col] = d * (float)((b0 & 15) - 8);
        Ws[h * 8 + 2 * i + 1][col] = d * (float)((b1 & 15) - 8);
        Ws[16 + h * 8 + 2 * i][col] = d * (float)((b0 >> 4) - 8);
        Ws[16 + h * 8 + 2 * i + 1][col] = d * (float)((b1 >> 4) - 8);
    }
}

template <>
__device__ __forceinline__ void dequant_half<QT_Q4_1>(const unsigned char* __restrict__ row, int kb, int h,
                                                      float (*Ws)[BN + 4], int col) {
    const unsigned char* blk = row + kb * 20;
    const float d = f16_at(blk), m = f16_at(blk + 2);
    const unsigned short* qs = reinterpret_cast<const unsigned short*>(blk + 4) + h * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int w = qs[i];
        const int b0 = w & 0xff, b1 = w >> 8;
        Ws[h * 8 + 2 * i][col] = d * (float)(b0 & 15) + m;
        Ws[h * 8 + 2 * i + 1][col] = d * (float)(b1 & 15) + m;
        Ws[16 + h * 8 + 2 * i][col] = d * (float)(b0 >> 4) + m;
        Ws[16 + h * 8 + 2 * i + 1][col] = d * (float)(b1 >> 4) + m;
    }
}

template <>
__device__ __forceinline__ void dequant_half<QT_Q8_0>(const unsigned char* __restrict__ row, int kb, int h,
                                                      float (*Ws)[BN + 4], int col) {
    const unsigned char* blk = row + kb * 34;
    const float d = f16_at(blk);
    const unsigned short* qs = reinterpret_cast<const unsigned short*>(blk + 2) + h * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const unsigned int w = qs[i];
        Ws[h * 16 + 2 * i][col] = d * (float)(signed char)(w & 0xff);
        Ws[h * 16 + 2 * i + 1][col] = d * (float)(signed char)(w >> 8);
    }
}

template <>
__device__ __forceinline__ void dequant_half<QT_F32>(const unsigned char* __restrict__ row, int kb, int h,
                                                     float (*Ws)[BN + 4], int col) {
    const float4* src = reinterpret_cast<const float4*>(row + (kb * 32 + h * 16) * 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float4 v = src[i];
        Ws[h * 16 + 4 * i][col] = v.x;
        Ws[h * 16 + 4 * i + 1][col] = v.y;
        Ws[h * 16 + 4 * i + 2][col] = v.z;
        Ws[h * 16 + 4 * i + 3][col] = v.w;
    }
}

template <>
__device__ __forceinline__ void dequant_half<QT_F16>(const unsigned char* __restrict__ row, int kb, int h,
                                                     float (*Ws)[BN + 4], int col) {
    const __half* src = reinterpret_cast<const __half*>(row + (kb * 32 + h * 16) * 2);
#pragma unroll
    for (int i = 0; i < 16; ++i) Ws[h * 16 + i][col] = __half2float(src[i]);
}

template <>
__device__ __forceinline__ void dequant_half<QT_BF16>(const unsigned char* __restrict__ row, int kb, int h,
                                                      float (*Ws)[BN + 4], int col) {
    const unsigned short* src = reinterpret_cast<const unsigned short*>(row + (kb * 32 + h * 16) * 2);
#pragma unroll
    for (int i = 0; i < 16; ++i) Ws[h * 16 + i][col] = __uint_as_float(((unsigned int)src[i]) << 16);
}

template <int QT>
__device__ __forceinline__ void qgemm_body(const float* __restrict__ A, int lda, const int* __restrict__ a_rows,
                                           const unsigned char* __restrict__ W, long long w_row_bytes,
                                           const long long* __restrict__ tiles, float* __restrict__ C, int ldc,
                                           const int* __restrict__ c_rows, const float* __restrict__ row_scale,
                                           int accumulate, int M, int N, int K) {
    __shared__ float As[BM][BK + 1];
    __shared__ __align__(16) float Ws[BK][BN + 4];

    const int t = threadIdx.x;
    int row_start, row_count;
    const unsigned char* Wb = W;
    if (tiles != nullptr) {
        row_start = (int)tiles[blockIdx.y * 3];
        row_count = (int)tiles[blockIdx.y * 3 + 1];
        Wb = W + tiles[blockIdx.y * 3 + 2];
    } else {
        row_start = blockIdx.y * BM;
        row_count = min(BM, M - row_start);
    }
    const int n0 = blockIdx.x * BN;

    // A loader: row la_m, 8 values from la_k.
    const int la_m = t >> 2, la_k = (t & 3) * 8;
    const float* a_ptr = nullptr;
    if (la_m < row_count) {
        const int r = row_start + la_m;
        a_ptr = A + (long long)(a_rows != nullptr ? a_rows[r] : r) * lda + la_k;
    }
    // W loader: weight row n0 + lw_c, half lw_h of each block.
    const int lw_c = t & (BN - 1), lw_h = t >> 7;
    const unsigned char* w_ptr = (n0 + lw_c < N) ? Wb + (long long)(n0 + lw_c) * w_row_bytes : nullptr;

    const int tm = t >> 4, tn = t & 15;
    float acc[4][8];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

    for (int k0 = 0; k0 < K; k0 += BK) {
        if (a_ptr != nullptr) {
            const float4 v0 = *reinterpret_cast<const float4*>(a_ptr + k0);
            const float4 v1 = *reinterpret_cast<const float4*>(a_ptr + k0 + 4);
            As[la_m][la_k] = v0.x; As[la_m][la_k + 1] = v0.y; As[la_m][la_k + 2] = v0.z; As[la_m][la_k + 3] = v0.w;
            As[la_m][la_k + 4] = v1.x; As[la_m][la_k + 5] = v1.y; As[la_m][la_k + 6] = v1.z; As[la_m][la_k + 7] = v1.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) As[la_m][la_k + i] = 0.f;
        }
        if (w_ptr != nullptr) {
            dequant_half<QT>(w_ptr, k0 / BK, lw_h, Ws, lw_c);
        } else {
#pragma unroll
            for (int i = 0; i < 16; ++i) Ws[lw_h * 16 + i][lw_c] = 0.f;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < BK; ++k) {
            float a[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[tm * 4 + i][k];
            const float4 b0 = *reinterpret_cast<const float4*>(&Ws[k][tn * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Ws[k][64 + tn * 4]);
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int m = tm * 4 + i;
        if (m >= row_count) continue;
        const int r = row_start + m;
        float* c_row = C + (long long)(c_rows != nullptr ? c_rows[r] : r) * ldc;
        const float s = row_scale != nullptr ? row_scale[r] : 1.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int n = n0 + (j < 4 ? tn * 4 + j : 64 + tn * 4 + j - 4);
            if (n < N) {
                const float v = s * acc[i][j];
                c_row[n] = accumulate ? c_row[n] + v : v;
            }
        }
    }
}

#define QGEMM_KERNEL(NAME, QT)                                                                              \
    extern "C" __global__ void __launch_bounds__(NT, 2)                                                     \
    NAME(const float* __restrict__ A, int lda, const int* __restrict__ a_rows,                              \
         const unsigned char* __restrict__ W, long long w_row_bytes, const long long* __restrict__ tiles,  \
         float* __restrict__ C, int ldc, const int* __restrict__ c_rows,                                    \
         const float* __restrict__ row_scale, int accumulate, int M, int N, int K) {                        \
        qgemm_body<QT>(A, lda, a_rows, W, w_row_bytes, tiles, C, ldc, c_rows, row_scale, accumulate, M, N, K); \
    }

QGEMM_KERNEL(qgemm_f32, QT_F32)
QGEMM_KERNEL(qgemm_f16, QT_F16)
QGEMM_KERNEL(qgemm_bf16, QT_BF16)
QGEMM_KERNEL(qgemm_q4_0, QT_Q4_0)
QGEMM_KERNEL(qgemm_q4_1, QT_Q4_1)
QGEMM_KERNEL(qgemm_q8_0, QT_Q8_0)
