/* qmatmul.c's products on AVX-512, same results bit for bit: float32 of 4+ rows,
 * bfloat16 and float16 ones (AVX512F), and with AVX-512 VNNI int8 and int4 ones (at the
 * end; a CPU with AVX512F but no VNNI, Skylake-SP, runs those on AVX2).
 *
 * Float32 weights: a 16-lane accumulator replaces the AVX2 kernel's two 8-lane ones (lane
 * chunk j of a group going into accumulator j % 2, summed at the end as sum8(acc0 +
 * acc1)): one 16-lane accumulator holds [acc0 | acc1], its FMA of 16 consecutive weights
 * takes chunks 0 and 1, so every lane sees the same operations in the same order, and the
 * final sum adds the two halves first. Products of 1-3 rows stay on AVX2 (bound by
 * memory; one chain a row would wait on FMA latency); several-row ones gain once the pass
 * prefetches its weights (f32_pass below: 4-16 rows); 17+ rows take 4 x 4 tiles.
 * tests/test_quant_linear.py compares the two paths bit for bit (each format, row counts
 * across the passes of 16, widths not a multiple of 4).
 */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#else
#pragma GCC target("avx512f")
#endif

#include "qmatmul.h"

#include <stdlib.h>

/* float32 products of 8 rows or more: tiles of 4 rows of x x 4 weight rows, one 16-lane
 * accumulator each ([acc0 | acc1]: 16 consecutive floats are AVX2's chunks 0 and 1 of an
 * 8-lane step, so the same operations per lane in the same order). A step of 16 floats
 * loads 4 weight and 4 x vectors for 16 FMAs, where AVX2's 3 x 2 tiles load 10 for 12
 * (8-lane) FMAs. The first tile of a weight quad prefetches the next quad (as AVX2 does).
 * Interleaved against AVX2's tiles on the embedded target's products (weights streamed):
 * 0.90x / 0.86x / 0.87x / 0.79x the time at 9 / 13 / 17 / 25 rows. (Earlier 16-row
 * passes over one weight row were no faster: they load a weight vector per FMA.) */
#define F32_TILE 4

/* 16 weights of a float32 row, or of a bfloat16 or float16 one widened (exactly: every
 * bfloat16 and float16 value is a float32 value). */
static inline __m512 f32x16(const float *w) { return _mm512_loadu_ps(w); }
static inline __m512 bf16x16(const uint16_t *w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16));
}
static inline __m512 f16x16(const uint16_t *w) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w)); }

/* The tiles for a weight type: W the element, LOAD16 its 16-weight load. */
#define DEFINE_TILES(tile, quad, W, LOAD16) \
    static inline __attribute__((always_inline)) void tile(const float *x, int64_t K, const W *w, int rows, int nb, \
                                                           float *y, int64_t ldy, const W *next) { \
        __m512 acc[F32_TILE][F32_TILE]; \
        for (int r = 0; r < rows; r++) \
            for (int b = 0; b < nb; b++) acc[r][b] = _mm512_setzero_ps(); \
        for (int64_t k = 0; k < K; k += 16) { \
            if (next) \
                for (int b = 0; b < F32_TILE; b++) _mm_prefetch((const char *)(next + b * K + k), _MM_HINT_T0); \
            __m512 wv[F32_TILE]; \
            for (int b = 0; b < nb; b++) wv[b] = LOAD16(w + b * K + k); \
            for (int r = 0; r < rows; r++) { \
                const __m512 xv = _mm512_loadu_ps(x + r * K + k); \
                for (int b = 0; b < nb; b++) acc[r][b] = _mm512_fmadd_ps(wv[b], xv, acc[r][b]); \
            } \
        } \
        for (int r = 0; r < rows; r++) \
            for (int b = 0; b < nb; b++) y[r * ldy + b] = sum16(acc[r][b]); \
    } \
    static inline __attribute__((always_inline)) void quad(const float *x, int64_t M, int64_t K, const W *w, int nb, \
                                                           float *y, int64_t N, const W *next) { \
        int64_t m = 0; \
        for (; m + F32_TILE <= M; m += F32_TILE, next = NULL) tile(x + m * K, K, w, F32_TILE, nb, y + m * N, N, next); \
        switch (M - m) { \
        case 3: tile(x + m * K, K, w, 3, nb, y + m * N, N, next); break; \
        case 2: tile(x + m * K, K, w, 2, nb, y + m * N, N, next); break; \
        case 1: tile(x + m * K, K, w, 1, nb, y + m * N, N, next); break; \
        } \
    }
