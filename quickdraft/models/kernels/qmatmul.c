/* Quantized matrix products for CPU decoding (AVX2 + FMA).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k], x float32 [M, K], w stored quantized in groups of 32
 * along k, each group with float32 parameters:
 *   q8: int8 q [N, K],                      w = q * scale           (GGUF Q8_0, int8 per channel)
 *       x quantized to 8 bits per group of 32 too, as llama.cpp runs Q8_0 (q8a8.h)
 *   f32: float32 w [N, K]                   (DecodeLinear's float32 weights: row-invariant, unlike oneDNN)
 *   bf16, f16: bfloat16 / float16 w [N, K] (float32 weights that are bfloat16 / float16 values, stored in
 *       half the bytes: each widens to its exact float32 value, then the f32 path's arithmetic, bit for bit)
 *   q4: 4-bit q in tiles of 16 weight rows, w = (q - 8) * scale + zero   (GGUF Q4_0 / Q4_1)
 *       x quantized to 8 bits per group of 32 too, as llama.cpp runs Q4_1 (q4a8.h: the
 *       layout, the rule and why)
 *
 * Why not PyTorch's int8/int4 kernels: on AVX2 they run scalar code, 10-30x slower than the
 * float32 product they replace. Decoding reads every weight once per step, so a step is
 * bound by memory bandwidth, and weights at 1 or 0.5 bytes instead of 4 are that much less
 * to read.
 *
 * Exactness: each output element is computed by one thread with the same sequence of
 * operations whatever M is and however the rows are chunked: per group (f32, bf16, f16;
 * q8 in q8a8.h, q4 in q4a8.h), the 32 weights are widened into four 8-lane vectors and
 * accumulated into two per-row accumulators with FMA, then the accumulators are summed in
 * a fixed order.
 * So a row's result never depends on the other rows of the product (a verify pass of k+1
 * rows rounds each row as a one-row step does), nor on the thread count: what lossless
 * speculative decoding needs.
 */
#include "qmatmul.h"

#include <stdlib.h>
#include <string.h>

#include "q4a8.h"
#include "q8a8.h"

/* Rows of x a pass over half a tile takes: two integer sums and an accumulator each. */
#define Q_ROWS 4

/* The 4 bytes at p in all 8 lanes, as one broadcast load (through a general register it
 * was a move and a shuffle per row and half-group: qmatmul_avx512.c's bytes4_x16). */
static inline __m256i bytes4_x8(const void *p) {
    int32_t word;
    memcpy(&word, p, sizeof word);
    return _mm256_set1_epi32(word);
}

/* Unit u of an int8 or int4 product on AVX2, half a tile of 16 weight rows: its tile t,
 * which half h, its first output row, and how many of its 8 lanes are rows of W (<= 0:
 * none, past N). */
static inline int half_span(int64_t u, int64_t N, int64_t *t, int64_t *h, int64_t *first) {
    *t = u / 2, *h = u % 2, *first = Q_TILE * *t + 8 * *h;
    return N - *first < 8 ? (int)(N - *first) : 8;
}

/* Lanes 8h .. 8h + 7 of an int8 tile (weight rows 16t + 8h ..; `tile` and `scale` point at
 * that half's weights, q + 128 as unsigned bytes, and scales in tile t's group 0: q8a8.h)
 * against rows m .. m + rows - 1 of the quantized x, q8a8.h's rule 8 lanes at a time: |q| times xq with q's sign (maddubs + madd) gives each
 * lane the sum one VNNI instruction gives. The first `live` lanes go to y[r * ldy + i].
 * Constant `rows`. */
