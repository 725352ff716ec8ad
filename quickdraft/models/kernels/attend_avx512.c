/* Attention for blocks of 2-4 queries on AVX-512, for layer_ops.c's attend_block: the same
 * results as its AVX2 loops, bit for bit. The scores: qd_scores_avx512, below; the softmax
 * numerators of any query: qd_softmax_avx512, at the end. The weighted
 * sum of values (as its AVX2 weighted_sum): each output element is still one FMA per
 * visible key, in slot order, skipping keys of weight 0, from 0, times 1 / the softmax
 * total at the end; only the lanes are 16 wide (elementwise operations: the width changes
 * no rounding) and up to 4 queries of a head share each value read. Why: with 8 lanes, a
 * verify pass of 9 tokens over 1,000 keys spent over half of its attention in this sum
 * (16 float operations and 8 loads a key and query).
 */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#else
#pragma GCC target("avx512f")
#endif

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "exp_poly.h"

/* nq queries (<= 4) and cn 16-float slices (<= 4) of the output: constants where inlined. */
static inline __attribute__((always_inline)) void slice_sum(const float *const *w, int64_t kv_len, int nq,
                                                            const float *values, int64_t d, int cn,
                                                            const float *inv, float *out, int64_t out_stride) {
    __m512 acc[4][4];
    for (int b = 0; b < nq; b++)
        for (int c = 0; c < cn; c++)
            acc[b][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < kv_len; s++) {
        __m512 v[4];
        for (int c = 0; c < cn; c++)
            v[c] = _mm512_loadu_ps(values + s * d + 16 * c);
        for (int b = 0; b < nq; b++) {
            const float weight = w[b][s];
            if (weight == 0.0f) /* hidden, or underflowed: contributes nothing, skipped */
                continue;
            const __m512 wb = _mm512_set1_ps(weight);
            for (int c = 0; c < cn; c++)
                acc[b][c] = _mm512_fmadd_ps(wb, v[c], acc[b][c]);
        }
    }
    for (int b = 0; b < nq; b++)
        for (int c = 0; c < cn; c++)
            _mm512_storeu_ps(out + b * out_stride + 16 * c, _mm512_mul_ps(acc[b][c], _mm512_set1_ps(inv[b])));
}

/* out[b * out_stride + i] = inv[b] * sum over slots s < kv_len with w[b][s] != 0 of
 * w[b][s] * values[s * d + i], for queries b < nq (<= 4) and i < d (d a multiple of 16):
 * the weights are each query's softmax numerators by slot, 0 where the query does not
 * see the slot. */
void qd_weighted_values_avx512(const float *const *w, int64_t kv_len, int nq, const float *values, int64_t d,
                               const float *inv, float *out, int64_t out_stride) {
    for (int64_t i = 0; i < d; i += 64) {
        const int cn = d - i >= 64 ? 4 : (int)((d - i) / 16);
#define SLICE(q, c) slice_sum(w, kv_len, q, values + i, d, c, inv, out + i, out_stride)
#define QUERIES(q)                   \
    switch (cn) {                    \
    case 4: SLICE(q, 4); break;      \
    case 3: SLICE(q, 3); break;      \
    case 2: SLICE(q, 2); break;      \
    default: SLICE(q, 1); break;     \
    }
        switch (nq) {
        case 4: QUERIES(4); break;
        case 3: QUERIES(3); break;
        case 2: QUERIES(2); break;
        default: QUERIES(1); break;
        }
#undef QUERIES
#undef SLICE
    }
}

/* A 512-bit register's two 256-bit halves each summed as layer_ops.c's lanes_sum4 sums
 * four AVX2 accumulators, bit for bit (the same additions of the same lanes): a, b, c, e
 * each hold one key's 8 lanes for query 0 (low half) and query 1 (high half). Returns
 * query 0's four sums (a, b, c, e) in lanes 0-3 and query 1's in lanes 4-7. */
static inline __attribute__((always_inline)) __m256 pair_sum4(__m512 a, __m512 b, __m512 c, __m512 e) {
    /* 128-bit blocks: a = [a0 a1 | a2 a3] (query 0's low and high 4 lanes | query 1's) */
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    /* per half: [a.lo + a.hi, b.lo + b.hi], as lanes_sum4's permute2f128 sums */
    const __m512 ab = _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
    const __m512 ce = _mm512_add_ps(_mm512_permutex2var_ps(c, lo, e), _mm512_permutex2var_ps(c, hi, e));
    const __m512 pairs = _mm512_add_ps(_mm512_shuffle_ps(ab, ce, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_ps(ab, ce, _MM_SHUFFLE(3, 2, 3, 2)));
    /* hadd(pairs, pairs): per 128-bit block [p0 + p1, p2 + p3, p0 + p1, p2 + p3] */
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(pairs, pairs, _MM_SHUFFLE(3, 1, 3, 1)));
    /* blocks [a c a c | b e b e | (query 1's)]: a, b, c, e of each query */
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 8, 12, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, sums));
}

/* 8 floats from p in both halves of a register (one load; no shuffle). */
static inline __attribute__((always_inline)) __m512 both_halves(const float *p) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

/* qd_scores_avx512 for 3 or 4 queries as two pairs (a third query paired with itself),
 * keys 4 at a time: each key chunk is loaded once for both pairs, the FMAs and sums are
 * those of one pair at a time. With layer_ops.c's even blocks (block_size), the embedded
 * target's 13-token pass after 1,100 tokens (int8) took 0.93x the time. */