DEFINE_TILES(f32_tile16, f32_quad, float, f32x16)
DEFINE_TILES(bf16_tile16, bf16_quad, uint16_t, bf16x16)
DEFINE_TILES(f16_tile16, f16_quad, uint16_t, f16x16)
#undef DEFINE_TILES

/* All of y [M, N] = x @ w.T by quads of weight rows (QUAD: one of the quads above). */
#define QUADS(QUAD, x, M, K, w, N, y) \
    for (int64_t n = 0; n < N; n += F32_TILE) { \
        switch (N - n < F32_TILE ? N - n : F32_TILE) { \
        case 4: QUAD(x, M, K, w + n * K, 4, y + n, N, n + 2 * F32_TILE <= N ? w + (n + F32_TILE) * K : NULL); break; \
        case 3: QUAD(x, M, K, w + n * K, 3, y + n, N, NULL); break; \
        case 2: QUAD(x, M, K, w + n * K, 2, y + n, N, NULL); break; \
        case 1: QUAD(x, M, K, w + n * K, 1, y + n, N, NULL); break; \
        } \
    }

/* x [M, K] float32, w [N, K] float32 -> y [M, N], K % 16 == 0: qd_f32_matmul's result. */
void qd_f32_matmul_avx512(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    QUADS(f32_quad, x, M, K, w, N, y)
}

/* float32 products of 4-16 rows (a verify pass of 3-15 drafted tokens): one weight row
 * against all the rows of x, one 16-lane accumulator a row ([acc0 | acc1] as above), and
 * a prefetch of the weight row F32_AHEAD rows on. Without the prefetch the pass waited
 * for its weights and then computed, in turn (the header's "no faster"); with it, one
 * weight stream arrives while the rows compute. Interleaved against what ran before (the
 * AVX2 row pass to 7 rows, the 4 x 4 tiles from 8) over the embedded target's 33 products
 * of a pass (92 MB of weights streamed, 2 threads, three runs): 0.88x / 0.72x / 0.80-0.91x
 * / 0.78x / 0.81x / 0.89x / 0.94x the time at 4 / 6 / 7 / 8 / 9 / 13 / 16 rows; 1-3 rows
 * no faster (the AVX2 pass stays), 17+ slower than the tiles (which stay). Prefetch
 * distances of 1-4 rows were within 3% of each other. */
#define F32_PASS_ROWS 16
#define F32_AHEAD 2

/* The pass for a weight type: W the element, LOAD16 its 16-weight load, AHEAD_LINES the
 * cache lines of 32 weights (prefetched F32_AHEAD rows on). */
#define DEFINE_PASS(name, W, LOAD16, AHEAD_LINES) \
    static inline __attribute__((always_inline)) void name(const W *w, const W *ahead, const float *x, int64_t K, \
                                                           int rows, float *y, int64_t ldy) { \
        __m512 acc[F32_PASS_ROWS]; \
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps(); \
        for (int64_t k = 0; k < K; k += 32) { \
            if (ahead) \
                for (int line = 0; line < AHEAD_LINES; line++) \
                    _mm_prefetch((const char *)(ahead + k) + 64 * line, _MM_HINT_T0); \
            const __m512 w0 = LOAD16(w + k), w1 = LOAD16(w + k + 16); \
            for (int r = 0; r < rows; r++) acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * K + k), acc[r]); \
            for (int r = 0; r < rows; r++) acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * K + k + 16), acc[r]); \
        } \
        for (int r = 0; r < rows; r++) y[r * ldy] = sum16(acc[r]); \
    }
DEFINE_PASS(f32_pass, float, f32x16, 2)
DEFINE_PASS(bf16_pass, uint16_t, bf16x16, 1)
DEFINE_PASS(f16_pass, uint16_t, f16x16, 1)
#undef DEFINE_PASS