static inline __attribute__((always_inline)) void q8_half(const uint8_t *tile, const uint8_t *scale, const int8_t *xq,
                                                           const float *dx, int64_t m, int64_t K, int rows, float *y,
                                                           int64_t ldy, int live) {
    const int64_t G = K / GROUP;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80); /* q + 128 -> q */
    __m256 acc[Q_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i sum0[Q_ROWS], sum1[Q_ROWS];
        for (int r = 0; r < rows; r++) sum0[r] = sum1[r] = _mm256_setzero_si256();
        for (int h = 0; h < 8; h += 2) {
            const uint8_t *w = tile + g * Q8_BLOCK_BYTES + 64 * h;
            const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)w), flip);
            const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 64)), flip);
            const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);
            for (int r = 0; r < rows; r++) {
                const int8_t *x4 = xq + (m + r) * K + g * GROUP + 4 * h; /* x's bytes 4h .. 4h + 7 */
                const __m256i s0 = _mm256_sign_epi8(bytes4_x8(x4), w0);
                const __m256i s1 = _mm256_sign_epi8(bytes4_x8(x4 + 4), w1);
                sum0[r] = _mm256_add_epi32(sum0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, s0), ones));
                sum1[r] = _mm256_add_epi32(sum1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, s1), ones));
            }
        }
        const __m256 s = _mm256_loadu_ps((const float *)(scale + g * Q8_BLOCK_BYTES));
        for (int r = 0; r < rows; r++) {
            const __m256 i = _mm256_cvtepi32_ps(_mm256_add_epi32(sum0[r], sum1[r]));
            acc[r] = _mm256_fmadd_ps(i, _mm256_mul_ps(s, _mm256_set1_ps(dx[(m + r) * G + g])), acc[r]);
        }
    }
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < rows; r++) _mm256_maskstore_ps(y + r * ldy, lanes, acc[r]);
}

/* Rows of x that share one pass over a weight row, with two accumulators each: 12 of the 16
 * ymm registers, the other 4 hold the group's dequantized weights. Measured on a 2-core AMD
 * EPYC against 4 rows x 4 accumulators, 8 x 2 and 8 or 12 x 1: one row as fast, nine rows
 * ~10-25% faster (one accumulator would leave a one-row product latency-bound). The rows
 * left over (M % 6) go in one more pass, its row count a constant too: 3 rows cost 1.45x
 * one row, where 2 + 1 passes cost 1.75x (weights streamed from memory, 1536 x 576 int4). */
#define ROWS 6
#define ACCS 2

static inline float finish(const __m256 a[ACCS]) { return sum8(_mm256_add_ps(a[0], a[1])); }

static inline void accumulate(const __m256 w[4], const float *x, __m256 acc[ACCS]) {
    for (int j = 0; j < 4; j++) acc[j % ACCS] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + 8 * j), acc[j % ACCS]);
}

static inline void f32_weights(const Weights *w, int64_t n, int64_t K, int64_t g, __m256 out[4]) {
    const float *row = (const float *)w->q + n * K + g * GROUP;
    for (int j = 0; j < 4; j++) out[j] = _mm256_loadu_ps(row + 8 * j);
}

/* bfloat16 -> float32 is exact: the 16 bits are a float32's upper half. */
static inline void bf16_weights(const Weights *w, int64_t n, int64_t K, int64_t g, __m256 out[4]) {
    const uint16_t *row = (const uint16_t *)w->q + n * K + g * GROUP;
    for (int j = 0; j < 4; j++)
        out[j] = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 8 * j))), 16));
}
static inline void f16_weights(const Weights *w, int64_t n, int64_t K, int64_t g, __m256 out[4]) {
    const uint16_t *row = (const uint16_t *)w->q + n * K + g * GROUP;
    for (int j = 0; j < 4; j++) out[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 8 * j)));
}
typedef void (*GroupFn)(const Weights *, int64_t, int64_t, int64_t, __m256[4]);

/* Weight row n against `rows` (<= ROWS) rows of x. Always inlined with constant `rows` and
 * `group`, so each row count is its own specialization and the group load is inlined. */
static inline __attribute__((always_inline)) void row_pass(GroupFn group, const Weights *w, int64_t n,
                                                            const float *x, int64_t K, int rows,
                                                            float *y, int64_t ldy) {
    __m256 acc[ROWS][ACCS];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < ACCS; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m256 wg[4];
        group(w, n, K, g, wg);
        for (int r = 0; r < rows; r++) accumulate(wg, x + r * K + g * GROUP, acc[r]);
    }
    for (int r = 0; r < rows; r++) y[r * ldy] = finish(acc[r]);
}

