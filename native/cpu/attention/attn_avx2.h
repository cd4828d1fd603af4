/* The decode kernel's inner loops and the dots' lane tree shaped for AVX2's 16 ymm registers
 * (attn_kernel.h includes this in the AVX2 build in place of its 16-wide scores_row and pv_row, whose
 * 64-byte vectors GCC moved through memory and general registers there): the same operations on the
 * same numbers in the same order, so the same bits as every other level. A dot's 16 lanes are two
 * ymm, lanes 0-7 and 8-15; no lane's sum touches another's. */

/* Of one dot's 16 lane sums L: e[j] = (L[j] + L[j + 8]) + (L[j + 4] + L[j + 12]) in float, j < 4 (tree16's
 * first two levels). */
AI __m128 tree_first(const float *L)
{
    const __m128 s0 = _mm_add_ps(_mm_load_ps(L), _mm_load_ps(L + 8));
    const __m128 s1 = _mm_add_ps(_mm_load_ps(L + 4), _mm_load_ps(L + 12));
    return _mm_add_ps(s0, s1);
}

/* tree16 of 4 dots' lane sums L[x * LANES ..], x < 4, as 4 floats in x order. */
AI __m128 tree4(const float *L)
{
    __m128 e[4];
    for (int x = 0; x < 4; x++)
        e[x] = tree_first(L + x * LANES);
    /* f01 = (e0[0] + e0[2], e0[1] + e0[3], e1[0] + e1[2], e1[1] + e1[3]), f23 likewise; then adjacent pairs */
    const __m128 f01 = _mm_add_ps(_mm_movelh_ps(e[0], e[1]), _mm_movehl_ps(e[1], e[0]));
    const __m128 f23 = _mm_add_ps(_mm_movelh_ps(e[2], e[3]), _mm_movehl_ps(e[3], e[2]));
    return _mm_hadd_ps(f01, f23);
}

/* Scaled scores s[t] of q against keys t = 0..len-1 (k_t = k + t * krow): 4 keys at a time (8
 * accumulators; past len the last key again, its scores not stored), their lane sums through buf into
 * tree4. */
static void scores_row(const float *q, const float *k, size_t krow, size_t len, size_t hd, float scale, float *s)
{
    float buf[4 * LANES] __attribute__((aligned(32)));
    for (size_t t = 0; t < len; t += 4) {
        const float *kt[4];
        for (size_t u = 0; u < 4; u++)
            kt[u] = k + (t + u < len ? t + u : len - 1) * krow;
        __m256 acc[4][2];
        for (int u = 0; u < 4; u++)
            acc[u][0] = acc[u][1] = _mm256_setzero_ps();
        for (size_t i = 0; i < hd; i += LANES) {
            const __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
            for (int u = 0; u < 4; u++) {
                acc[u][0] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kt[u] + i), acc[u][0]);
                acc[u][1] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(kt[u] + i + 8), acc[u][1]);
            }
        }
        for (int u = 0; u < 4; u++)
            for (int z = 0; z < 2; z++)
                _mm256_store_ps(buf + u * LANES + 8 * z, acc[u][z]);
        float r[4];
        _mm_storeu_ps(r, _mm_mul_ps(tree4(buf), _mm_set1_ps(scale)));
        for (size_t u = 0; u < 4 && t + u < len; u++)
            s[t + u] = r[u];
    }
}

/* o[c .. c + 8 * nv) = sum_{t < len} p[t] v_t there (float, t in order, one rounding per term, from +0),
 * v_t = v + t * vrow; nv <= 8 ymm of head dims. */
AI void pv_cols(const float *p, const float *v, size_t vrow, size_t len, size_t c, int nv, float *o)
{
    __m256 acc[8];
    for (int y = 0; y < nv; y++)
        acc[y] = _mm256_setzero_ps();
    for (size_t t = 0; t < len; t++) {
        const __m256 pt = _mm256_broadcast_ss(p + t);
        for (int y = 0; y < nv; y++)
            acc[y] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + t * vrow + c + 8 * y), acc[y]);
    }
    for (int y = 0; y < nv; y++)
        _mm256_storeu_ps(o + c + 8 * y, acc[y]);
}

/* o[hd] = sum_{t < len} p[t] v_t (float, t in order, one rounding per term), v_t = v + t * vrow;
 * 64 head dims at a time, then 16. */
static void pv_row(const float *p, const float *v, size_t vrow, size_t len, size_t hd, float *o)
{
    size_t c = 0;
    for (; c + 64 <= hd; c += 64)
        pv_cols(p, v, vrow, len, c, 8, o);
    for (; c < hd; c += LANES)
        pv_cols(p, v, vrow, len, c, 2, o);
}