/* The pass over a pair of weight rows (n, n + 1): each row of x loaded once for both, so
 * a step of 32 weights loads 4 weight and 2 x vectors a row for 4 FMAs, where the pass
 * above loads 2 x vectors for 2; each accumulator sees the pass's operations in its order
 * (w0 then w1 each step), so the same results bit for bit. It pays where the rows of x
 * outgrow the L1 cache (PAIR_MIN floats: the embedded target's down product, K = 1,216,
 * from 4 rows, 0.60-0.66x the time at 9-16 rows with its weights in cache; K = 448 from 10
 * rows); below that it was slower (5 rows over K = 448: 1.10-1.14x; one row 1.2-1.3x, two
 * weight streams a thread). Whole passes of the embedded target, interleaved against the
 * row pass alone: 9 tokens 0.93x (bfloat16 weights, five runs 0.92-0.94x; float32 0.94x),
 * 1-5 tokens unchanged. At most PAIR_ROWS rows a call (2 x 10 accumulators, 4 weight
 * vectors, one x: 25 registers). */
#define PAIR_ROWS 10
/* Pairs ahead a pair prefetches (1 and 2 were alike). */
#define PAIR_AHEAD 2
#define DEFINE_PAIR_PASS(name, W, LOAD16, AHEAD_LINES) \
    static inline __attribute__((always_inline)) void name(const W *w, const W *ahead, const float *x, int64_t K, \
                                                           int rows, float *y, int64_t ldy) { \
        __m512 a0[PAIR_ROWS], a1[PAIR_ROWS]; \
        for (int r = 0; r < rows; r++) a0[r] = a1[r] = _mm512_setzero_ps(); \
        const W *v = w + K; \
        for (int64_t k = 0; k < K; k += 32) { \
            if (ahead) \
                for (int line = 0; line < AHEAD_LINES; line++) { \
                    _mm_prefetch((const char *)(ahead + k) + 64 * line, _MM_HINT_T0); \
                    _mm_prefetch((const char *)(ahead + K + k) + 64 * line, _MM_HINT_T0); \
                } \
            const __m512 w0 = LOAD16(w + k), w1 = LOAD16(w + k + 16), v0 = LOAD16(v + k), v1 = LOAD16(v + k + 16); \
            for (int r = 0; r < rows; r++) { \
                const __m512 x0 = _mm512_loadu_ps(x + r * K + k); \
                a0[r] = _mm512_fmadd_ps(w0, x0, a0[r]); \
                a1[r] = _mm512_fmadd_ps(v0, x0, a1[r]); \
            } \
            for (int r = 0; r < rows; r++) { \
                const __m512 x1 = _mm512_loadu_ps(x + r * K + k + 16); \
                a0[r] = _mm512_fmadd_ps(w1, x1, a0[r]); \
                a1[r] = _mm512_fmadd_ps(v1, x1, a1[r]); \
            } \
        } \
        for (int r = 0; r < rows; r++) { \
            y[r * ldy] = sum16(a0[r]); \
            y[r * ldy + 1] = sum16(a1[r]); \
        } \
    }
DEFINE_PAIR_PASS(f32_pair, float, f32x16, 2)
DEFINE_PAIR_PASS(bf16_pair, uint16_t, bf16x16, 1)
DEFINE_PAIR_PASS(f16_pair, uint16_t, f16x16, 1)
#undef DEFINE_PAIR_PASS

/* A call of fn on rows of x, rows a constant (each row count its own specialization). */
#define ROWS_CASE(fn, w, ahead, xm, K, rows, ym, N) \
    case rows: fn(w, ahead, xm, K, rows, ym, N); break;
#define ROWS_CASES_TO_10(fn, w, ahead, xm, K, ym, N) \
    ROWS_CASE(fn, w, ahead, xm, K, 1, ym, N) ROWS_CASE(fn, w, ahead, xm, K, 2, ym, N) \
    ROWS_CASE(fn, w, ahead, xm, K, 3, ym, N) ROWS_CASE(fn, w, ahead, xm, K, 4, ym, N) \
    ROWS_CASE(fn, w, ahead, xm, K, 5, ym, N) ROWS_CASE(fn, w, ahead, xm, K, 6, ym, N) \
    ROWS_CASE(fn, w, ahead, xm, K, 7, ym, N) ROWS_CASE(fn, w, ahead, xm, K, 8, ym, N) \
    ROWS_CASE(fn, w, ahead, xm, K, 9, ym, N) ROWS_CASE(fn, w, ahead, xm, K, 10, ym, N)

/* All M rows of x against weight rows n (each its own specialization up to
 * F32_PASS_ROWS; more rows in passes of that many). */