static inline __attribute__((always_inline)) void scores_two_pairs(const float *const *q, int nq, const float *keys,
                                                                   int64_t n8, int64_t d, float *scores,
                                                                   int64_t stride) {
    const int64_t chunks = d / 8;
    const float *qs[4] = {q[0], q[1], q[2], q[nq > 3 ? 3 : 2]};
    __m512 qc[2][8];
    for (int p = 0; p < 2; p++)
        for (int64_t c = 0; c < chunks; c++)
            qc[p][c] = _mm512_castpd_ps(_mm512_insertf64x4(
                _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(qs[2 * p] + 8 * c))),
                _mm256_castps_pd(_mm256_loadu_ps(qs[2 * p + 1] + 8 * c)), 1));
    for (int64_t s = 0; s < n8; s += 4) {
        const float *key = keys + s * d;
        __m512 acc[2][4];
        for (int p = 0; p < 2; p++)
            for (int k = 0; k < 4; k++)
                acc[p][k] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++)
            for (int k = 0; k < 4; k++) {
                const __m512 kc = both_halves(key + k * d + 8 * c);
                acc[0][k] = _mm512_fmadd_ps(qc[0][c], kc, acc[0][k]);
                acc[1][k] = _mm512_fmadd_ps(qc[1][c], kc, acc[1][k]);
            }
        const __m256 first = pair_sum4(acc[0][0], acc[0][1], acc[0][2], acc[0][3]);
        const __m256 second = pair_sum4(acc[1][0], acc[1][1], acc[1][2], acc[1][3]);
        _mm_storeu_ps(scores + s, _mm256_castps256_ps128(first));
        _mm_storeu_ps(scores + stride + s, _mm256_extractf128_ps(first, 1));
        _mm_storeu_ps(scores + 2 * stride + s, _mm256_castps256_ps128(second));
        if (nq > 3)
            _mm_storeu_ps(scores + 3 * stride + s, _mm256_extractf128_ps(second, 1));
    }
}

/* scores[b * stride + s] = q[b] . key s for queries b < nq (2 <= nq <= 4) and keys
 * s < n8 (a multiple of 8) of keys [., d] (d a multiple of 8, at most 128): what
 * layer_ops.c's attend_block computes with 8 lanes, bit for bit (lane j of a query's
 * key is the FMA chain over chunks c of q[8c + j] * key[8c + j], the lanes summed as
 * lanes_sum4 sums them). Two queries share each 16-lane FMA, each key chunk loaded once
 * into both halves, and their sums are reduced together: half the FMAs and shuffles.
 * An odd query is paired with itself. */
void qd_scores_avx512(const float *const *q, int nq, const float *keys, int64_t n8, int64_t d, float *scores,
                      int64_t stride) {
    const int64_t chunks = d / 8;
    if (nq > 2 && d <= 64) {
        scores_two_pairs(q, nq, keys, n8, d, scores, stride);
        return;
    }
    for (int b = 0; b < nq; b += 2) {
        const float *q0 = q[b], *q1 = q[b + 1 < nq ? b + 1 : b];
        __m512 qc[16];
        for (int64_t c = 0; c < chunks; c++)
            qc[c] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(q0 + 8 * c))),
                                                        _mm256_castps_pd(_mm256_loadu_ps(q1 + 8 * c)), 1));
        for (int64_t s = 0; s < n8; s += 8) {
            const float *key = keys + s * d;
            __m512 acc[8];
            for (int k = 0; k < 8; k++)
                acc[k] = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++)
                for (int k = 0; k < 8; k++)
                    acc[k] = _mm512_fmadd_ps(qc[c], both_halves(key + k * d + 8 * c), acc[k]);
            const __m256 first = pair_sum4(acc[0], acc[1], acc[2], acc[3]);
            const __m256 second = pair_sum4(acc[4], acc[5], acc[6], acc[7]);
            _mm_storeu_ps(scores + b * stride + s, _mm256_castps256_ps128(first));
            _mm_storeu_ps(scores + b * stride + s + 4, _mm256_castps256_ps128(second));
            if (b + 1 < nq) {
                _mm_storeu_ps(scores + (b + 1) * stride + s, _mm256_extractf128_ps(first, 1));
                _mm_storeu_ps(scores + (b + 1) * stride + s + 4, _mm256_extractf128_ps(second, 1));
            }
        }
    }
}

/* layer_ops.c's exp8 in 16 lanes (exp_poly.h): the same operations lane by lane. */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) { return QD_EXP(512, _mm512_roundscale_ps, x); }

/* layer_ops.c's softmax_packed over lanes (a multiple of 8) entries of p, the numerators
 * 16 at a time: e^(p - best), 0 for -inf, stored in place; their 8 lane sums in *total,
 * added 8 entries at a time in order (the low half, then the high half), as the AVX2 loop
 * adds them: the same sums bit for bit. Returns how many entries it took (a multiple of
 * 16); the caller does the rest. */
int64_t qd_softmax_avx512(float *p, int64_t lanes, float best, __m256 *total) {
    const __m512 top = _mm512_set1_ps(best), hidden = _mm512_set1_ps(-INFINITY);
    __m256 sum = *total;
    int64_t i = 0;
    for (; i + 16 <= lanes; i += 16) {
        const __m512 v = _mm512_loadu_ps(p + i);
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, hidden, _CMP_NEQ_UQ), exp16(_mm512_sub_ps(v, top)));
        _mm512_storeu_ps(p + i, e);
        sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
        sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    *total = sum;
    return i;
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
