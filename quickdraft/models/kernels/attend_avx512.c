/* Attention's weighted sum of values on AVX-512, for layer_ops.c's attend_block: the same
 * result as its AVX2 weighted_sum, bit for bit. Each output element is still a product
 * then a sum per visible key, in slot order, skipping keys of weight 0, from 0, times
 * 1 / the softmax total at the end; only the lanes are 16 wide (elementwise operations:
 * the width changes no rounding) and up to 4 queries of a head share each value read.
 * Why: with 8 lanes, a verify pass of 9 tokens over 1,000 keys spent over half of its
 * attention in this sum (16 float operations and 8 loads a key and query).
 */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#else
#pragma GCC target("avx512f")
#endif

#include <immintrin.h>
#include <stdint.h>

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
                acc[b][c] = _mm512_add_ps(acc[b][c], _mm512_mul_ps(wb, v[c]));
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

#if defined(__clang__)
#pragma clang attribute pop
#endif