#define PASS_CASES(pass, w, ahead, x, M, K, N, y) \
    for (int64_t m = 0; m < (M); m += F32_PASS_ROWS) { \
        const float *xm = (x) + m * (K); \
        float *ym = (y) + m * (N); \
        switch ((M) - m < F32_PASS_ROWS ? (M) - m : F32_PASS_ROWS) { \
            ROWS_CASES_TO_10(pass, w, ahead, xm, K, ym, N) \
            ROWS_CASE(pass, w, ahead, xm, K, 11, ym, N) ROWS_CASE(pass, w, ahead, xm, K, 12, ym, N) \
            ROWS_CASE(pass, w, ahead, xm, K, 13, ym, N) ROWS_CASE(pass, w, ahead, xm, K, 14, ym, N) \
            ROWS_CASE(pass, w, ahead, xm, K, 15, ym, N) ROWS_CASE(pass, w, ahead, xm, K, 16, ym, N) \
        } \
    }

/* All M rows of x (M <= F32_PASS_ROWS) against weight rows n, n + 1 (pair: one of the pair
 * passes above): more than PAIR_ROWS rows in two calls of at most 8. */
#define PAIR_CASES(pair, w, ahead, x, M, K, N, y) \
    for (int64_t m = 0, part = (M) <= PAIR_ROWS ? (M) : ((M) + 1) / 2; m < (M); m += part) { \
        const float *xm = (x) + m * (K); \
        float *ym = (y) + m * (N); \
        switch ((M) - m < part ? (M) - m : part) { \
            ROWS_CASES_TO_10(pair, w, ahead, xm, K, ym, N) \
        } \
    }

/* Rows x columns of x from which PAIRS takes pairs of weight rows (16 KB of floats). */
#define PAIR_MIN 4096

/* y [M, N] = x @ w.T (M <= F32_PASS_ROWS): by single weight rows up to PAIR_MIN floats of x
 * (each prefetching F32_AHEAD rows on), else by pairs (prefetching PAIR_AHEAD pairs on),
 * an odd last row alone. */
#define PAIRS(pair, pass, W, x, M, K, w, N, y) \
    if ((M) * (K) <= PAIR_MIN) { \
        _Pragma("omp parallel for schedule(static) num_threads(threads)") \
        for (int64_t n = 0; n < (N); n++) { \
            const W *ahead = n + F32_AHEAD < (N) ? (w) + (n + F32_AHEAD) * (K) : NULL; \
            PASS_CASES(pass, (w) + n * (K), ahead, x, M, K, N, (y) + n) \
        } \
    } else \
    _Pragma("omp parallel for schedule(static) num_threads(threads)") \
    for (int64_t p = 0; p < ((N) + 1) / 2; p++) { \
        const int64_t n = 2 * p; \
        if (n + 1 < (N)) { \
            const W *ahead = n + 2 * PAIR_AHEAD + 1 < (N) ? (w) + (n + 2 * PAIR_AHEAD) * (K) : NULL; \
            PAIR_CASES(pair, (w) + n * (K), ahead, x, M, K, N, (y) + n) \
        } else { \
            PASS_CASES(pass, (w) + n * (K), NULL, x, M, K, N, (y) + n) \
        } \
    }

/* x [M, K] float32 (M <= F32_PASS_ROWS), w [N, K] -> y [M, N], K % 32 == 0: qd_f32_matmul's result. */
void qd_f32_rows_avx512(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int threads) {
    PAIRS(f32_pair, f32_pass, float, x, M, K, w, N, y)
}

/* x [M, K] float32, w [N, K] bfloat16 or float16 -> y [M, N], K % 32 == 0: qd_bf16_matmul's
 * / qd_f16_matmul's result. Half the bytes of float32 weights and the same arithmetic: the
 * row passes (PAIRS) up to F32_PASS_ROWS rows, the tiles above that (a prefill). The embedded
 * target's 33 products of a pass (its bfloat16 checkpoint, widened on the fly),
 * interleaved against float32 weights: 0.50x the time at 1-2 rows, 0.58x at 3, 0.60x at
 * 5-7, 0.67x at 9. */
#define DEFINE_HALF_MATMUL(name, quad, pair, pass) \
    void name(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y, int threads) { \
        if (M > F32_PASS_ROWS) { \
            _Pragma("omp parallel for schedule(static) num_threads(threads)") \
            QUADS(quad, x, M, K, w, N, y) \
            return; \
        } \
        PAIRS(pair, pass, uint16_t, x, M, K, w, N, y) \
    }
