// Chunked Gated DeltaNet (docs/spec/qwen35.md 3.2, chunked form; numpy twin
// engine/ops/reference.py gdn_chunked), in two kernels:
//
//   gdn_chunk_prep  (grid: chunks x v-heads; all independent)
//       G = cumsum(g) (float64), Gam_ij = exp(G_i - G_j) for j <= i,
//       L = strict_lower(diag(beta) K K^T * Gam), P = (Q K^T) * Gam,
//       [U | W] = (I + L)^-1 [diag(beta) V | diag(beta exp(G)) K]   (forward substitution)
//   gdn_chunk_scan  (grid: dv/32 column slices x v-heads; sequential over chunks)
//       Vn = U - W S ;  O = diag(exp(G)) Q S + P Vn ;  S <- exp(G_last) S + (diag(exp(G_last - G)) K)^T Vn
//
// The columns of S (the dv axis) evolve independently, so the scan splits them across blocks.
// Input rows u[t] (conv_dim C) hold [q: nk*dk | k: nk*dk | v: nv*dv] after SiLU and L2 norm (q also
// scaled by 1/sqrt(dk)); v-head h reads q/k head h mod nk (GGUF tiled order). The last chunk is padded
// with q = k = v = 0, beta = 0, g = 0. Limits: dk <= 128, dv any (column slices of 32).
// Scratch per (v-head, chunk): W (64 x dk), U (64 x dv), P (64 x 64) float32 and G (64) float64.

#define CH 64
#define DS 32
#define MAXDK 128

extern "C" __global__ void __launch_bounds__(256)
gdn_chunk_prep(const float* __restrict__ u, const float* __restrict__ beta, const float* __restrict__ g,
               float* __restrict__ Wout, float* __restrict__ Uout, float* __restrict__ Pout,
               double* __restrict__ Gout, int n, int C, int nk, int nv, int dk, int dv, int nc) {
    __shared__ double Gs[CH];
    __shared__ float bs[CH];
    __shared__ float Ks[CH][33];
    __shared__ float Qs[CH][33];
    __shared__ float Ls[CH][CH + 1];
    const int c = blockIdx.x, h = blockIdx.y, kh = h % nk, t = threadIdx.x;
    const int t0 = c * CH;
    const long long cb = ((long long)h * nc + c) * CH;
    const float* qbase = u + (long long)kh * dk;
    const float* kbase = u + (long long)(nk + kh) * dk;
    const float* vbase = u + 2LL * nk * dk + (long long)h * dv;

    if (t < CH) {
        const int tt = t0 + t;
        const bool ok = tt < n;
        bs[t] = ok ? beta[(long long)tt * nv + h] : 0.f;
        Gs[t] = ok ? (double)g[(long long)tt * nv + h] : 0.0;
    }
    __syncthreads();
    if (t == 0) {
        double s = 0.0;
        for (int i = 0; i < CH; ++i) { s += Gs[i]; Gs[i] = s; }
    }

    const int ti = t >> 4, tj = t & 15;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) { kk[a][b] = 0.f; qk[a][b] = 0.f; }
    for (int s0 = 0; s0 < dk; s0 += 32) {
        __syncthreads();
        const int r = t >> 2, cc = (t & 3) * 8, tt = t0 + r;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int x = s0 + cc + e;
            const bool ok = tt < n && x < dk;
            Ks[r][cc + e] = ok ? kbase[(long long)tt * C + x] : 0.f;
            Qs[r][cc + e] = ok ? qbase[(long long)tt * C + x] : 0.f;
        }
        __syncthreads();
#pragma unroll 4
        for (int x = 0; x < 32; ++x) {
            float ka[4], qa[4], kb[4];
#pragma unroll
            for (int a = 0; a < 4; ++a) { ka[a] = Ks[ti * 4 + a][x]; qa[a] = Qs[ti * 4 + a][x]; kb[a] = Ks[tj * 4 + a][x]; }
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 4; ++b) { kk[a][b] = fmaf(ka[a], kb[b], kk[a][b]); qk[a][b] = fmaf(qa[a], kb[b], qk[a][b]); }
        }
    }
    __syncthreads();
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int i = ti * 4 + a, j = tj * 4 + b;
            const float gam = j <= i ? (float)exp(Gs[i] - Gs[j]) : 0.f;
            Ls[i][j] = j < i ? (bs[i] * kk[a][b]) * gam : 0.f;
            Pout[(cb + i) * CH + j] = qk[a][b] * gam;
        }
    if (t < CH) Gout[cb + t] = Gs[t];
    __syncthreads();

    for (int col = t; col < dv + dk; col += blockDim.x) {
        float x[CH];
        const bool is_v = col < dv;
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int tt = t0 + i;
            if (tt >= n) {
                x[i] = 0.f;
            } else if (is_v) {
                x[i] = bs[i] * vbase[(long long)tt * C + col];
            } else {
                const float coef = (float)((double)bs[i] * exp(Gs[i]));
                x[i] = coef * kbase[(long long)tt * C + (col - dv)];
            }
        }
