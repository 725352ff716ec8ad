/* What qmatmul.c (AVX2) and qmatmul_avx512.c share: the weight formats and the final sum.
 * Both files round every output element through the same sequence of operations (see
 * qmatmul.c's header), so which one runs never changes a result. */
#ifndef QD_QMATMUL_H
#define QD_QMATMUL_H

#include <immintrin.h>
#include <stdint.h>

#define GROUP 32

/* Rows from which a pass's per-row work (quantizing x, norms, activations, the cache
 * writes) is split between the threads (a prefill); each row is computed as one thread
 * alone would, so the result is the same. */
#define MANY_ROWS 64

/* for (int64_t i = 0; i < n; i++) body, shared by `threads` threads (a variable of that
 * name in scope) where cond holds, else run here without entering OpenMP: a region whose
 * if clause is false still has libgomp set up a team of one (~0.35 us), and a one-row
 * layer ran ~20 of them (per-row work below MANY_ROWS rows: an EAGLE drafter's level, a
 * decode step's layer). */
#define QD_FOR_IF(cond, i, n, ...)                                                     \
    do {                                                                                \
        const int64_t qd_for_count = (n);                                               \
        if (cond) {                                                                     \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")           \
            for (int64_t i = 0; i < qd_for_count; i++) __VA_ARGS__                      \
        } else {                                                                        \
            for (int64_t i = 0; i < qd_for_count; i++) __VA_ARGS__                      \
        }                                                                               \
    } while (0)

/* Where a float weight's rows are (float32, bfloat16 or float16 values, [N, K]). */
typedef struct {
    const void *q;
} Weights;

/* The 8 lanes of v added in a fixed order (AVX only, so both files can use it). */
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 16 lanes of acc added in a fixed order: its halves first, then sum8 (AVX-512 files
 * only; the target attribute lets the AVX2 files include this header). */
static inline __attribute__((target("avx512f"))) float sum16(__m512 acc) {
    const __m256 lo = _mm512_castps512_ps256(acc);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    return sum8(_mm256_add_ps(lo, hi));
}

/* The AVX-512 products (qmatmul_avx512.c), and whether this CPU runs them: float32 of 4-16
 * rows (a prefetching row pass) and of 17+ (tiles); bfloat16 and float16 (the row pass,
 * tiles from 17); int8 and int4 with VNNI. */
int qd_avx512_supported(void);
void qd_f32_matmul_avx512(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int threads);
void qd_f32_rows_avx512(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int threads);
void qd_bf16_matmul_avx512(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y,
                           int threads);
void qd_f16_matmul_avx512(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y,
                          int threads);
int qd_vnni_supported(void);
/* int4 tiles times 8-bit activations (q4a8.h; needs qd_vnni_supported). */
void qd_q4_matmul_vnni(const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t N, float *y, int threads);
/* int8 tiles times 8-bit activations (q8a8.h; needs qd_vnni_supported). */
void qd_q8_matmul_vnni(const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t N, float *y, int threads);

#endif
