/* The SSSE3 and AVX2 Q4_0 / Q8_0 tile (included by their kernel files after each defines its quad(w, pf, rb, a,
 * wtype, c0, b, acc, R, C, n): blocks b .. b + n - 1 of R rows against C columns into the f32 lanes b % 16 ..
 * b % 16 + 3 of acc[r][c]): kernels.h's order, four lanes a quad, the 16 lanes of each output reduced by
 * dd_tree16_f32. */
#ifndef DELTADESK_Q4Q8_TILE_H
#define DELTADESK_Q4Q8_TILE_H

DD_INLINE void tile(const uint8_t *w, const uint8_t *pf, size_t rb, const dd_acts *a, int wtype, size_t c0,
                    float *y, size_t ldy, const int R, const int C)
{
    __m128 acc[4][4][4];   /* [j][r][c]: lanes 4j .. 4j + 3 */
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                acc[j][r][c] = _mm_setzero_ps();
    size_t b = 0;
    /* unrolled, so that acc[j] is a register, not an indexed array on the stack */
    for (; b + 16 <= a->nb; b += 16) {
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            quad(w, pf, rb, a, wtype, c0, b + 4 * j, acc[j], R, C, 4);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)   /* the short last group */
        if (b + 4 * j < a->nb) {
            const size_t left = a->nb - b - 4 * j;
            quad(w, pf, rb, a, wtype, c0, b + 4 * j, acc[j], R, C, left < 4 ? (int)left : 4);
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s[DD_Q4Q8_LANES];
            for (int j = 0; j < 4; j++)
                _mm_storeu_ps(s + 4 * j, acc[j][r][c]);
            y[(c0 + c) * ldy + r] = dd_tree16_f32(s);
        }
}

#endif
