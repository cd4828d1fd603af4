// Weight GEMM with the dequantization fused into the tile load, float32 accumulation.
//
//   C[c_row(m), n] = (accumulate ? C[c_row(m), n] : 0) + scale(m) * sum_k A[a_row(m), k] * W[n, k]
//
// A: float32 activations, row stride lda (floats, multiple of 4); a_row(m) = a_rows[m] when a_rows is
//    given (gather), else m. W: N rows of K values stored as GGML blocks (F32, F16, BF16, Q4_0, Q4_1,
//    Q8_0; layouts of llama.cpp ggml-common.h), w_row_bytes bytes per row. C: float32, row stride ldc;
//    c_row(m) = c_rows[m] or m; scale(m) = row_scale[m] or 1. K must be a multiple of 32 (one block).
//
// Grouped form (routed experts, tokens sorted by expert): `tiles` holds one (row_start, row_count,
// w_byte_offset) triple per M tile; block y works on rows row_start .. row_start+row_count-1 against
// the weight matrix at W + w_byte_offset; when n_tiles (device int) is given, blocks y >= *n_tiles exit
// (the grid is sized for the most tiles a routing can need, the routing kernels write the real count).
// Without tiles, block y covers rows y*BM .. y*BM+BM-1.
//
// Tile: BM (64, or 32 for the grouped expert GEMMs whose groups average ~30 rows) x BN=128 weight rows
// x BK=32, 256 threads, (BM/16) x 8 outputs per thread (columns tn*4..tn*4+3 and 64+tn*4..64+tn*4+3,
// so a half-warp reads 256 contiguous shared-memory bytes). The next k step's A values and raw weight
// bytes are loaded into registers while the current step computes (one-stage software pipeline).
//
// gemv_*: y[n] = sum_k x[k] W[n, k] for one activation row (the LM head of the last token), one warp
// per weight row (grid-stride), so the weights are read once and nothing is spent on empty tile rows.
// K <= 8192.
// embed_rows_*: dequantize whole rows (token embeddings gathered on the host) to float32.
#include <cuda_fp16.h>

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

__device__ __forceinline__ unsigned int u16_pair(const unsigned short* p) {
    return (unsigned int)p[0] | ((unsigned int)p[1] << 16);
}

// Raw<QT>: the bytes of half h (0/1) of 32-value block kb of one weight row, held in registers.
// val(i) is its i-th value (i < 16) and kidx(i, h) that value's column within the block.
template <int QT> struct Raw;

template <> struct Raw<QT_Q4_0> {
    float d;
    unsigned int q[2];  // 8 bytes: x[j] = low nibble, x[j+16] = high nibble of byte j
    __device__ __forceinline__ void load(const unsigned char* row, int kb, int h) {
        const unsigned char* blk = row + kb * 18;
        d = f16_at(blk);
        const unsigned short* qs = reinterpret_cast<const unsigned short*>(blk + 2) + h * 4;
        q[0] = u16_pair(qs);
        q[1] = u16_pair(qs + 2);
    }
    __device__ __forceinline__ float val(int i) const {
        const int b = (q[(i & 7) >> 2] >> ((i & 3) * 8)) & 0xff;
        return d * (float)((i < 8 ? (b & 15) : (b >> 4)) - 8);
    }
    static __device__ __forceinline__ int kidx(int i, int h) { return (i < 8 ? 0 : 16) + h * 8 + (i & 7); }
};

template <> struct Raw<QT_Q4_1> {
    float d, m;
    unsigned int q[2];
    __device__ __forceinline__ void load(const unsigned char* row, int kb, int h) {
        const unsigned char* blk = row + kb * 20;
        d = f16_at(blk);
        m = f16_at(blk + 2);
        const unsigned short* qs = reinterpret_cast<const unsigned short*>(blk + 4) + h * 4;
        q[0] = u16_pair(qs);
        q[1] = u16_pair(qs + 2);
    }
    __device__ __forceinline__ float val(int i) const {
        const int b = (q[(i & 7) >> 2] >> ((i & 3) * 8)) & 0xff;
        return d * (float)(i < 8 ? (b & 15) : (b >> 4)) + m;
    }
    static __device__ __forceinline__ int kidx(int i, int h) { return (i < 8 ? 0 : 16) + h * 8 + (i & 7); }
};

