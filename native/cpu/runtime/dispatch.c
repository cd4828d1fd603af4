/* ISA detection, quantization and the activations' preparation (runtime.h), and the memory read; the
 * products that read the activations are matvec.c's. */
#include <stdatomic.h>
#include <stdlib.h>

#include "runtime.h"

int dd_isa_supported(int isa)
{
    switch (isa) {
    case DD_ISA_SCALAR:
        return 1;
#ifdef DD_X86_ISAS
    case DD_ISA_SSSE3:
        __builtin_cpu_init();
        return __builtin_cpu_supports("ssse3") != 0;
    case DD_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case DD_ISA_AVX512VNNI:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
    default:
        return 0;
    }
}

/* The AVX-512 IQ GEMV's VBMI path (iquants_avx512.h): -1 until set, then 0 or 1. */
static _Atomic int iq_vbmi = -1;

static int iq_vbmi_supported(void)
{
#ifdef DD_X86_ISAS
    __builtin_cpu_init();
    return dd_isa_supported(DD_ISA_AVX512VNNI) && __builtin_cpu_supports("avx512vbmi") &&
           __builtin_cpu_supports("avx512bitalg") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

int dd_set_iq_vbmi(int on)
{
    if (on && !iq_vbmi_supported())
        return DD_ERR_ISA;
    atomic_store(&iq_vbmi, on != 0);
    return DD_OK;
}

int dd_iq_vbmi(void)
{
    int on = atomic_load_explicit(&iq_vbmi, memory_order_relaxed);
    if (on < 0) {
        int unset = -1;
        atomic_compare_exchange_strong(&iq_vbmi, &unset, iq_vbmi_supported());
        on = atomic_load(&iq_vbmi);
    }
    return on;
}

int dd_isa_best(void)
{
    int best = DD_ISA_SCALAR;
    for (int isa = DD_ISA_SCALAR + 1; isa < DD_ISA_COUNT; isa++)
        if (dd_isa_supported(isa))
            best = isa;
    return best;
}

const dd_kernels *dd_kernels_for(int isa)
{
    if (!dd_isa_supported(isa))
        return NULL;
    switch (isa) {
#ifdef DD_X86_ISAS
    case DD_ISA_SSSE3:
        return &dd_kernels_ssse3;
    case DD_ISA_AVX2:
        return &dd_kernels_avx2;
    case DD_ISA_AVX512VNNI:
        return &dd_kernels_avx512vnni;
#endif
    default:
        return &dd_kernels_scalar;
    }
}

int dd_quantize_q8_0(int isa, const float *x, size_t m, size_t k, uint8_t *out)
{
    const dd_kernels *kt = dd_kernels_for(isa);
    if (kt == NULL)
        return DD_ERR_ISA;
    if (k % DD_QK != 0)
        return DD_ERR_ARG;
    for (size_t c = 0; c < m; c++)
        kt->quantize_q8_0(x + c * k, k / DD_QK, out + c * (k / DD_QK) * DD_Q8_0_BYTES);
    return DD_OK;
}

static void *take(uint8_t **next, size_t bytes)
{
    void *p = *next;
    *next += (bytes + 63) & ~(size_t)63;
    return p;
}

/* Block b of column c in the group layout (see dd_acts), from its Q8_0 values, their sum and scale. */
static void put_group_block(dd_acts *a, size_t c, size_t b, const int8_t *v, int32_t sum, float scale)
{
    const size_t g = b / 16, i = b % 16, base = c * a->ng + g, quad = i / 4, lane = 4 * (i % 4) + quad;
    if (a->m == 1) {
        int8_t *gq = (int8_t *)a->gq + (base * 8 + 2 * quad) * 64 + 16 * (i % 4);
        memcpy(gq, v, 16);
        memcpy(gq + 64, v + 16, 16);
    } else {
        for (size_t t = 0; t < 4; t++)
            for (size_t h = 0; h < 2; h++)
                memcpy((int8_t *)a->gq + (base * 8 + 2 * t + h) * 64 + 4 * lane, v + 16 * h + 4 * t, 4);
    }
    ((int32_t *)a->gbias)[base * 16 + lane] = -8 * sum;
    ((float *)a->gd)[base * 16 + lane] = scale;
}

/* Block i (= c * nbp + b) of the pair and compact layouts (see dd_acts), from its int8 values already
 * in a->q and its scale; bias is written for the ntypes weight types listed in types (those whose
 * bias_mult is not 0), so the per-lane work does not test every type. */
static void put_pair_block(const dd_kernels *kt, dd_acts *a, size_t i, float scale, const int *types, int ntypes)
{
    const int8_t *q = a->q + i * DD_QK;
    int32_t s[8], *s16 = (int32_t *)a->s16 + 2 * i;
    for (int l = 0; l < 8; l++)
        s[l] = q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3];
    s16[0] = (s[0] + s[1]) + (s[2] + s[3]);
    s16[1] = (s[4] + s[5]) + (s[6] + s[7]);
    for (int n = 0; n < ntypes; n++)
        for (int l = 0; l < 8; l++)
            ((int32_t *)a->bias[types[n]])[i * 8 + l] = kt->bias_mult[types[n]] * s[l];
    ((float *)a->bd)[i] = scale;
    ((int32_t *)a->bs)[i] = s16[0] + s16[1];
}