#pragma unroll
        for (int i = 1; i < CH; ++i) {
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < i; ++j) acc = fmaf(Ls[i][j], x[j], acc);
            x[i] -= acc;
        }
        if (is_v) {
#pragma unroll
            for (int i = 0; i < CH; ++i) Uout[(cb + i) * dv + col] = x[i];
        } else {
#pragma unroll
            for (int i = 0; i < CH; ++i) Wout[(cb + i) * dk + (col - dv)] = x[i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
gdn_chunk_scan(const float* __restrict__ u, const float* __restrict__ Win, const float* __restrict__ Uin,
               const float* __restrict__ Pin, const double* __restrict__ Gin, float* __restrict__ state,
               float* __restrict__ o, int n, int C, int nk, int nv, int dk, int dv, int nc) {
    __shared__ float S[MAXDK][DS];
    __shared__ float Vn[CH][DS + 1];
    __shared__ float St[CH][33];
    __shared__ float eG[CH], eL[CH];
    __shared__ float dec;
    const int h = blockIdx.y, kh = h % nk, col0 = blockIdx.x * DS, t = threadIdx.x;
    const int cl = t & 31, grp = t >> 5;
    const bool col_ok = col0 + cl < dv;
    float* Sg = state + (long long)h * dk * dv;
    const float* qbase = u + (long long)kh * dk;
    const float* kbase = u + (long long)(nk + kh) * dk;
    const int sr = t >> 2, sc = (t & 3) * 8;  // staging: row sr, 8 columns from sc

    for (int i = t; i < MAXDK * DS; i += blockDim.x) {
        const int k = i / DS, cc = i % DS;
        S[k][cc] = (k < dk && col0 + cc < dv) ? Sg[(long long)k * dv + col0 + cc] : 0.f;
    }

    for (int c = 0; c < nc; ++c) {
        const int t0 = c * CH;
        const long long cb = ((long long)h * nc + c) * CH;
        __syncthreads();
        if (t < CH) {
            const double G = Gin[cb + t], GL = Gin[cb + CH - 1];
            eG[t] = (float)exp(G);
            eL[t] = (float)exp(GL - G);
            if (t == 0) dec = (float)exp(GL);
        }

        // Vn = U - W S (rows grp*8 .. grp*8+7, column cl)
        float acc[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) acc[r] = 0.f;
        for (int s0 = 0; s0 < dk; s0 += 32) {
            __syncthreads();
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int x = s0 + sc + e;
                St[sr][sc + e] = x < dk ? Win[(cb + sr) * dk + x] : 0.f;
            }
            __syncthreads();
#pragma unroll 8
            for (int x = 0; x < 32; ++x) {
                const float sv = S[s0 + x][cl];
#pragma unroll
                for (int r = 0; r < 8; ++r) acc[r] = fmaf(St[grp * 8 + r][x], sv, acc[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const int i = grp * 8 + r;
            Vn[i][cl] = col_ok ? Uin[(cb + i) * dv + col0 + cl] - acc[r] : 0.f;
        }

        // O = diag(exp(G)) Q S + P Vn
        float oq[8], op[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) { oq[r] = 0.f; op[r] = 0.f; }
        for (int s0 = 0; s0 < dk; s0 += 32) {
            __syncthreads();
            const int tt = t0 + sr;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int x = s0 + sc + e;
                St[sr][sc + e] = (tt < n && x < dk) ? qbase[(long long)tt * C + x] * eG[sr] : 0.f;
            }
            __syncthreads();
#pragma unroll 8
            for (int x = 0; x < 32; ++x) {
                const float sv = S[s0 + x][cl];
#pragma unroll
                for (int r = 0; r < 8; ++r) oq[r] = fmaf(St[grp * 8 + r][x], sv, oq[r]);
            }
        }
        for (int j0 = 0; j0 < CH; j0 += 32) {
            __syncthreads();
#pragma unroll
            for (int e = 0; e < 8; ++e) St[sr][sc + e] = Pin[(cb + sr) * CH + j0 + sc + e];
            __syncthreads();
#pragma unroll 8
            for (int x = 0; x < 32; ++x) {
                const float vn = Vn[j0 + x][cl];
#pragma unroll
                for (int r = 0; r < 8; ++r) op[r] = fmaf(St[grp * 8 + r][x], vn, op[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const int tt = t0 + grp * 8 + r;
            if (tt < n && col_ok) o[((long long)tt * nv + h) * dv + col0 + cl] = oq[r] + op[r];
        }

        // S <- exp(G_last) S + (diag(exp(G_last - G)) K)^T Vn (rows s0 + grp*4 .. +3 of each slice)
        for (int s0 = 0; s0 < dk; s0 += 32) {
            __syncthreads();
            const int tt = t0 + sr;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int x = s0 + sc + e;
                St[sr][sc + e] = (tt < n && x < dk) ? kbase[(long long)tt * C + x] * eL[sr] : 0.f;
            }
            __syncthreads();
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int kr = grp * 4 + q;
                if (s0 + kr >= dk) continue;
                float a = 0.f;
#pragma unroll 8
                for (int i = 0; i < CH; ++i) a = fmaf(St[i][kr], Vn[i][cl], a);
                S[s0 + kr][cl] = S[s0 + kr][cl] * dec + a;
            }
        }
    }
    __syncthreads();
    for (int i = t; i < dk * DS; i += blockDim.x) {
        const int k = i / DS, cc = i % DS;
        if (col0 + cc < dv) Sg[(long long)k * dv + col0 + cc] = S[k][cc];
    }
}