/* Column n of y [M, N] = x [M, K] @ W.T: all M rows against weight row n. */
static inline __attribute__((always_inline)) void column(GroupFn group, const Weights *w, int64_t n,
                                                          const float *x, int64_t M, int64_t K, int64_t N,
                                                          float *y) {
    int64_t m = 0;
    for (; m + ROWS <= M; m += ROWS) row_pass(group, w, n, x + m * K, K, ROWS, y + m * N + n, N);
    switch (M - m) { /* the rest in one pass: every row count is its own specialization */
    case 5: row_pass(group, w, n, x + m * K, K, 5, y + m * N + n, N); break;
    case 4: row_pass(group, w, n, x + m * K, K, 4, y + m * N + n, N); break;
    case 3: row_pass(group, w, n, x + m * K, K, 3, y + m * N + n, N); break;
    case 2: row_pass(group, w, n, x + m * K, K, 2, y + m * N + n, N); break;
    case 1: row_pass(group, w, n, x + m * K, K, 1, y + m * N + n, N); break;
    }
}

/* Which int4 product runs: 1 = the AVX-512 file's where the CPU has AVX512F, 0 = this one.
 * Chosen once (first call), or by qd_kernel_isa; both round alike: only the speed changes. */
static int avx512 = -1;

/* Ask for the AVX-512 products (want = 1) or the AVX2 ones (0), or leave the choice as it
 * is (-1); returns what runs now. AVX-512 only where the CPU has it. */
int qd_kernel_isa(int want) {
    if (want >= 0 || avx512 < 0)
        avx512 = (want != 0) && qd_avx512_supported();
    return avx512;
}

/* The parallel loops name their group function inside the region, where it is a constant
 * the compiler inlines (passed in, it would be an indirect call per group). */

/* x [M, K] float32 (quantized to 8 bits per group of 32 on the way), q: int8 blocks
 * [T][K / 32][Q8_BLOCK_BYTES] (q8a8.h, as cpu_kernels.pack_q8 lays them out) -> y [M, N]. */
void qd_q8_matmul(const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t N, float *y, int threads) {
    if (qd_kernel_isa(-1) && qd_vnni_supported()) {
        qd_q8_matmul_vnni(x, M, K, q, N, y, threads);
        return;
    }
    const int64_t G = K / GROUP, halves = 2 * ((N + Q_TILE - 1) / Q_TILE);
    const QInput in = q_input(x, M, K, 0, threads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < halves; u++) {
        int64_t t, h, first;
        const int live = half_span(u, N, &t, &h, &first);
        if (live <= 0)
            continue;
        const uint8_t *tile = q + t * G * Q8_BLOCK_BYTES + 32 * h; /* lanes 8h ..: bytes 32h .. of a chunk */
        const uint8_t *s = q + t * G * Q8_BLOCK_BYTES + Q8_TILE_BYTES + 32 * h; /* their 8 float32 scales */
        for (int64_t m = 0; m < M; m += Q_ROWS) {
#define Q8_CASE(r) \
    case r: q8_half(tile, s, in.xq, in.dx, m, K, r, y + m * N + first, N, live); break
            switch (M - m < Q_ROWS ? M - m : Q_ROWS) { Q8_CASE(1); Q8_CASE(2); Q8_CASE(3); Q8_CASE(4); }
#undef Q8_CASE
        }
    }
    q_input_free(in);
}

/* Rows [0, rows) of x against weight rows [0, nb) of w (float32), y[r * ldy + b]: each
 * element with the row pass's own sequence (lane chunk j of a group into accumulator j % 2,
 * groups in order, then the fixed sum), so it rounds exactly as row_pass does; sharing each
 * x load between two weight rows makes a 9-row product ~1.4x faster with the weights in
 * cache (1216 x 448: 110 -> 77 us, oneDNN's 75), ~5% streamed from memory. rows <= 3,
 * nb <= 2, constants. */