size_t dd_acts_bytes(const dd_kernels *kt, size_t m, size_t k)
{
    const size_t nb = k / DD_QK, nbp = (nb + 1) & ~(size_t)1, lanes = m * nbp * 8;
    const size_t ng = kt->q4_0_groups ? (nb + 15) / 16 : 0;
    const size_t pad = 63;
    size_t total = ((m * nb * DD_Q8_0_BYTES + pad) & ~pad) + ((m * nbp * DD_QK + pad) & ~pad);
    for (int t = 0; t < DD_WTYPE_COUNT; t++)
        if (kt->bias_mult[t] != 0)
            total += (lanes * 4 + pad) & ~pad;
    return total + m * ng * (8 * 64 + 2 * 16 * 4) + 3 * ((m * nbp * 2 * 4 + pad) & ~pad);
}

static _Atomic uint64_t acts_ids;   /* preparations so far (dd_acts.id) */

/* The layout in mem (64-byte aligned, dd_acts_bytes long): the Q8_0 blocks, then the pair layout,
 * then the groups (zeroed); the columns are filled by acts_column. */
static void acts_place(const dd_kernels *kt, const float *x, size_t m, size_t k, uint8_t *mem, dd_acts *a)
{
    const size_t nb = k / DD_QK, nbp = (nb + 1) & ~(size_t)1, lanes = m * nbp * 8;
    const size_t ng = kt->q4_0_groups ? (nb + 15) / 16 : 0;
    uint8_t *next = mem;
    take(&next, m * nb * DD_Q8_0_BYTES);   /* the Q8_0 blocks, at mem */
    *a = (dd_acts){ .nb = nb, .nbp = nbp, .m = m, .ng = ng, .x = x, .mem = mem,
                    .id = atomic_fetch_add_explicit(&acts_ids, 1, memory_order_relaxed) + 1 };
    a->q = take(&next, m * nbp * DD_QK);
    for (int t = 0; t < DD_WTYPE_COUNT; t++)
        a->bias[t] = kt->bias_mult[t] != 0 ? take(&next, lanes * 4) : NULL;
    a->gq = take(&next, m * ng * 8 * 64);
    a->gbias = take(&next, m * ng * 16 * 4);
    a->gd = take(&next, m * ng * 16 * 4);
    memset((void *)a->gq, 0, (size_t)(next - (uint8_t *)a->gq));
    a->bd = take(&next, m * nbp * 4);
    a->bs = take(&next, m * nbp * 4);
    a->s16 = take(&next, m * nbp * 2 * 4);
}

