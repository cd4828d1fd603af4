/* The prefill's set loops shaped for AVX2's 16 ymm registers (attn_prefill.h includes this in the
 * AVX2 build in place of its 16-wide ones, whose 16 accumulators of two ymm each spilled there, and
 * whose 64-byte compares and shuffles GCC lowered lane by lane): the same operations on the same
 * numbers in the same order, so the same bits as every other level. A dot's 16 lanes are two ymm,
 * lanes 0-7 and 8-15, and no lane's sum touches another's, so the halves can run one after the other:
 *   scores_set   per 3 keys, 4 rows x 3 keys x one half of the lanes at a time (12 accumulators; 8
 *                left the FMAs waiting on each other), the 16 lane sums of each dot stored to a small
 *                buffer; then attn_avx2.h's tree4 for the 8 rows (float adds from memory, no extracts);
 *   softmax_set  one ymm per key (its 8 rows): the max, then attn_exp, then the 16 lane sums one lane
 *                at a time (2 ymm of doubles each), then the same tree between them;
 *   pv_set_cols  4 rows x 16 head dims (8 accumulators) per pass over the keys. */

_Static_assert(SET == 8, "a ymm holds one key of a set's rows");

#define SKEYS 3   /* keys per scores_set step: 4 rows x 3 keys = 12 accumulators, 3 k and 1 q register */

/* Lanes lo (0-7) or hi (8-15) of the 12 dots of rows q[0..3] with keys kt[0..2] (lane l: q[i] k[i]
 * fused-multiply-added for i = l, l + 16, ... < hd in order, from +0), stored as
 * buf[(u * SET + x) * LANES + l] for key u, row x; h = 0 or 8 picks the half. */
AI void dots_half(const float *const *q, const float *const *kt, size_t hd, size_t h, float *buf)
{
    __m256 acc[SKEYS][4];
    for (int u = 0; u < SKEYS; u++)
        for (int x = 0; x < 4; x++)
            acc[u][x] = _mm256_setzero_ps();
    for (size_t i = h; i < hd; i += LANES) {
        __m256 kv[SKEYS];
        for (int u = 0; u < SKEYS; u++)
            kv[u] = _mm256_loadu_ps(kt[u] + i);
        for (int x = 0; x < 4; x++) {
            __m256 qx = _mm256_loadu_ps(q[x] + i);
            __asm__("" : "+x"(qx));   /* one load for all the keys' FMAs, not one folded into each */
            for (int u = 0; u < SKEYS; u++)
                acc[u][x] = _mm256_fmadd_ps(qx, kv[u], acc[u][x]);
        }
    }
    for (int u = 0; u < SKEYS; u++)
        for (int x = 0; x < 4; x++)
            _mm256_store_ps(buf + (u * SET + x) * LANES + h, acc[u][x]);
}

/* Scaled scores of the SET rows q[x] against keys t = 0..len-1 (k_t = k + t * krow) into
 * S[t * SET + x]; SKEYS keys a step, past len the last key again, its scores not stored. */
static void scores_set(const float *const *q, const float *k, size_t krow, size_t len, size_t hd, float scale,
                       float *S)
{
    float buf[SKEYS * SET * LANES] __attribute__((aligned(32)));
    const __m256 sc = _mm256_set1_ps(scale);
    for (size_t t = 0; t < len; t += SKEYS) {
        const float *kt[SKEYS];
        for (size_t u = 0; u < SKEYS; u++)
            kt[u] = k + (t + u < len ? t + u : len - 1) * krow;
        for (size_t i = 0; i < hd; i += LANES)
            for (size_t u = SKEYS; u < 2 * SKEYS; u++)
                __builtin_prefetch(k + (t + u) * krow + i);
        for (int g = 0; g < SET; g += 4)
            for (size_t h = 0; h < LANES; h += LANES / 2)
                dots_half(q + g, kt, hd, h, buf + g * LANES);
        for (size_t u = 0; u < SKEYS && t + u < len; u++) {
            const float *L = buf + u * SET * LANES;
            const __m256 s = _mm256_set_m128(tree4(L + 4 * LANES), tree4(L));
            _mm256_storeu_ps(S + (t + u) * SET, _mm256_mul_ps(s, sc));
        }
    }
}