static inline __attribute__((always_inline)) void f32_tile(const float *x, int64_t K, const float *w, int rows,
                                                            int nb, float *y, int64_t ldy, const float *next) {
    __m256 acc[3][2][ACCS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++)
            for (int j = 0; j < ACCS; j++) acc[r][b][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8 * ACCS) {
        if (next) { /* the next tile's weights, one cache line a row per 16 floats (see f32_columns) */
            _mm_prefetch((const char *)(next + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(next + K + k), _MM_HINT_T0);
        }
        for (int j = 0; j < ACCS; j++) {
            __m256 wv[2];
            for (int b = 0; b < nb; b++) wv[b] = _mm256_loadu_ps(w + b * K + k + 8 * j);
            for (int r = 0; r < rows; r++) {
                const __m256 xv = _mm256_loadu_ps(x + r * K + k + 8 * j);
                for (int b = 0; b < nb; b++) acc[r][b][j] = _mm256_fmadd_ps(wv[b], xv, acc[r][b][j]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) y[r * ldy + b] = finish(acc[r][b]);
}

/* All M rows against weight rows w (nb of them), 3 rows of x a tile. The first tile also
 * prefetches the next two weight rows (`next`, NULL at the end): with many rows a tile
 * computes long enough for them to arrive, where the hardware prefetcher alone left
 * compute and memory reads in turn (17 rows over the embedded target's 92 MB of
 * weights: 11 ms, the sum of its compute and streaming times). */
static inline __attribute__((always_inline)) void f32_columns(const float *x, int64_t M, int64_t K,
                                                               const float *w, int nb, float *y, int64_t N,
                                                               const float *next) {
    int64_t m = 0;
    for (; m + 3 <= M; m += 3, next = NULL) f32_tile(x + m * K, K, w, 3, nb, y + m * N, N, next);
    if (M - m == 2) f32_tile(x + m * K, K, w, 2, nb, y + m * N, N, next);
    else if (M - m == 1) f32_tile(x + m * K, K, w, 1, nb, y + m * N, N, next);
}

/* x [M, K] float32, w [N, K] float32 -> y [M, N]. K % 32 == 0. Up to 7 rows go through the
 * row pass, more take weight rows two at a time; both round every element alike (tests:
 * bit-identical, any M). Measured with weights streamed from memory as in a decode step
 * (60 matrices of the embedded target's shapes, 2 threads): the row pass is 1.2-1.7x faster
 * for 2-7 rows (the two-row tiles' interleaved weight streams read slowly), the tiles ~5%
 * faster for 9. Where the CPU has AVX-512, 4-16 rows take its prefetching row pass and
 * 17 or more its 4 x 4 tiles (qmatmul_avx512.c: 0.72-0.94x the time at 4-16 rows, the
 * tiles 0.79-0.90x at 8-25 before the pass; 1-3 rows stay here, as fast or faster). */
void qd_f32_matmul(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int threads) {
    const Weights weights = {w};
    if (M >= 4 && qd_kernel_isa(-1)) { /* AVX-512, same bits */
        if (M <= 16) qd_f32_rows_avx512(x, M, K, w, N, y, threads);
        else qd_f32_matmul_avx512(x, M, K, w, N, y, threads);
        return;
    }
    if (M < 8) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t n = 0; n < N; n++) column(f32_weights, &weights, n, x, M, K, N, y);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n += 2) {
        const float *next = n + 4 <= N ? w + (n + 2) * K : NULL;
        if (n + 2 <= N) f32_columns(x, M, K, w + n * K, 2, y + n, N, next);
        else f32_columns(x, M, K, w + n * K, 1, y + n, N, NULL);
    }
}

/* x [M, K] float32, w [N, K] bfloat16 (qd_bf16_matmul) or float16 (qd_f16_matmul) -> y
 * [M, N], K % 32 == 0: qd_f32_matmul's result for the widened weights, bit for bit,
 * reading half the bytes. AVX-512: qmatmul_avx512.c's pass and tiles; AVX2: the row pass. */
#define DEFINE_HALF_MATMUL(name, avx512_name, group) \
    void name(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y, int threads) { \
        if (qd_kernel_isa(-1)) { \
            avx512_name(x, M, K, w, N, y, threads); \
            return; \
        } \
        const Weights weights = {w}; \
        _Pragma("omp parallel for schedule(static) num_threads(threads)") \
        for (int64_t n = 0; n < N; n++) column(group, &weights, n, x, M, K, N, y); \
    }
DEFINE_HALF_MATMUL(qd_bf16_matmul, qd_bf16_matmul_avx512, bf16_weights)
DEFINE_HALF_MATMUL(qd_f16_matmul, qd_f16_matmul_avx512, f16_weights)
#undef DEFINE_HALF_MATMUL


/* Lanes 8h .. 8h + 7 of a tile (weight rows 16t + 8h ..; `tile` and `side` point at that
 * half's nibbles and scales in tile t's group 0) against rows 0 .. rows - 1 of the quantized x,
 * q4a8.h's rule 8 lanes at a time: maddubs + madd give each lane the sum that one VNNI
 * instruction gives. The first `live` lanes go to y[r * ldy + i]. Constant `rows`. */
static inline __attribute__((always_inline)) void q4_half(const uint8_t *tile, const uint8_t *side,
                                                           const QInput *in, int64_t m, int64_t K, int rows,
                                                           float *y, int64_t ldy, int live) {
    const int64_t G = K / GROUP;
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[Q_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i sum0[Q_ROWS], sum1[Q_ROWS];
        for (int r = 0; r < rows; r++) sum0[r] = sum1[r] = _mm256_setzero_si256();
        for (int h = 0; h < 4; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(tile + g * Q4_BLOCK_BYTES + 64 * h));
            const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            for (int r = 0; r < rows; r++) {
                const int8_t *x8 = in->xq + (m + r) * K + g * GROUP + 8 * h; /* x's bytes 8h .. 8h + 7 */
                sum0[r] = _mm256_add_epi32(sum0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, bytes4_x8(x8)), ones));
                sum1[r] = _mm256_add_epi32(sum1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, bytes4_x8(x8 + 4)), ones));
            }
        }
        const uint8_t *sc = side + g * Q4_BLOCK_BYTES;
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc)),
                     c = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + Q4_SIDE_BYTES)));
        for (int r = 0; r < rows; r++) {
            const __m256 i = _mm256_cvtepi32_ps(_mm256_add_epi32(sum0[r], sum1[r]));
            acc[r] = _mm256_fmadd_ps(i, _mm256_mul_ps(s, _mm256_set1_ps(in->dx[(m + r) * G + g])), acc[r]);
            acc[r] = _mm256_fmadd_ps(c, _mm256_set1_ps(in->sx[(m + r) * G + g]), acc[r]);
        }
    }
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < rows; r++) _mm256_maskstore_ps(y + r * ldy, lanes, acc[r]);
}