static int acts_alloc(const dd_kernels *kt, const float *x, size_t m, size_t k, dd_acts *a)
{
    uint8_t *mem = aligned_alloc(64, dd_acts_bytes(kt, m, k));
    if (mem == NULL)
        return DD_ERR_NOMEM;
    acts_place(kt, x, m, k, mem, a);
    return DD_OK;
}

/* Column c of the prepared activations from its k values xc; columns touch disjoint bytes. */
static void acts_column(const dd_kernels *kt, const float *xc, size_t c, dd_acts *a)
{
    const size_t nb = a->nb, nbp = a->nbp;
    uint8_t *cb = (uint8_t *)a->mem + c * nb * DD_Q8_0_BYTES;
    int8_t *q = (int8_t *)a->q;
    int types[DD_WTYPE_COUNT], ntypes = 0;
    for (int t = 0; t < DD_WTYPE_COUNT; t++)
        if (a->bias[t] != NULL)
            types[ntypes++] = t;
    kt->quantize_q8_0(xc, nb, cb);
    for (size_t b = 0; b < nbp; b++) {
        const size_t i = c * nbp + b, qi = i * DD_QK;
        const float scale = b < nb ? dd_f16_to_f32(dd_load_u16(cb + b * DD_Q8_0_BYTES)) : 0.0f;
        if (b < nb)
            memcpy(q + qi, cb + b * DD_Q8_0_BYTES + 2, DD_QK);
        else
            memset(q + qi, 0, DD_QK);
        put_pair_block(kt, a, i, scale, types, ntypes);
        if (a->ng > 0 && b < nb)
            put_group_block(a, c, b, q + qi, ((const int32_t *)a->bs)[i], scale);
    }
}

void dd_acts_prepare(const dd_kernels *kt, const float *x, size_t m, size_t k, void *mem, dd_acts *a)
{
    acts_place(kt, x, m, k, mem, a);
    for (size_t c = 0; c < m; c++)
        acts_column(kt, x + c * k, c, a);
}

int dd_acts_new(const dd_kernels *kt, const float *x, size_t m, size_t k, dd_acts *a)
{
    const int rc = acts_alloc(kt, x, m, k, a);
    for (size_t c = 0; rc == DD_OK && c < m; c++)
        acts_column(kt, x + c * k, c, a);
    return rc;
}

#define ACTS_COLS 8   /* columns per pool chunk when dd_acts_new_pooled prepares many */

typedef struct {
    const dd_kernels *kt;
    const float *x;
    size_t k;
    dd_acts *a;
} acts_job;

static void acts_chunk(void *ctx, size_t chunk)
{
    const acts_job *j = ctx;
    for (size_t c = chunk * ACTS_COLS; c < j->a->m && c < (chunk + 1) * ACTS_COLS; c++)
        acts_column(j->kt, j->x + c * j->k, c, j->a);
}

void dd_acts_prepare_pooled(const dd_kernels *kt, const float *x, size_t m, size_t k, void *mem, dd_acts *a)
{
    acts_place(kt, x, m, k, mem, a);
    acts_job aj = { .kt = kt, .x = x, .k = k, .a = a };   /* the prompt's columns on the pool: same bytes */
    dd_pool_for(acts_chunk, &aj, dd_div_up(m, ACTS_COLS));
}

int dd_acts_new_pooled(const dd_kernels *kt, const float *x, size_t m, size_t k, dd_acts *a)
{
    uint8_t *mem = aligned_alloc(64, dd_acts_bytes(kt, m, k));
    if (mem == NULL)
        return DD_ERR_NOMEM;
    dd_acts_prepare_pooled(kt, x, m, k, mem, a);
    return DD_OK;
}

/* Column s of one of a preparation's regions (`from`) to column c of the same region of another (`to`), `size`
 * bytes a column. */
static void gather_part(const void *from, const void *to, size_t s, size_t c, size_t size)
{
    if (size > 0)
        memcpy((uint8_t *)to + c * size, (const uint8_t *)from + s * size, size);
}

