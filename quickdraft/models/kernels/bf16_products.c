/* bfloat16 products for `--dtype bfloat16` on the CPU (AVX512_BF16: AMD Zen 4, Intel
 * Cooper Lake / Sapphire Rapids): y [M, N] = bf16(x) [M, K] @ w.T, w bfloat16 [N, K],
 * K % 32 == 0.
 *
 * x is rounded to bfloat16 first (vcvtneps2bf16: round to nearest even, as PyTorch's
 * x.to(torch.bfloat16) does), then each 32 inputs of a weight row take one vdpbf16ps: 16
 * float32 lanes, each adding two exact products (a bfloat16 times a bfloat16 fits a
 * float32). The float32 path widens the weights and multiplies float32 activations, 2 FMAs
 * per 32 inputs and row; this is one instruction, so a verify pass of several rows, whose
 * products are bound by arithmetic on this CPU, costs less. Measured on the 2-core Zen 4
 * EPYC here: the embedded target's 33 products of a pass alone (standalone C, weights
 * streamed) 0.67x the time at 9 rows, 0.60x at 13, the same at 1-5 (bound by memory);
 * whole passes (scripts/step_ab.py products) 0.81-0.82x at 9 tokens after 300, 0.88-0.93x
 * after 1,100 (attention, float32, weighs more), 1.01-1.05x at one token.
 *
 * Same rounding whatever the row count: output (m, n) has two accumulators, the 32-input
 * chunks of K going to them in turn (two chains in flight for a one-row step), then sum16
 * of their sum; x's rounding is per element. So a row of a k+1-row verify pass rounds as a
 * one-row step does (lossless speculative decoding), whatever pass it falls in. There is
 * no AVX2 twin: where the CPU lacks AVX512_BF16 the model computes in PyTorch's bfloat16
 * (models/loading.py), not with these products.
 */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#endif

#include "qmatmul.h"

#include <stdlib.h>

/* Rows of x a pass over one weight row takes (2 x 12 accumulators), and how many weight
 * rows ahead it prefetches. (Tiles of 2-4 weight rows were 1.3x slower at 1-5 rows: more
 * weight streams a thread.) */
#define BF16DP_ROWS 12
#define BF16DP_AHEAD 2

/* Weight row w against rows 0 .. rows - 1 of xb into y[r * ldy]; `ahead` (NULL: none) is
 * a later weight row, prefetched a line per chunk. Always inlined with a constant `rows`:
 * each row count its own specialization. */
static inline __attribute__((always_inline)) void bf16dp_pass(const uint16_t *w, const uint16_t *ahead,
                                                               const uint16_t *xb, int64_t K, int rows, float *y,
                                                               int64_t ldy) {
    __m512 acc[BF16DP_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) { /* chunks in pairs: each accumulator stays a register */
        if (ahead) {
            _mm_prefetch((const char *)(ahead + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(ahead + k + 32), _MM_HINT_T0);
        }
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
        for (int r = 0; r < rows; r++)
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, (__m512bh)_mm512_loadu_si512(xb + r * K + k));
        for (int r = 0; r < rows; r++)
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, (__m512bh)_mm512_loadu_si512(xb + r * K + k + 32));
    }
    if (k < K) { /* an odd last chunk: accumulator 0's turn */
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
        for (int r = 0; r < rows; r++)
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, (__m512bh)_mm512_loadu_si512(xb + r * K + k));
    }
    for (int r = 0; r < rows; r++) y[r * ldy] = sum16(_mm512_add_ps(acc[r][0], acc[r][1]));
}

/* x [M, K] float32, w [N, K] bfloat16 -> y [M, N] (see the header). */
void qd_bf16dp_matmul(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y, int threads) {
    uint16_t *xb = malloc((size_t)(M * K) * sizeof(uint16_t));
    for (int64_t i = 0; i < M * K; i += 16)
        _mm256_storeu_si256((__m256i *)(xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *ahead = n + BF16DP_AHEAD < N ? w + (n + BF16DP_AHEAD) * K : NULL;
        for (int64_t m = 0; m < M; m += BF16DP_ROWS, ahead = NULL) {
            const uint16_t *xm = xb + m * K;
            float *ym = y + m * N + n;
#define ROW_CASE(rows) \
    case rows: bf16dp_pass(w + n * K, ahead, xm, K, rows, ym, N); break;
            switch (M - m < BF16DP_ROWS ? M - m : BF16DP_ROWS) {
                ROW_CASE(1) ROW_CASE(2) ROW_CASE(3) ROW_CASE(4) ROW_CASE(5) ROW_CASE(6)
                ROW_CASE(7) ROW_CASE(8) ROW_CASE(9) ROW_CASE(10) ROW_CASE(11) ROW_CASE(12)
            }
#undef ROW_CASE
        }
    }
    free(xb);
}

int qd_bf16dp_supported(void) {
    static int supported = -1;
    if (supported < 0) {
        __builtin_cpu_init();
        supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    }
    return supported;
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
