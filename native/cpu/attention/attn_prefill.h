/* The prefill half of the attention kernel (attn_kernel.h includes it after its helpers and decode,
 * once per ISA level): n queries at positions m - n .. m - 1, jobs of (kv head, 16 to 64 positions),
 * each through the blocks in order, every row by exactly the arithmetic of attn_kernel.h's comment.
 *
 * A job copies its q rows, and per block the block's k and v rows of its kv head, into a 64-byte
 * aligned scratch (contiguous rows that stay in L2 while all the job's rows pass), and prefetches the
 * next block's rows into L2 a few lines at a time while it works on this one. Per block its rows (the
 * heads of consecutive positions sharing the kv head, in position order) go through in sets of
 * SET = 8; a set keeps its block's scores as S[t * SET + x] (key t, row x), so one vector holds two
 * keys of all 8 rows:
 *   scores_set   8 rows x 2 keys at a time (16 accumulators, each q vector loaded once into a
 *                register for both keys), the 16 dots' lane trees together (tree16x16), one store;
 *   softmax_set  the max, exp and lane sums vectorised over the rows (16 lane sums of 8 rows in
 *                double, the tree between them lane by lane);
 *   pv_set       the weighted sums 8 rows x 32 head dims x 16 keys at a time (the keys' v rows stay
 *                in L1 for all head dims), p broadcast from S.
 * (The AVX2 build runs the same operations in ymm-sized pieces: attn_prefill_avx2.h.)
 * A set spanning several positions (two at GQA 4, up to 8 at GQA 1) computes the later positions' extra
 * keys for the earlier ones too; softmax_set gives them p = +0 (exp of -inf), which leaves the lane sums
 * and the weighted sums unchanged bit for bit (a sum that starts at +0 never becomes -0). These
 * bit-identity arguments assume finite q, k and v, as the model's are: +0 times an inf in such a key's
 * v row is NaN, and a NaN score can win or lose the row max by the operand order of each level's max. A set that runs past the job's
 * last row repeats that row and drops the copies. The row max is taken in another order than
 * softmax_block's, which changes nothing: a max of non-NaN floats is the same value in any order,
 * and where it is +0 or -0 the sign reaches no result (s - mx and the merge's exp see the same
 * numbers). Splitting the weighted sums into passes of 16 keys stores and reloads float partial
 * sums, which is exact, so every row's operations and their order are those of decode. */

#define SET (LANES / 2)   /* query rows per micro-kernel call: two keys of them fill one vector */

#define PV_KEYS 16   /* keys per pass of pv_set: their v rows (16 KiB at hd 256) stay in L1 for all head dims */

/* Row x's scores S[t * SET + x] from t = len[x] on set to -inf, up to the returned number of keys: keys
 * rounded up to a multiple of LANES (softmax_set's padding). */
static size_t pad_set(float *S, const size_t *len, size_t keys)
{
    const size_t padded = dd_div_up(keys, LANES) * LANES;
    for (size_t x = 0; x < SET; x++)
        for (size_t t = len[x]; t < padded; t++)
            S[t * SET + x] = -INFINITY;
    return padded;
}

#if ATTN_AVX2
#include "attn_prefill_avx2.h"
#else
/* v as it is, but in a register: keeps GCC from folding a vector load into both of its FMAs (a
 * second load where the first one's register would do). */
AI vf in_reg(vf v)
{
#if defined(__AVX512F__)
    __asm__("" : "+v"(v));
#endif
    return v;
}

/* Scaled scores of the SET rows q[x] against keys t = 0..len-1 (k_t = k + t * krow) into
 * S[t * SET + x]; for an odd len, key len - 1 is read twice and its second copy lands in
 * S[len * SET ..], a slot softmax_set overwrites. */
static void scores_set(const float *const *q, const float *k, size_t krow, size_t len, size_t hd, float scale,
                       float *S)
{
    for (size_t t = 0; t < len; t += 2) {
        const float *k0 = k + t * krow, *k1 = t + 1 < len ? k0 + krow : k0;
        vf acc[2 * SET];
        for (int x = 0; x < 2 * SET; x++)
            acc[x] = (vf){ 0 };
        for (size_t i = 0; i < hd; i += LANES) {
            __builtin_prefetch(k0 + 4 * krow + i);
            __builtin_prefetch(k0 + 5 * krow + i);
            const vf a = ld(k0 + i), b = ld(k1 + i);
            for (int x = 0; x < SET; x++) {
                const vf qx = in_reg(ld(q[x] + i));
                acc[x] = vfma(qx, a, acc[x]);
                acc[SET + x] = vfma(qx, b, acc[SET + x]);
            }
        }
        st(S + t * SET, tree16x16(acc) * splat(scale));
    }
}