int dd_acts_gather(const dd_kernels *kt, const dd_acts *src, const size_t *cols, size_t m, const float *x, dd_acts *a)
{
    if (m < 2 || src->m < 2)
        return DD_ERR_ARG;
    const size_t nb = src->nb, nbp = src->nbp, ng = src->ng;
    const int rc = acts_alloc(kt, x, m, nb * DD_QK, a);
    for (size_t c = 0; rc == DD_OK && c < m; c++) {
        const size_t s = cols[c];
        gather_part(src->mem, a->mem, s, c, nb * DD_Q8_0_BYTES);
        gather_part(src->q, a->q, s, c, nbp * DD_QK);
        for (int t = 0; t < DD_WTYPE_COUNT; t++)
            if (a->bias[t] != NULL)
                gather_part(src->bias[t], a->bias[t], s, c, nbp * 8 * sizeof(int32_t));
        gather_part(src->gq, a->gq, s, c, ng * 8 * 64);
        gather_part(src->gbias, a->gbias, s, c, ng * 16 * sizeof(int32_t));
        gather_part(src->gd, a->gd, s, c, ng * 16 * sizeof(float));
        gather_part(src->bd, a->bd, s, c, nbp * sizeof(float));
        gather_part(src->bs, a->bs, s, c, nbp * sizeof(int32_t));
        gather_part(src->s16, a->s16, s, c, 2 * nbp * sizeof(int32_t));
    }
    return rc;
}

void dd_acts_free(dd_acts *a)
{
    free(a->mem);
    a->mem = NULL;
}

#define READ_CHUNK_WORDS (1u << 17)

typedef struct {
    const uint64_t *words;
    size_t n;
    size_t runs;
    _Atomic uint64_t total;
} read_job;

/* A chunk's words as `runs` runs of q words (q a multiple of 8), one cache line of each run in turn, then
 * the words after the last run one by one: every word is added once. Word u of a line goes to its own sum
 * s[u], so the adds are not one chain; `runs` is a constant in each copy (read_chunk), as a loop over a
 * variable count costs enough instructions a line that fewer lines are in flight. */
static inline __attribute__((always_inline)) void read_runs(read_job *j, size_t chunk, const size_t runs)
{
    const size_t i0 = chunk * READ_CHUNK_WORDS;
    const size_t i1 = j->n - i0 < READ_CHUNK_WORDS ? j->n : i0 + READ_CHUNK_WORDS;
    const size_t q = (i1 - i0) / runs / 8 * 8;
    const uint64_t *w = j->words + i0;
    uint64_t s[8] = { 0 };
    for (size_t i = 0; i < q; i += 8)
        for (size_t r = 0; r < runs; r++)
            for (size_t u = 0; u < 8; u++)
                s[u] += w[r * q + i + u];
    for (size_t i = i0 + runs * q; i < i1; i++)
        s[0] += j->words[i];
    uint64_t total = 0;
    for (size_t u = 0; u < 8; u++)
        total += s[u];
    atomic_fetch_add_explicit(&j->total, total, memory_order_relaxed);
}

static void read_chunk(void *ctx, size_t chunk)
{
    read_job *j = ctx;
    switch (j->runs) {
    case 1: read_runs(j, chunk, 1); break;
    case 2: read_runs(j, chunk, 2); break;
    case 3: read_runs(j, chunk, 3); break;
    case 4: read_runs(j, chunk, 4); break;
    case 5: read_runs(j, chunk, 5); break;
    case 6: read_runs(j, chunk, 6); break;
    case 7: read_runs(j, chunk, 7); break;
    default: read_runs(j, chunk, 8); break;
    }
}

uint64_t dd_stream_read(const uint8_t *p, size_t n, int runs)
{
    read_job job = { .words = (const uint64_t *)p, .n = n / 8, .runs = runs < 1 ? 1 : runs > 8 ? 8 : (size_t)runs };
    dd_pool_for(read_chunk, &job, dd_div_up(job.n, READ_CHUNK_WORDS));
    return atomic_load(&job.total);
}