/* x [M, K] float32 (quantized to 8 bits per group of 32 on the way), q: int4 blocks
 * [T][K / 32][Q4_BLOCK_BYTES] (q4a8.h, as cpu_kernels.pack_q4 lays them out) -> y [M, N]. */
void qd_q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t N, float *y, int threads) {
    if (qd_kernel_isa(-1) && qd_vnni_supported()) {
        qd_q4_matmul_vnni(x, M, K, q, N, y, threads);
        return;
    }
    const QInput in = q_input(x, M, K, 1, threads);
    const int64_t G = K / GROUP, halves = 2 * ((N + Q_TILE - 1) / Q_TILE);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < halves; u++) {
        int64_t t, h, first;
        const int live = half_span(u, N, &t, &h, &first);
        if (live <= 0)
            continue;
        const uint8_t *tile = q + t * G * Q4_BLOCK_BYTES + 32 * h; /* lanes 8h ..: bytes 32h .. of a chunk */
        const uint8_t *side = q + t * G * Q4_BLOCK_BYTES + Q4_TILE_BYTES + 16 * h; /* their 8 float16 scales */
        for (int64_t m = 0; m < M; m += Q_ROWS) {
#define Q4_CASE(r) \
    case r: q4_half(tile, side, &in, m, K, r, y + m * N + first, N, live); break
            switch (M - m < Q_ROWS ? M - m : Q_ROWS) { Q4_CASE(1); Q4_CASE(2); Q4_CASE(3); Q4_CASE(4); }
#undef Q4_CASE
        }
    }
    q_input_free(in);
}