/* o[x][c .. c + nv * LANES) += S[t * SET + x] v_t there for t = t0 .. t1 - 1 (float, t in order, one
 * rounding per term; for t0 = 0 the sums start at +0), v_t = v + t * vrow; prefetches the same
 * columns of the next pass's rows. */
AI void pv_set_cols(const float *S, const float *v, size_t vrow, size_t t0, size_t t1, size_t c, size_t nv,
                    float *const *o)
{
    vf acc[SET][2];
    for (int x = 0; x < SET; x++)
        for (size_t y = 0; y < nv; y++)
            acc[x][y] = t0 == 0 ? (vf){ 0 } : ld(o[x] + c + y * LANES);
    for (size_t t = t0; t < t1; t++) {
        const float *vt = v + t * vrow + c;
        vf vv[2];
        for (size_t y = 0; y < nv; y++) {
            __builtin_prefetch(vt + PV_KEYS * vrow + y * LANES);
            vv[y] = ld(vt + y * LANES);
        }
        for (int x = 0; x < SET; x++)
            for (size_t y = 0; y < nv; y++)
                acc[x][y] = vfma(splat(S[t * SET + x]), vv[y], acc[x][y]);
    }
    for (int x = 0; x < SET; x++)
        for (size_t y = 0; y < nv; y++)
            st(o[x] + c + y * LANES, acc[x][y]);
}

/* softmax_block for the SET rows of S at once: row x's scores are S[t * SET + x] for t < len[x]
 * (keys = max len[x]); -> its probabilities there and +0 from len[x] on, S padded with +0 to a
 * multiple of LANES keys; mx[x] and sum[x] as softmax_block returns them. */