template <> struct Raw<QT_Q8_0> {
    float d;
    unsigned int q[4];  // 16 int8 values
    __device__ __forceinline__ void load(const unsigned char* row, int kb, int h) {
        const unsigned char* blk = row + kb * 34;
        d = f16_at(blk);
        const unsigned short* qs = reinterpret_cast<const unsigned short*>(blk + 2) + h * 8;
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = u16_pair(qs + 2 * i);
    }
    __device__ __forceinline__ float val(int i) const {
        return d * (float)(signed char)((q[i >> 2] >> ((i & 3) * 8)) & 0xff);
    }
    static __device__ __forceinline__ int kidx(int i, int h) { return h * 16 + i; }
};

template <> struct Raw<QT_F32> {
    float4 v[4];
    __device__ __forceinline__ void load(const unsigned char* row, int kb, int h) {
        const float4* src = reinterpret_cast<const float4*>(row + (kb * 32 + h * 16) * 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = src[i];
    }
    __device__ __forceinline__ float val(int i) const {
        const float4 x = v[i >> 2];
        return (i & 3) == 0 ? x.x : (i & 3) == 1 ? x.y : (i & 3) == 2 ? x.z : x.w;
    }
    static __device__ __forceinline__ int kidx(int i, int h) { return h * 16 + i; }
};

template <> struct Raw<QT_F16> {
    uint4 v[2];  // 16 halves
    __device__ __forceinline__ void load(const unsigned char* row, int kb, int h) {
        const uint4* src = reinterpret_cast<const uint4*>(row + (kb * 32 + h * 16) * 2);
        v[0] = src[0];
        v[1] = src[1];
    }
    __device__ __forceinline__ unsigned int bits(int i) const {
        const uint4 x = v[i >> 3];
        const int w = (i >> 1) & 3;
        const unsigned int u = w == 0 ? x.x : w == 1 ? x.y : w == 2 ? x.z : x.w;
        return (i & 1) ? (u >> 16) : (u & 0xffff);
    }
    __device__ __forceinline__ float val(int i) const { return __half2float(__ushort_as_half((unsigned short)bits(i))); }
    static __device__ __forceinline__ int kidx(int i, int h) { return h * 16 + i; }
};

template <> struct Raw<QT_BF16> : Raw<QT_F16> {
    __device__ __forceinline__ float val(int i) const { return __uint_as_float(bits(i) << 16); }
};

template <int QT, int BM>
__device__ __forceinline__ void qgemm_body(const float* __restrict__ A, int lda, const int* __restrict__ a_rows,
                                           const unsigned char* __restrict__ W, long long w_row_bytes,
                                           const long long* __restrict__ tiles, float* __restrict__ C, int ldc,
                                           const int* __restrict__ c_rows, const float* __restrict__ row_scale,
                                           int accumulate, int M, int N, int K, const int* __restrict__ n_tiles) {
    if (n_tiles != nullptr && (int)blockIdx.y >= *n_tiles) return;
    constexpr int TM = BM / 16;      // rows per thread
    constexpr int LA = BM / 8;       // A values loaded per thread per k step
    constexpr int TPR = BK / LA;     // loader threads per A row
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

    const int la_m = t / TPR, la_k = (t % TPR) * LA;
    const float* a_ptr = nullptr;
    if (la_m < row_count) {
        const int r = row_start + la_m;
        a_ptr = A + (long long)(a_rows != nullptr ? a_rows[r] : r) * lda + la_k;
    }
    const int lw_c = t & (BN - 1), lw_h = t >> 7;
    const unsigned char* w_ptr = (n0 + lw_c < N) ? Wb + (long long)(n0 + lw_c) * w_row_bytes : nullptr;

    const int tm = t >> 4, tn = t & 15;
    float acc[TM][8];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

    float4 av[LA / 4];
    Raw<QT> raw;
#pragma unroll
    for (int i = 0; i < LA / 4; ++i) av[i] = a_ptr != nullptr ? *reinterpret_cast<const float4*>(a_ptr + 4 * i)
                                                              : make_float4(0.f, 0.f, 0.f, 0.f);
    if (w_ptr != nullptr) raw.load(w_ptr, 0, lw_h);

    for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
        for (int i = 0; i < LA / 4; ++i) {
            As[la_m][la_k + 4 * i] = av[i].x;
            As[la_m][la_k + 4 * i + 1] = av[i].y;
            As[la_m][la_k + 4 * i + 2] = av[i].z;
            As[la_m][la_k + 4 * i + 3] = av[i].w;
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) Ws[Raw<QT>::kidx(i, lw_h)][lw_c] = w_ptr != nullptr ? raw.val(i) : 0.f;
        __syncthreads();
        if (k0 + BK < K) {
#pragma unroll
            for (int i = 0; i < LA / 4; ++i)
                if (a_ptr != nullptr) av[i] = *reinterpret_cast<const float4*>(a_ptr + k0 + BK + 4 * i);
            if (w_ptr != nullptr) raw.load(w_ptr, (k0 + BK) / BK, lw_h);
        }
#pragma unroll 8
        for (int k = 0; k < BK; ++k) {
            float a[TM];
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = As[tm * TM + i][k];
            const float4 b0 = *reinterpret_cast<const float4*>(&Ws[k][tn * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Ws[k][64 + tn * 4]);
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int m = tm * TM + i;
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

// out[r][0:K] = dequantized row r of rows (n rows of row_bytes each). Grid (n), 256 threads.
template <int QT>
__device__ __forceinline__ void embed_body(const unsigned char* __restrict__ rows, long long row_bytes,
                                           float* __restrict__ out, int K) {
    const unsigned char* row = rows + (long long)blockIdx.x * row_bytes;
    float* dst = out + (long long)blockIdx.x * K;
    for (int part = threadIdx.x; part < K / 16; part += blockDim.x) {
        const int kb = part >> 1, h = part & 1;
        Raw<QT> raw;
        raw.load(row, kb, h);
#pragma unroll
        for (int i = 0; i < 16; ++i) dst[kb * 32 + Raw<QT>::kidx(i, h)] = raw.val(i);
    }
}

template <int QT>
__device__ __forceinline__ void gemv_body(const float* __restrict__ x, const unsigned char* __restrict__ W,
                                          long long w_row_bytes, float* __restrict__ y, int N, int K) {
    __shared__ float xs[8192];
    for (int i = threadIdx.x; i < K; i += blockDim.x) xs[i] = x[i];
    __syncthreads();
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int n = blockIdx.x * warps + (threadIdx.x >> 5); n < N; n += gridDim.x * warps) {
        const unsigned char* row = W + (long long)n * w_row_bytes;
        float acc = 0.f;
        for (int part = lane; part < K / 16; part += 32) {
            const int kb = part >> 1, h = part & 1;
            Raw<QT> raw;
            raw.load(row, kb, h);
#pragma unroll
            for (int i = 0; i < 16; ++i) acc = fmaf(raw.val(i), xs[kb * 32 + Raw<QT>::kidx(i, h)], acc);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) y[n] = acc;
    }
}

#define GEMV_KERNEL(NAME, QT)                                                                               \
    extern "C" __global__ void NAME(const float* __restrict__ x, const unsigned char* __restrict__ W,       \
                                    long long w_row_bytes, float* __restrict__ y, int N, int K) {           \
        gemv_body<QT>(x, W, w_row_bytes, y, N, K);                                                          \
    }

#define QGEMM_KERNEL(NAME, QT, BM)                                                                          \
    extern "C" __global__ void __launch_bounds__(NT, 2)                                                     \
    NAME(const float* __restrict__ A, int lda, const int* __restrict__ a_rows,                              \
         const unsigned char* __restrict__ W, long long w_row_bytes, const long long* __restrict__ tiles,  \
         float* __restrict__ C, int ldc, const int* __restrict__ c_rows,                                    \
         const float* __restrict__ row_scale, int accumulate, int M, int N, int K,                          \
         const int* __restrict__ n_tiles) {                                                                 \
        qgemm_body<QT, BM>(A, lda, a_rows, W, w_row_bytes, tiles, C, ldc, c_rows, row_scale, accumulate,   \
                           M, N, K, n_tiles);                                                               \
    }

#define EMBED_KERNEL(NAME, QT)                                                                              \
    extern "C" __global__ void NAME(const unsigned char* __restrict__ rows, long long row_bytes,            \
                                    float* __restrict__ out, int K) {                                       \
        embed_body<QT>(rows, row_bytes, out, K);                                                            \
    }

#define TYPE_KERNELS(SUFFIX, QT)                  \
    QGEMM_KERNEL(qgemm_##SUFFIX, QT, 64)          \
    QGEMM_KERNEL(qgemm32_##SUFFIX, QT, 32)        \
    GEMV_KERNEL(gemv_##SUFFIX, QT)                \
    EMBED_KERNEL(embed_rows_##SUFFIX, QT)

TYPE_KERNELS(f32, QT_F32)
TYPE_KERNELS(f16, QT_F16)
TYPE_KERNELS(bf16, QT_BF16)
TYPE_KERNELS(q4_0, QT_Q4_0)
TYPE_KERNELS(q4_1, QT_Q4_1)
TYPE_KERNELS(q8_0, QT_Q8_0)