DEFINE_HALF_MATMUL(qd_bf16_matmul_avx512, bf16_quad, bf16_pair, bf16_pass)
DEFINE_HALF_MATMUL(qd_f16_matmul_avx512, f16_quad, f16_pair, f16_pass)
#undef DEFINE_HALF_MATMUL
#undef PAIRS
#undef PAIR_CASES
#undef PASS_CASES
#undef ROWS_CASES_TO_10
#undef ROWS_CASE
#undef QUADS

int qd_avx512_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* int8 and int4 weights times 8-bit activations in tiles of 16 weight rows (q8a8.h,
 * q4a8.h: layouts, rules and why) with AVX-512 VNNI: a vector is one tile's 16 weight rows,
 * 4 weights each, and one vpdpbusd adds each lane's 4 products with 4 bytes of x
 * (broadcast); 8 of them make a group's exact sum, two chains of 4 in flight. A pass takes
 * one tile x up to Q_ONE_ROWS rows of x or two tiles x up to Q_PAIR_ROWS rows (each
 * broadcast of x serving 32 outputs); the first pass over tiles prefetches the tiles after
 * them. One tile up to 24 rows (a step or a verify pass: weights streamed from memory in
 * one sequential stream, read in one pass where 8 rows fit), two tiles from 25 (a prefill
 * or a batch: the broadcasts of x dominate). SmolLM2 and the embedded target, whole passes
 * (scripts/step_ab.py build --quantize, session 33): two tiles took 1.02-1.09x the time at
 * 5-16 rows, 0.96x at 32, 0.86-0.93x at 64-256. Up to 4 rows took two tiles too (four
 * chains per row in flight) until session 44: since session 42's blocks put a tile's
 * bytes in one stream, two tiles read two streams at once, and on the AMD EPYC (Zen 4)
 * host one tile took 0.90-0.94x the time at 1-4 rows (scripts/step_ab.py build smollm2-135m
 * --rev 90186b0 --widths 1,2,3,4,5,7: 0.935 / 0.915 / 0.915 / 0.897, 5 and 7 unchanged). */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#endif
#include "q8a8.h"

#include <string.h>

#include "q4a8.h"

#define Q_PAIR_ROWS 4
#define Q_ONE_ROWS 8
#define Q_ONE_MAX_ROWS 24

/* The 4 bytes at p in all 16 lanes, as one broadcast load: read into a general register
 * first (8 bytes at once, then split), each cost a port-5 shuffle per row and half-group,
 * the port the products' conversions share. */
static inline __m512i bytes4_x16(const uint8_t *p) {
    int32_t word;
    memcpy(&word, p, sizeof word);
    return _mm512_set1_epi32(word);
}

/* Whether a product of M rows takes two tiles a pass: from 25 rows. */
static inline int pair_tiles(int64_t M) {
    return M > Q_ONE_MAX_ROWS;
}

/* Unit u of a product's tiles, `step` (1 or 2) tiles a unit: its first tile t, how many
 * tiles it has (nb) and how many lanes of its last one are rows of W (live). */
static inline int64_t tile_span(int64_t u, int step, int64_t T, int64_t N, int *nb, int *live) {
    const int64_t t = u * step;
    *nb = t + step <= T ? step : 1;
    const int64_t rest = N - Q_TILE * (t + *nb - 1);
    *live = (int)(rest < Q_TILE ? rest : Q_TILE);
    return t;
}

/* Rows m .. M - 1 of x `pass` at a time against nb (1 or 2) tiles: TILES(NB, R) runs one
 * pass of R rows (constants). */
#define ROW_PASSES(TILES) \
    for (int64_t m = 0; m < M; m += pass, ahead = NULL) { \
        const int rows = (int)(M - m < pass ? M - m : pass); \
        if (nb == 2) \
            switch (rows) { TILES(2, 1); TILES(2, 2); TILES(2, 3); TILES(2, 4); } \
        else \
            switch (rows) { \
                TILES(1, 1); TILES(1, 2); TILES(1, 3); TILES(1, 4); \
                TILES(1, 5); TILES(1, 6); TILES(1, 7); TILES(1, 8); \
            } \
    }