/* o[x][c .. c + nv * LANES) += S[t * SET + x] v_t there for t = t0 .. t1 - 1 (float, t in order, one
 * rounding per term; for t0 = 0 the sums start at +0), v_t = v + t * vrow; prefetches the same
 * columns of the next pass's rows. */
AI void pv_set_cols(const float *S, const float *v, size_t vrow, size_t t0, size_t t1, size_t c, size_t nv,
                    float *const *o)
{
    for (size_t y = c; y < c + nv * LANES; y += LANES)
        for (int g = 0; g < SET; g += 4) {
            __m256 acc[4][2];
            for (int x = 0; x < 4; x++)
                for (int z = 0; z < 2; z++)
                    acc[x][z] = t0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o[g + x] + y + 8 * z);
            for (size_t t = t0; t < t1; t++) {
                const float *vt = v + t * vrow + y;
                if (g == 0)
                    __builtin_prefetch(vt + PV_KEYS * vrow);
                const __m256 v0 = _mm256_loadu_ps(vt), v1 = _mm256_loadu_ps(vt + 8);
                for (int x = 0; x < 4; x++) {
                    const __m256 p = _mm256_broadcast_ss(S + t * SET + g + x);
                    acc[x][0] = _mm256_fmadd_ps(p, v0, acc[x][0]);
                    acc[x][1] = _mm256_fmadd_ps(p, v1, acc[x][1]);
                }
            }
            for (int x = 0; x < 4; x++)
                for (int z = 0; z < 2; z++)
                    _mm256_storeu_ps(o[g + x] + y + 8 * z, acc[x][z]);
        }
}

/* attn_exp of 8 floats (one key of the SET rows). */
typedef float vf8 __attribute__((vector_size(32)));
typedef int vi8 __attribute__((vector_size(32)));
ATTN_DEFINE_EXP(exp8v, vf8, vi8)
AI __m256 exp8(__m256 x)
{
    return (__m256)exp8v((vf8)x);
}

/* softmax_block for the SET rows of S at once: row x's scores are S[t * SET + x] for t < len[x]
 * (keys = max len[x]); -> its probabilities there and +0 from len[x] on, S padded with +0 to a
 * multiple of LANES keys; mx[x] and sum[x] as softmax_block returns them. One pass takes the max,
 * one the probabilities, then one per lane l its double sum over keys t = l, l + 16, ... in order. */
static void softmax_set(float *S, const size_t *len, size_t keys, float *mx, double *sum)
{
    const size_t padded = pad_set(S, len, keys);
    __m256 vm = _mm256_loadu_ps(S);
    for (size_t t = 1; t < padded; t++)
        vm = _mm256_max_ps(_mm256_loadu_ps(S + t * SET), vm);
    for (size_t t = 0; t < padded; t++)
        _mm256_storeu_ps(S + t * SET, exp8(_mm256_sub_ps(_mm256_loadu_ps(S + t * SET), vm)));
    __m256d lane[LANES][2];
    for (int l = 0; l < LANES; l++) {
        __m256d a = _mm256_setzero_pd(), b = _mm256_setzero_pd();
        for (size_t t = l; t < padded; t += LANES) {
            a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm_loadu_ps(S + t * SET)));
            b = _mm256_add_pd(b, _mm256_cvtps_pd(_mm_loadu_ps(S + t * SET + 4)));
        }
        lane[l][0] = a;
        lane[l][1] = b;
    }
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            for (int z = 0; z < 2; z++)
                lane[l][z] = _mm256_add_pd(lane[l][z], lane[l + w][z]);
    _mm256_storeu_ps(mx, vm);
    _mm256_storeu_pd(sum, lane[0][0]);
    _mm256_storeu_pd(sum + 4, lane[0][1]);
}