static void softmax_set(float *S, const size_t *len, size_t keys, float *mx, double *sum)
{
    const size_t padded = pad_set(S, len, keys);
    vf vm = ld(S);
    for (size_t t = 2; t < padded; t += 2)
        vm = vmax(vm, ld(S + t * SET));
    vm = vmax(vm, __builtin_shufflevector(vm, vm, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    vd lane[LANES];
    for (int l = 0; l < LANES; l++)
        lane[l] = (vd){ 0 };
    for (size_t t = 0; t < padded; t += LANES)
        for (int l = 0; l < LANES; l += 2) {
            const vf p = attn_exp(ld(S + (t + l) * SET) - vm);
            st(S + (t + l) * SET, p);
            lane[l] += lo_d(p);
            lane[l + 1] += hi_d(p);
        }
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            lane[l] += lane[l + w];
    for (int x = 0; x < SET; x++) {
        mx[x] = vm[x];
        sum[x] = lane[0][x];
    }
}
#endif

/* The next block's k and v rows of a job's kv head, prefetched into L2 a few lines at a time while
 * the job works on this block, so that pack_rows_kv finds them there and not in L3 or memory. */
typedef struct {
    const char *k, *v;          /* the next block's first row of each (its kv head's part) */
    size_t row_bytes, bytes;    /* the cache's row stride; bytes of one row's part (hd elements) */
    size_t rows, t, off, step;  /* rows to fetch; the cursor (row t, line offset off); lines per call */
} next_block;

/* The cursor's next `step` lines of k and of v (prefetcht1: into L2). */
static void prefetch_next(next_block *p)
{
    for (size_t u = 0; u < p->step && p->t < p->rows; u++) {
        const uintptr_t row = p->t * p->row_bytes, first = (uintptr_t)p->k + row, last = first + p->bytes - 1;
        __builtin_prefetch(p->k + row + p->off, 0, 2);
        __builtin_prefetch(p->v + row + p->off, 0, 2);
        p->off += 64;
        if (((first + p->off) & ~(uintptr_t)63) > (last & ~(uintptr_t)63)) {
            p->off = 0;
            p->t++;
        }
    }
}

/* o[x][hd] = sum_{t < len} S[t * SET + x] v_t for the SET rows: PV_KEYS keys at a time, through
 * all head dims 32 at a time; a step of the next block's prefetch per PV_KEYS keys. */
static void pv_set(const float *S, const float *v, size_t vrow, size_t len, size_t hd, float *const *o,
                   next_block *nb)
{
    for (size_t t0 = 0; t0 < len; t0 += PV_KEYS) {
        prefetch_next(nb);
        const size_t t1 = t0 + PV_KEYS < len ? t0 + PV_KEYS : len;
        size_t c = 0;
        for (; c + 2 * LANES <= hd; c += 2 * LANES)
            pv_set_cols(S, v, vrow, t0, t1, c, 2, o);
        if (c < hd)
            pv_set_cols(S, v, vrow, t0, t1, c, 1, o);
    }
}

typedef struct {
    size_t n_head, n_kv, hd, group, m, n, row, tile, n_tiles;
    const float *q, *gate;
    const void *k, *v;   /* m rows of `row` elements of kv_type */
    int kv_type;
    float *out;
    float scale;
    int failed;
} prefill_job;

/* A job's scratch: per row the running A[hd] and (M, L); 64-byte aligned copies of the job's q rows
 * (Q[row][hd]) and of the block's k and v rows of its kv head (K, V [BLOCK][hd], so that every vector
 * load is aligned and a block's rows are contiguous and stay in L2 for all the job's sets, whatever
 * the caller's alignment and the cache's row length); a set's scores S and sums o[x]. */
typedef struct {
    double *A, *ML;
    float *Q, *K, *V, *S, *o[SET];
} tile_scratch;

/* len rows of hd floats, src_row floats apart -> dst, contiguous. */
static void pack_rows(float *dst, const float *src, size_t src_row, size_t len, size_t hd)
{
    for (size_t t = 0; t < len; t++)
        memcpy(dst + t * hd, src + t * src_row, hd * sizeof(float));
}

/* Rows r .. r + SET - 1 of the job (rows in all, positions from pos0, group G) through the block
 * packed in w (its first position t0): scores, softmax, weighted sums (stepping nb), and the merge
 * into each row's running sums. */
static void prefill_set(const prefill_job *j, size_t rows, size_t pos0, size_t t0, size_t r, tile_scratch *w,
                        next_block *nb)
{
    const size_t G = j->group, hd = j->hd;
    const float *q[SET];
    size_t len[SET], keys = 0;
    for (size_t x = 0; x < SET; x++) {
        const size_t rx = r + x < rows ? r + x : rows - 1, seen = pos0 + rx / G + 1 - t0;
        q[x] = w->Q + rx * hd;
        len[x] = seen < BLOCK ? seen : BLOCK;
        keys = len[x] > keys ? len[x] : keys;
    }
    float mx[SET];
    double sum[SET];
    scores_set(q, w->K, hd, keys, hd, j->scale, w->S);
    softmax_set(w->S, len, keys, mx, sum);
    pv_set(w->S, w->V, hd, keys, hd, w->o, nb);
    for (size_t x = 0; x < SET && r + x < rows; x++)
        merge_block(&w->ML[2 * (r + x)], &w->ML[2 * (r + x) + 1], w->A + (r + x) * hd, mx[x], sum[x], w->o[x], hd,
                    t0 == 0);
}

/* The scratch of a job of `rows` rows; 0 if out of memory (nothing left to free), else free with
 * free(w->A), free(w->Q). */
static int scratch_new(tile_scratch *w, size_t rows, size_t hd)
{
    const size_t floats = (rows + 2 * BLOCK) * hd + SET * (BLOCK + hd);
    w->A = malloc(rows * (hd + 2) * sizeof(double));
    w->Q = aligned_alloc(64, dd_div_up(floats * sizeof(float), 64) * 64);
    if (w->A == NULL || w->Q == NULL) {
        free(w->A);
        free(w->Q);
        return 0;
    }
    w->ML = w->A + rows * hd;
    w->K = w->Q + rows * hd;
    w->V = w->K + BLOCK * hd;
    w->S = w->V + BLOCK * hd;
    for (size_t x = 0; x < SET; x++)
        w->o[x] = w->S + SET * BLOCK + x * hd;
    return 1;
}

/* Pool chunk `chunk` of a prefill_job: kv head chunk / n_tiles, positions (chunk % n_tiles) * tile on;
 * writes those rows of out (j->failed = 1 if its scratch cannot be allocated). */
static void prefill_tile(void *ctx, size_t chunk)
{
    prefill_job *j = ctx;
    const size_t kvh = chunk / j->n_tiles, i0 = chunk % j->n_tiles * j->tile, hd = j->hd, G = j->group;
    const size_t i1 = i0 + j->tile < j->n ? i0 + j->tile : j->n, rows = (i1 - i0) * G, pos0 = j->m - j->n + i0;
    tile_scratch w;
    if (!scratch_new(&w, rows, hd)) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    pack_rows(w.Q, j->q + (i0 * j->n_head + kvh * G) * hd, j->n_head * hd, i1 - i0, G * hd);
    /* block t0 / BLOCK is seen by the rows at positions >= t0, the last one by end - t0 keys */
    const int kt = j->kv_type;
    const size_t end = pos0 + (i1 - i0), rb = kv_bytes(kt, j->row), head_off = kv_bytes(kt, kvh * hd);
    next_block nb = { .k = (const char *)j->k + head_off, .v = (const char *)j->v + head_off,
                      .row_bytes = rb, .bytes = kv_bytes(kt, hd), .rows = end < BLOCK ? end : BLOCK };
    for (size_t t0 = 0; t0 < end; t0 += BLOCK) {
        const size_t first = t0 > pos0 ? (t0 - pos0) * G : 0, keys = end - t0 < BLOCK ? end - t0 : BLOCK;
        nb.step = SIZE_MAX;
        prefetch_next(&nb);   /* what the last block's sets left out (all of block 0) */
        pack_rows_kv(w.K, (const char *)j->k + t0 * rb + head_off, kt, j->row, keys, hd);
        pack_rows_kv(w.V, (const char *)j->v + t0 * rb + head_off, kt, j->row, keys, hd);
        nb.k += BLOCK * rb;
        nb.v += BLOCK * rb;
        nb.rows = end > t0 + BLOCK ? (end - t0 - BLOCK < BLOCK ? end - t0 - BLOCK : BLOCK) : 0;
        nb.t = nb.off = 0;
        nb.step = dd_div_up(nb.rows * dd_div_up(hd, 16), dd_div_up(rows - first, SET) * dd_div_up(keys, PV_KEYS));
        for (size_t r = first; r < rows; r += SET)
            prefill_set(j, rows, pos0, t0, r, &w, &nb);
    }
    for (size_t r = 0; r < rows; r++) {
        const size_t i = i0 + r / G, head = kvh * G + r % G;
        finish_row(w.A + r * hd, w.ML[2 * r + 1], j->gate + (i * j->n_head + head) * hd, hd,
                   j->out + (i * j->n_head + head) * hd);
    }
    free(w.A);
    free(w.Q);
}

/* Query positions per job: the largest of 64, 32, 16 that keeps a job within 256 rows (its running
 * sums and q copy stay in L2 beside the block) and gives every thread 3 jobs or more; 16 at least.
 * A larger tile reads each block of k and v once for more rows; the bits do not depend on it. */
static size_t tile_positions(size_t n, size_t n_kv, size_t group)
{
    const size_t jobs = 3 * (size_t)dd_get_threads();
    size_t tile = 64;
    while (tile > 16 && (tile * group > 256 || n_kv * dd_div_up(n, tile) < jobs))
        tile /= 2;
    return tile;
}

int ATTN_FN(attn_prefill_kv)(size_t n_head, size_t n_kv, size_t hd, size_t n, const float *q, const float *gate,
                             int kv_type, const void *k, const void *v, size_t m, float *out)
{
    const size_t tile = tile_positions(n, n_kv, n_head / n_kv);
    prefill_job j = { .n_head = n_head, .n_kv = n_kv, .hd = hd, .group = n_head / n_kv, .m = m, .n = n,
                      .row = n_kv * hd, .tile = tile, .n_tiles = dd_div_up(n, tile), .q = q, .gate = gate, .k = k,
                      .v = v, .kv_type = kv_type, .out = out, .scale = (float)(1.0 / sqrt((double)hd)),
                      .failed = 0 };
    dd_pool_for(prefill_tile, &j, n_kv * j.n_tiles);
    return j.failed ? DD_ERR_NOMEM : DD_OK;
}

int ATTN_FN(attn_prefill)(size_t n_head, size_t n_kv, size_t hd, size_t n, const float *q, const float *gate,
                          const float *k, const float *v, size_t m, float *out)
{
    return ATTN_FN(attn_prefill_kv)(n_head, n_kv, hd, n, q, gate, DD_KV_F32, k, v, m, out);
}