/* Tiles t .. t + nb - 1 of int8 weights (`tiles` at tile t's group 0: q8a8.h's blocks,
 * q + 128 as unsigned bytes) against rows m .. m + rows - 1 of the quantized x, into
 * y[r * ldy + 16 b + i]; the last tile's first `live` lanes only. Constant nb, rows. */
static inline __attribute__((always_inline)) void q8_tiles(const uint8_t *tiles, int nb, const QInput *in,
                                                            int64_t m, int64_t K, int rows, float *y,
                                                            int64_t ldy, int live, const uint8_t *ahead) {
    const int64_t G = K / GROUP;
    __m512 acc[2][Q_ONE_ROWS];
    for (int b = 0; b < nb; b++)
        for (int r = 0; r < rows; r++) acc[b][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        if (ahead)
            for (int b = 0; b < nb; b++)
                for (int h = 0; h < Q8_BLOCK_BYTES / 64; h++)
                    _mm_prefetch((const char *)(ahead + (b * G + g) * Q8_BLOCK_BYTES + 64 * h), _MM_HINT_T0);
        __m512i sum0[2][Q_ONE_ROWS], sum1[2][Q_ONE_ROWS];
        for (int b = 0; b < nb; b++)
            for (int r = 0; r < rows; r++) sum0[b][r] = sum1[b][r] = _mm512_setzero_si512();
        for (int h = 0; h < 8; h += 2) {
            __m512i w0[2], w1[2];
            for (int b = 0; b < nb; b++) {
                w0[b] = _mm512_loadu_si512(tiles + (b * G + g) * Q8_BLOCK_BYTES + 64 * h);
                w1[b] = _mm512_loadu_si512(tiles + (b * G + g) * Q8_BLOCK_BYTES + 64 * (h + 1));
            }
            for (int r = 0; r < rows; r++) {
                const uint8_t *x4 = (const uint8_t *)in->xq + (m + r) * K + g * GROUP + 4 * h; /* bytes 4h .. 4h + 7 */
                const __m512i x0 = bytes4_x16(x4), x1 = bytes4_x16(x4 + 4);
                for (int b = 0; b < nb; b++) {
                    sum0[b][r] = _mm512_dpbusd_epi32(sum0[b][r], w0[b], x0);
                    sum1[b][r] = _mm512_dpbusd_epi32(sum1[b][r], w1[b], x1);
                }
            }
        }
        for (int b = 0; b < nb; b++) {
            const __m512 s = _mm512_loadu_ps(tiles + (b * G + g) * Q8_BLOCK_BYTES + Q8_TILE_BYTES);
            for (int r = 0; r < rows; r++) { /* sum((q + 128) xq) - 128 sum(xq) = sum(q xq) */
                const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(sum0[b][r], sum1[b][r]),
                                                      _mm512_set1_epi32(128 * in->qs[(m + r) * G + g]));
                acc[b][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),
                                            _mm512_mul_ps(s, _mm512_set1_ps(in->dx[(m + r) * G + g])), acc[b][r]);
            }
        }
    }
    for (int b = 0; b < nb; b++) {
        const __mmask16 lanes = b < nb - 1 || live >= Q_TILE ? 0xFFFF : (__mmask16)((1u << live) - 1);
        for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + r * ldy + Q_TILE * b, lanes, acc[b][r]);
    }
}

void qd_q8_matmul_vnni(const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t N, float *y, int threads) {
    const int64_t G = K / GROUP, T = (N + Q_TILE - 1) / Q_TILE;
    const QInput in = q_input(x, M, K, 1, threads);
    const int pair = pair_tiles(M), pass = pair ? Q_PAIR_ROWS : Q_ONE_ROWS, step = pair ? 2 : 1;
#define Q8_TILES(NB, R) \
    case R: q8_tiles(tiles, NB, &in, m, K, R, y + m * N + Q_TILE * t, N, live, ahead); break
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < (T + step - 1) / step; u++) {
        int nb, live;
        const int64_t t = tile_span(u, step, T, N, &nb, &live);
        const uint8_t *tiles = q + t * G * Q8_BLOCK_BYTES;
        const uint8_t *ahead = t + 2 * nb <= T ? tiles + nb * G * Q8_BLOCK_BYTES : NULL;
        ROW_PASSES(Q8_TILES)
    }
#undef Q8_TILES
    q_input_free(in);
}

/* Tiles t .. t + nb - 1 (`tiles` at tile t's group 0: q4a8.h's blocks) against rows
 * m .. m + rows - 1 of the quantized x, into y[r * ldy + 16 b + i]; the last tile's first
 * `live` lanes only. Constant nb and rows. */
