/* int8 weights times 8-bit activations (llama.cpp's Q8_0 x Q8_0 dot product), shared by
 * qmatmul.c (AVX2) and qmatmul_avx512.c (AVX-512 VNNI). The file that includes this first
 * defines
 *   dot4(aw, sx)  8 int32 lanes, lane i = sum_{j<4} aw[4i+j] * sx[4i+j] (aw unsigned bytes,
 *                 sx signed): an exact integer, whichever instructions compute it
 *   Q8A8_ROWS     the most rows of x that share one pass over a weight row
 * and gets q8a8_product(): y [M, N] = x [M, K] @ W.T for int8 W in groups of 32 with a
 * float32 scale each.
 *
 * x is quantized first, per row and group of 32 (q8a8_quantize): d = max|x| / 127,
 * xq = x / d rounded to nearest even, as llama.cpp quantizes activations for Q8_0
 * weights (it stores d in float16; here float32). A group's product is then an exact
 * integer sum, so the products' work per weight is a few integer instructions instead of
 * a conversion and a multiply-add per weight: one-row products become bound by memory,
 * several-row ones need about half the instructions of the float32-activation path.
 *
 * Same rounding whatever the row count, the pass or the instruction set: for output
 * (m, n), group g adds float(isum_g lane i) * (dw_g * dx_g) into lane i of accumulator
 * g % 2 (FMA), and the result is sum8(acc0 + acc1): what lossless verify passes need (a
 * row of a k+1-row pass rounds as a one-row step does). The sign trick (|w| times x with
 * w's sign) keeps every operand of the byte products in range: |w| <= 128, |xq| <= 127.
 */
#ifndef QD_Q8A8_H
#define QD_Q8A8_H

/* Row r of x [M, K] -> xq [M, K] int8 and dx [M, K / 32], group by group. Scalar-exact
 * operations only (max, divide, round, convert), so every instruction set gets the same
 * bytes. */
static void q8a8_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx) {
    for (int64_t i = 0; i < M * K / GROUP; i++) {
        const float *v = x + i * GROUP;
        __m256 amax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int j = 0; j < GROUP; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float d = _mm_cvtss_f32(m4) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        dx[i] = d;
        const __m256 s = _mm256_set1_ps(inv);
        __m256i q[4];
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), s),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* 32 int32 -> 32 int8 in order (packs interleave 128-bit lanes: permute back). */
        const __m256i w16 = _mm256_packs_epi32(q[0], q[1]), z16 = _mm256_packs_epi32(q[2], q[3]);
        const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, z16),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + i * GROUP), b);
    }
}

/* Group g of weight row wq against `rows` rows of the quantized x, into accumulator a. */
static inline __attribute__((always_inline)) void q8a8_group(const int8_t *wq, const float *wd, const int8_t *xq,
                                                              const float *dx, int64_t K, int64_t g, int rows,
                                                              __m256 acc[][2], int a) {
    const int64_t groups = K / GROUP;
    const __m256i w = _mm256_loadu_si256((const __m256i *)(wq + g * GROUP));
    const __m256i aw = _mm256_sign_epi8(w, w);
    const __m256 dw = _mm256_set1_ps(wd[g]);
    for (int r = 0; r < rows; r++) {
        const __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + r * K + g * GROUP)), w);
        const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(dx[r * groups + g]));
        acc[r][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(aw, sx)), d, acc[r][a]);
    }
}

/* Weight row n against rows 0 .. rows - 1 of the quantized x, into y[r * ldy]. Always
 * inlined with a constant `rows`; groups go in pairs so each accumulator is a register. */
static inline __attribute__((always_inline)) void q8a8_pass(const int8_t *wq, const float *wd, const int8_t *xq,
                                                             const float *dx, int64_t K, int rows, float *y,
                                                             int64_t ldy, const int8_t *next) {
    const int64_t groups = K / GROUP;
    __m256 acc[Q8A8_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
        if (next) /* the next weight row, a cache line per two groups (see q8a8_product) */
            _mm_prefetch((const char *)(next + g * GROUP), _MM_HINT_T0);
        q8a8_group(wq, wd, xq, dx, K, g, rows, acc, 0);
        q8a8_group(wq, wd, xq, dx, K, g + 1, rows, acc, 1);
    }
    if (g < groups) {
        if (next)
            _mm_prefetch((const char *)(next + g * GROUP), _MM_HINT_T0);
        q8a8_group(wq, wd, xq, dx, K, g, rows, acc, 0);
    }
    for (int r = 0; r < rows; r++) y[r * ldy] = sum8(_mm256_add_ps(acc[r][0], acc[r][1]));
}

/* y [M, N] = x @ W.T, x float32 [M, K], W int8 q [N, K] with scale [N, K / 32]. */
static void q8a8_product(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N,
                         float *y, int threads) {
    int8_t *xq = malloc((size_t)(M * K));
    float *dx = malloc((size_t)(M * K / GROUP) * sizeof(float));
    q8a8_quantize(x, M, K, xq, dx);
    const int64_t groups = K / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wq = q + n * K;
        const float *wd = scale + n * groups;
        /* Several rows of x: the first pass prefetches the next weight row, which arrives
         * while the passes compute (the hardware prefetcher alone left compute and memory
         * reads in turn; one row is bound by memory either way). */
        const int8_t *next = M > 1 && n + 1 < N ? wq + K : NULL;
        for (int64_t m = 0; m < M; m += Q8A8_ROWS, next = NULL) {
            const int64_t rows = M - m < Q8A8_ROWS ? M - m : Q8A8_ROWS;
            const int8_t *xm = xq + m * K;
            const float *dm = dx + m * groups;
            float *ym = y + m * N + n;
#define Q8A8_CASE(c) \
    case c: q8a8_pass(wq, wd, xm, dm, K, c, ym, N, next); break
            switch (rows) { /* every row count its own specialization */
                Q8A8_CASE(1); Q8A8_CASE(2); Q8A8_CASE(3); Q8A8_CASE(4); Q8A8_CASE(5); Q8A8_CASE(6);
#if Q8A8_ROWS == 12
                Q8A8_CASE(7); Q8A8_CASE(8); Q8A8_CASE(9); Q8A8_CASE(10); Q8A8_CASE(11); Q8A8_CASE(12);
#endif
            }
#undef Q8A8_CASE
        }
    }
    free(xq);
    free(dx);
}

#endif
