/* The IQ types' codebooks (see iquants.h), registered once by the caller and kept in the forms the
 * unpackers read. The grids are data of the formats' definitions (ggml-common.h iq2xxs_grid, iq2xs_grid,
 * iq2s_grid, iq3xxs_grid, iq3s_grid, iq1s_grid); the engine takes them from gguf-py (engine.kernels.cpu)
 * instead of keeping a copy here. */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "iquants.h"

uint64_t dd_iq_pos8[DD_IQ_GRID_BYTES / 8];
uint64_t dd_iq_sign_mask[256];
uint8_t dd_iq_ksigns[128];
uint16_t dd_iq_codes[DD_IQ_CODES];
uint8_t dd_iq_levels[4][16];
static _Atomic int ready[DD_WTYPE_COUNT];

/* Where grid g's entries start in the tables, its entry width, value offset and code table (iquants.h; -1:
 * none, the AVX-512 level loads its rows). Every grid is checked to hold at most 4 (8-wide) or 8 (4-wide)
 * distinct values, as the codes need (the formats' grids have 3 and 8). */
static const struct {
    int wtype;
    size_t entries, width, at;
    int off, table;
} grids[] = {
    { DD_IQ2_XXS, 256, 8, DD_IQ2XXS_AT, DD_IQ2_OFF, 0 },
    { DD_IQ2_XS, 512, 8, DD_IQ2XS_AT, DD_IQ2_OFF, 1 },
    { DD_IQ2_S, 1024, 8, DD_IQ2S_AT, DD_IQ2_OFF, -1 },
    { DD_IQ3_XXS, 256, 4, DD_IQ3XXS_AT, DD_IQ3XXS_OFF, 2 },
    { DD_IQ3_S, 512, 4, DD_IQ3S_AT, DD_IQ3S_OFF, 3 },
    { DD_IQ1_S, 2048, 8, DD_IQ1S_AT, 0, -1 },
};

/* A grid value g as its byte in dd_iq_pos8: 8g + 1 + 9 for IQ1 (the code of a positive delta), off + g others. */
static uint8_t pos_byte(int wtype, int off, int8_t g)
{
    return (uint8_t)(wtype == DD_IQ1_S ? 8 * g + 1 + DD_IQ1_OFF : off + g);
}

/* The distinct bytes pos_byte of a grid, ascending, into lev[16]; their count, or -1 if over max (then not the
 * format's grid: the codes of iquants.h cannot hold it). */
static int grid_levels(int wtype, const int8_t *grid, size_t n, int off, int max, uint8_t *lev)
{
    int nlev = 0;
    for (int u = 0; u < 256; u++) {
        int seen = 0;
        for (size_t i = 0; i < n && !seen; i++)
            seen = pos_byte(wtype, off, grid[i]) == u;
        if (seen && nlev == max)
            return -1;
        if (seen)
            lev[nlev++] = (uint8_t)u;
    }
    return nlev;
}

/* Code table t (iquants.h) of a grid's bytes pos: each value as the index of its level in lev. */
static void set_codes(int t, const uint8_t *pos, size_t entries, size_t width, const uint8_t *lev)
{
    const int bits = width == 8 ? 2 : 3;
    memcpy(dd_iq_levels[t], lev, 16);
    for (size_t e = 0; e < entries; e++) {
        uint16_t c = 0;
        for (size_t j = 0; j < width; j++) {
            int l = 0;
            while (lev[l] != pos[width * e + j])
                l++;
            c |= (uint16_t)(l << (bits * j));
        }
        dd_iq_codes[dd_iq_code_at[t] + e] = c;
    }
}

/* The grid-independent tables: dd_iq_sign_mask and dd_iq_ksigns, written once (kernels of a type registered
 * earlier may be reading them while another type is registered). */
static void set_sign_tables(void)
{
    for (int b = 0; b < 256; b++) {
        uint64_t m = 0;
        for (int j = 0; j < 8; j++)
            if (b >> j & 1)
                m |= (uint64_t)0xff << (8 * j);
        dd_iq_sign_mask[b] = m;
        if (b < 128)
            dd_iq_ksigns[b] = dd_iq_ksign((uint32_t)b);
    }
}

int dd_set_iq_grid(int wtype, const int8_t *grid, size_t n)
{
    static pthread_once_t signs_once = PTHREAD_ONCE_INIT;
    pthread_once(&signs_once, set_sign_tables);
    for (size_t g = 0; g < sizeof grids / sizeof grids[0]; g++) {
        if (grids[g].wtype != wtype)
            continue;
        uint8_t lev[16] = { 0 };
        if (n != grids[g].entries * grids[g].width
            || grid_levels(wtype, grid, n, grids[g].off, grids[g].width == 8 ? 4 : 8, lev) < 0)
            return DD_ERR_ARG;
        uint8_t *pos = (uint8_t *)dd_iq_pos8 + grids[g].at;
        for (size_t i = 0; i < n; i++)
            pos[i] = pos_byte(wtype, grids[g].off, grid[i]);
        if (wtype == DD_IQ1_S)   /* the entries with a negative delta after them: 8g - 1 + 9 */
            for (size_t i = 0; i < n; i++)
                pos[n + i] = (uint8_t)(pos[i] - 2);
        if (grids[g].table >= 0)
            set_codes(grids[g].table, pos, grids[g].entries, grids[g].width, lev);
        atomic_store(&ready[wtype], 1);
        if (wtype == DD_IQ1_S)
            atomic_store(&ready[DD_IQ1_M], 1);
        return DD_OK;
    }
    return DD_ERR_ARG;
}

int dd_iq_ready(int wtype)
{
    return wtype < DD_IQ2_XXS || wtype > DD_IQ1_M || atomic_load(&ready[wtype]);
}
