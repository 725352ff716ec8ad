/* int8 products for drafters with AVX-512 VNNI: y [M, N] = x [M, K] @ (scale[n] * q[n]).T,
 * int8 weights with one scale per output row (channel), x quantized to 8 bits per group of
 * 32 (q8a8.h's quantizer), K % 32 == 0.
 *
 * Not for a target: it rounds otherwise than qmatmul's int8 path (the channel's scale is
 * applied once, after the sum, where that path scales every group), and it has no AVX2
 * twin. A drafter's rounding changes only what it proposes, never what the target accepts.
 * It does less work a group: x is offset once to unsigned bytes (xq + 128) and shared by
 * every weight row, so a weight vector takes two vpdpbusd (x against w, and 128 against w,
 * the offset's share, subtracted: the exact integer sum) where the sign trick took an
 * absolute value, a mask and a masked negation of x per weight vector, and no scale is
 * built per group. Four weight rows at a time keep four accumulator chains in flight.
 * The embedded target's EAGLE drafter, one step's six products, one row, weights in the
 * L3 cache, two threads (a standalone C measurement): ~41 us against qmatmul's ~69 us.
 *
 * Each output is one accumulator's sum: the same operations in the same order whatever M,
 * so a row's result does not depend on the rows beside it.
 */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#endif

#include "qmatmul.h"

#include <stdlib.h>

#include "q8a8.h"

/* Weight rows and rows of x a tile takes (4 x 4 accumulators). */
#define Q8C_TILE 4

static inline float sum_lanes(__m512 acc) { return _mm512_reduce_add_ps(acc); }

/* Weight rows 0 .. nb - 1 of w against rows 0 .. rows - 1 of xu (offset bytes, row stride K)
 * and dx16 (each pair of groups' scales as [dx_g x 8 | dx_g+1 x 8], row stride pairs * 16):
 * y[r * ldy + b] = scale[b] * the row's sum. nb and rows are constants where inlined. */
static inline __attribute__((always_inline)) void q8c_tile(const int8_t *w, int nb, const float *scale, int64_t K,
                                                            const uint8_t *xu, const float *dx16, int rows,
                                                            float *y, int64_t ldy) {
    const int64_t groups = K / GROUP, pairs = (groups + 1) / 2;
    const __m512i zero = _mm512_setzero_si512(), offset = _mm512_set1_epi8((char)0x80);
    __m512 acc[Q8C_TILE][Q8C_TILE];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        /* an odd last group: its 32 bytes alone, the other half zero (adds nothing) */
        const __mmask64 bytes = 2 * p + 1 < groups ? ~0ULL : 0xFFFFFFFFULL;
        __m512i wv[Q8C_TILE], shift[Q8C_TILE];
        for (int b = 0; b < nb; b++) {
            wv[b] = _mm512_maskz_loadu_epi8(bytes, w + b * K + 2 * p * GROUP);
            shift[b] = _mm512_dpbusd_epi32(zero, offset, wv[b]); /* 128 * the lanes' weight sums */
        }
        for (int r = 0; r < rows; r++) {
            const __m512i xv = _mm512_maskz_loadu_epi8(bytes, xu + r * K + 2 * p * GROUP);
            const __m512 dx = _mm512_loadu_ps(dx16 + (r * pairs + p) * 16);
            for (int b = 0; b < nb; b++) {
                const __m512i isum = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, xv, wv[b]), shift[b]);
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dx, acc[r][b]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) y[r * ldy + b] = scale[b] * sum_lanes(acc[r][b]);
}

/* All rows of x against weight rows 0 .. nb - 1 (nb a constant), Q8C_TILE rows at a time. */
static inline __attribute__((always_inline)) void q8c_columns(const int8_t *w, int nb, const float *scale, int64_t K,
                                                               const uint8_t *xu, const float *dx16, int64_t M,
                                                               float *y, int64_t N) {
    const int64_t pairs = (K / GROUP + 1) / 2;
    for (int64_t m = 0; m < M; m += Q8C_TILE) {
        const uint8_t *xm = xu + m * K;
        const float *dm = dx16 + m * pairs * 16;
        switch (M - m < Q8C_TILE ? M - m : Q8C_TILE) {
        case 1: q8c_tile(w, nb, scale, K, xm, dm, 1, y + m * N, N); break;
        case 2: q8c_tile(w, nb, scale, K, xm, dm, 2, y + m * N, N); break;
        case 3: q8c_tile(w, nb, scale, K, xm, dm, 3, y + m * N, N); break;
        default: q8c_tile(w, nb, scale, K, xm, dm, 4, y + m * N, N); break;
        }
    }
}

void qd_q8c_matmul(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N, float *y,
                   int threads) {
    const int64_t groups = K / GROUP, pairs = (groups + 1) / 2;
    const QInput in = q_input(x, M, K, 0, threads);
    const int8_t *xq = in.xq;
    const float *dx = in.dx;
    float *dx16 = malloc((size_t)(M * pairs * 16) * sizeof(float));
    uint8_t *xu = (uint8_t *)in.xq; /* in place: xq + 128 as unsigned bytes (xq is in -127..127) */
    for (int64_t i = 0; i < M * K; i++)
        xu[i] = (uint8_t)(xq[i] + 128);
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < 2 * pairs; g++)
            _mm256_storeu_ps(dx16 + (r * pairs + g / 2) * 16 + (g % 2) * 8,
                             _mm256_set1_ps(g < groups ? dx[r * groups + g] : 0.0f));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n += Q8C_TILE) {
        const int8_t *w = q + n * K;
        switch (N - n < Q8C_TILE ? N - n : Q8C_TILE) {
        case 1: q8c_columns(w, 1, scale + n, K, xu, dx16, M, y + n, N); break;
        case 2: q8c_columns(w, 2, scale + n, K, xu, dx16, M, y + n, N); break;
        case 3: q8c_columns(w, 3, scale + n, K, xu, dx16, M, y + n, N); break;
        default: q8c_columns(w, 4, scale + n, K, xu, dx16, M, y + n, N); break;
        }
    }
    q_input_free(in);
    free(dx16);
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