static inline __attribute__((always_inline)) void q4_tiles(const uint8_t *tiles, int nb, const QInput *in,
                                                            int64_t m, int64_t K, int rows, float *y, int64_t ldy,
                                                            int live, const uint8_t *ahead) {
    const int64_t G = K / GROUP;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 acc[2][Q_ONE_ROWS];
    for (int b = 0; b < nb; b++)
        for (int r = 0; r < rows; r++) acc[b][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        if (ahead)
            for (int b = 0; b < nb; b++)
                for (int h = 0; h < Q4_BLOCK_BYTES / 64; h++)
                    _mm_prefetch((const char *)(ahead + (b * G + g) * Q4_BLOCK_BYTES + 64 * h), _MM_HINT_T0);
        __m512i sum0[2][Q_ONE_ROWS], sum1[2][Q_ONE_ROWS];
        for (int b = 0; b < nb; b++)
            for (int r = 0; r < rows; r++) sum0[b][r] = sum1[b][r] = _mm512_setzero_si512();
        for (int h = 0; h < 4; h++) {
            __m512i lo[2], hi[2];
            for (int b = 0; b < nb; b++) {
                const __m512i v = _mm512_loadu_si512(tiles + (b * G + g) * Q4_BLOCK_BYTES + 64 * h);
                lo[b] = _mm512_and_si512(v, mask);
                hi[b] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            }
            for (int r = 0; r < rows; r++) {
                const uint8_t *x8 = (const uint8_t *)in->xq + (m + r) * K + g * GROUP + 8 * h; /* bytes 8h .. 8h + 7 */
                const __m512i x0 = bytes4_x16(x8), x1 = bytes4_x16(x8 + 4);
                for (int b = 0; b < nb; b++) {
                    sum0[b][r] = _mm512_dpbusd_epi32(sum0[b][r], lo[b], x0);
                    sum1[b][r] = _mm512_dpbusd_epi32(sum1[b][r], hi[b], x1);
                }
            }
        }
        for (int b = 0; b < nb; b++) {
            const uint8_t *side = tiles + (b * G + g) * Q4_BLOCK_BYTES + Q4_TILE_BYTES;
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)side)),
                         c = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(side + Q4_SIDE_BYTES)));
            for (int r = 0; r < rows; r++) {
                const __m512 i = _mm512_cvtepi32_ps(_mm512_add_epi32(sum0[b][r], sum1[b][r]));
                acc[b][r] = _mm512_fmadd_ps(i, _mm512_mul_ps(s, _mm512_set1_ps(in->dx[(m + r) * G + g])), acc[b][r]);
                acc[b][r] = _mm512_fmadd_ps(c, _mm512_set1_ps(in->sx[(m + r) * G + g]), acc[b][r]);
            }
        }
    }
    for (int b = 0; b < nb; b++) {
        const __mmask16 lanes = b < nb - 1 || live >= Q_TILE ? 0xFFFF : (__mmask16)((1u << live) - 1);
        for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + r * ldy + Q_TILE * b, lanes, acc[b][r]);
    }
}

void qd_q4_matmul_vnni(const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t N, float *y, int threads) {
    const QInput in = q_input(x, M, K, 1, threads);
    const int64_t G = K / GROUP, T = (N + Q_TILE - 1) / Q_TILE;
    const int pair = pair_tiles(M), pass = pair ? Q_PAIR_ROWS : Q_ONE_ROWS, step = pair ? 2 : 1;
#define Q4_TILES(NB, R) \
    case R: q4_tiles(tiles, NB, &in, m, K, R, y + m * N + Q_TILE * t, N, live, ahead); break
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < (T + step - 1) / step; u++) {
        int nb, live;
        const int64_t t = tile_span(u, step, T, N, &nb, &live);
        const uint8_t *tiles = q + t * G * Q4_BLOCK_BYTES;
        const uint8_t *ahead = t + 2 * nb <= T ? tiles + nb * G * Q4_BLOCK_BYTES : NULL;
        ROW_PASSES(Q4_TILES)
    }
#undef Q4_TILES
    q_input_free(in);
}

int qd_vnni_supported(void) {
    static int supported = -1;
    if (supported < 0) {
        __builtin_cpu_init();
        supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    }
    return supported;
}
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
