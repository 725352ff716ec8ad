/* The non-matrix work of a decoder layer, fused, for CPU decoding in float32 (AVX2 + FMA).
 *
 * A decode step of a small model is mostly overhead, not arithmetic: SmolLM2-135M's 30
 * layers made ~3,400 PyTorch calls a step (RMSNorm alone is ~6, RoPE ~8, the cache write
 * and SDPA ~20), ~6 ms of a 13 ms step on a 2-core EPYC. Here each of those is one call:
 *   qd_rms_norm    y = x / sqrt(mean(x^2) + eps) * w, row by row
 *   qd_silu_mul    y = silu(h[:, :W]) * h[:, W:]   (a gated MLP's gate and up halves)
 *   qd_attend      rotate q and k (rotate-half RoPE), store k and v in the KV cache, and
 *                  attend: softmax(q k^T / sqrt(D) + mask) v, for the queries of one row
 *
 * Exactness: each output element is computed by one thread with one sequence of float
 * operations that depends only on its own row (and, for attention, on the keys it sees),
 * never on how many rows share the call. A verify pass of k+1 tokens therefore rounds
 * each token as a one-token step does, which lossless speculative decoding needs:
 *   - sums over a row run in 8 lanes over zero-padded chunks (lane i % 8 for index i),
 *     lanes added in a fixed order, so extra masked keys add exact zeros, never a reorder;
 *   - masked keys (mask -inf, or past the query's own slot) are skipped, not weighted by 0,
 *     and the softmax sums the visible keys by rank, not slot: a tree node rounds as the
 *     plain step that later sees the same keys packed behind the cache does.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_poly.h"
#include "qmatmul.h"

static inline float lanes_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* lanes_sum of a, b, c and e at once, bit for bit: the same additions (the halves, then
 * lanes 0 + 2 and 1 + 3, then those two; float addition commutes), four vectors a
 * shuffle. One at a time, each sum was a chain as long as the dot product it ends. */
static inline __m128 lanes_sum4(__m256 a, __m256 b, __m256 c, __m256 e) {
    const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    const __m256 ce = _mm256_add_ps(_mm256_permute2f128_ps(c, e, 0x20), _mm256_permute2f128_ps(c, e, 0x31));
    /* ab: a's 4 half sums, then b's; ce: c's, then e's */
    const __m256 pairs = _mm256_add_ps(_mm256_shuffle_ps(ab, ce, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm256_shuffle_ps(ab, ce, _MM_SHUFFLE(3, 2, 3, 2)));
    /* pairs: a's lanes 0 + 2, 1 + 3, c's 0 + 2, 1 + 3, then the same of b and e */
    const __m256 sums = _mm256_hadd_ps(pairs, pairs); /* a, c, a, c, then b, e, b, e */
    return _mm_unpacklo_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

/* The first n floats of p as a vector, zeros after (n < 8). */
static inline __m256 load_part(const float *p, int64_t n) {
    float buf[8] = {0};
    memcpy(buf, p, (size_t)n * sizeof(float));
    return _mm256_loadu_ps(buf);
}

/* A KV cache holds float32 or, with kv16 (--kv-cache float16), float16 keys and values:
 * the address of element `elems` from base. */
static inline void *kv_at(void *base, int64_t elems, int64_t kv16) {
    return (char *)base + elems * (kv16 ? 2 : 4);
}

/* dst[0 .. n) = src as float16, rounded to nearest even (as torch's .half()). */
static void store_half(uint16_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++)
        dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* dst[0 .. n) = the float16 src widened (exact). */
static void load_half(float *dst, const uint16_t *src, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++)
        dst[i] = _cvtsh_ss(src[i]);
}

/* 8 cache elements from element i on, as float32 (kv16: widened from float16, exactly). */
static inline __attribute__((always_inline)) __m256 kv_load8(const void *base, int64_t i, int kv16) {
    return kv16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)))
                : _mm256_loadu_ps((const float *)base + i);
}

/* sum a[i] * b[i]: lane i % 8 for every i, the tail zero-padded into one more chunk. */
static float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    if (i < n)
        acc = _mm256_fmadd_ps(load_part(a + i, n - i), load_part(b + i, n - i), acc);
    return lanes_sum(acc);
}

/* e^x in 8 lanes (exp_poly.h). */
static inline __m256 exp8(__m256 x) { return QD_EXP(256, _mm256_round_ps, x); }

void qd_rms_norm(const float *x, int64_t m, int64_t k, const float *w, float eps, float *y) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        float *yr = y + r * k;
        const float scale = 1.0f / sqrtf(dot(xr, xr, k) / (float)k + eps);
        if (w == NULL) /* unit weight: what a weight of ones gives, without reading one */
            for (int64_t i = 0; i < k; i++)
                yr[i] = xr[i] * scale;
        else
            for (int64_t i = 0; i < k; i++)
                yr[i] = xr[i] * scale * w[i];
    }
}

/* h: [m, 2 * width] (gate, up); y: [m, width]. silu(g) = g / (1 + e^-g). */
void qd_silu_mul(const float *h, int64_t m, int64_t width, float *y) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t r = 0; r < m; r++) {
        const float *gate = h + r * 2 * width, *up = gate + width;
        float *yr = y + r * width;
        int64_t i = 0;
        for (; i + 8 <= width; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
        }
        if (i < width) {  /* the tail through the same vector code: same rounding as a full chunk */
            float out[8];
            const __m256 g = load_part(gate + i, width - i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), load_part(up + i, width - i)));
            memcpy(yr + i, out, (size_t)(width - i) * sizeof(float));
        }
    }
}

/* Rotate-half RoPE of one head vector: out[i] = x[i] cos[i] + x[(i + D/2) % D] ssin[i],
 * ssin being the sine with its first half negated (the products and sum PyTorch's
 * x * cos + cat(x2, x1) * ssin rounds, in the same order). */
static void rope(const float *x, const float *cos, const float *ssin, int64_t d, float *out) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        const float a = x[i] * cos[i], b = x[i < half ? i + half : i - half] * ssin[i];
        out[i] = a + b;
    }
}

int qd_kernel_isa(int want);
int64_t qd_softmax_avx512(float *p, int64_t lanes, float best, __m256 *total);

/* The softmax of one query's packed scores p[0..n) (best: their maximum) in place, lanes
 * of 8 over the zero-padded pack, and 1 / their sum. */
static float softmax_packed(float *p, int64_t n, float best) {
    const int64_t lanes = (n + 7) / 8 * 8;
    for (int64_t i = n; i < lanes; i++)
        p[i] = -INFINITY;
    __m256 total = _mm256_setzero_ps();
    const __m256 top = _mm256_set1_ps(best), hidden = _mm256_set1_ps(-INFINITY);
    /* AVX-512: 16 numerators at a time, the same operations and sums (attend_avx512.c) */
    const int64_t done = qd_kernel_isa(-1) ? qd_softmax_avx512(p, lanes, best, &total) : 0;
    for (int64_t i = done; i < lanes; i += 8) {
        const __m256 v = _mm256_loadu_ps(p + i);
        const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(v, hidden, _CMP_EQ_OQ), exp8(_mm256_sub_ps(v, top)));
        _mm256_storeu_ps(p + i, e);
        total = _mm256_add_ps(total, e);
    }
    return 1.0f / lanes_sum(total);
}

/* pack_scores' loop over slots from .. to - 1, appending at p[n], seen[n]: the new n. */
static inline int64_t pack_slots(const float *sc, const float *mrow, int64_t from, int64_t to, float scale, float *p,
                                 int64_t *seen, int64_t n, float *best) {
    for (int64_t s = from; s < to; s++) {
        if (mrow && mrow[s] == -INFINITY)
            continue;
        const float score = sc[s] * scale + (mrow ? mrow[s] : 0.0f);
        seen[n] = s;
        p[n++] = score;
        if (score > *best)
            *best = score;
    }
    return n;
}

/* A query's visible scores, packed in slot order: p[n] = sc[s] * scale + mask for the n-th
 * slot s the mask row shows (all where mrow is NULL), seen[n] = s; returns n, and their
 * maximum in *best (-inf: none visible). Packed, key n of the pack sums into lane n % 8:
 * a tree node's ancestors sit at other slots than the same tokens after acceptance
 * (packed behind the cache), so summing by slot would round the softmax total differently
 * from the plain step that later sees them; by rank it is the same sequence of float
 * operations, bit for bit (8-bit activations would magnify one ulp). */
static int64_t pack_scores(const float *sc, const float *mrow, int64_t kv_len, float scale, float *p,
                           int64_t *seen, float *best) {
    *best = -INFINITY;
    return pack_slots(sc, mrow, 0, kv_len, scale, p, seen, 0, best);
}

/* pack_scores' result, 8 slots at a time where the mask shows all 8 or none (a causal
 * pass's rows are one run of visible slots; a tree's rows differ in its last slots only),
 * the slots between one by one as pack_scores takes them: the same p, seen and maximum
 * (a maximum is exact in any order; a NaN score, packed, is never the maximum in either).
 * One by one, packing was a third of attend_block's time for 9 queries over 1,100 keys.
 * *identity: 1 where the pack is slots 0 .. n - 1 (seen[k] = k, a causal row), and then
 * seen may be left unwritten (its stores were a third of the bytes packing wrote). */
static int64_t pack_scores8(const float *sc, const float *mrow, int64_t kv_len, float scale, float *p,
                            int64_t *seen, float *best, int *identity) {
    const __m256 scale8 = _mm256_set1_ps(scale), hidden = _mm256_set1_ps(-INFINITY);
    const __m256i first4 = _mm256_setr_epi64x(0, 1, 2, 3), next4 = _mm256_setr_epi64x(4, 5, 6, 7);
    __m256 top = hidden;
    int64_t n = 0, s = 0, skipped = 0; /* seen[0 .. skipped) left unwritten: slots 0 .. skipped - 1 */
    *best = -INFINITY;
    for (; s < kv_len; s += 8) {
        const __m256 m = mrow && s + 8 <= kv_len ? _mm256_loadu_ps(mrow + s) : _mm256_setzero_ps();
        const int gone = mrow ? _mm256_movemask_ps(_mm256_cmp_ps(m, hidden, _CMP_EQ_OQ)) : 0;
        if (s + 8 > kv_len || (gone != 0 && gone != 0xFF)) { /* a tail, or shown and hidden slots mixed */
            n = pack_slots(sc, mrow, s, s + 8 < kv_len ? s + 8 : kv_len, scale, p, seen, n, best);
            continue;
        }
        if (gone == 0xFF)
            continue;
        const __m256 score = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(sc + s), scale8), m);
        _mm256_storeu_ps(p + n, score);
        if (n == s && skipped == n) { /* still slots 0 .. n - 1: seen implied */
            skipped += 8;
        } else {
            const __m256i at = _mm256_set1_epi64x(s);
            _mm256_storeu_si256((__m256i *)(seen + n), _mm256_add_epi64(at, first4));
            _mm256_storeu_si256((__m256i *)(seen + n + 4), _mm256_add_epi64(at, next4));
        }
        top = _mm256_blendv_ps(top, score, _mm256_cmp_ps(score, top, _CMP_GT_OQ));
        n += 8;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++)
        if (lanes[i] > *best)
            *best = lanes[i];
    /* packed slots ascend: slots 0 .. n - 1 exactly when the last is n - 1 */
    *identity = n == 0 || n == skipped || seen[n - 1] == n - 1;
    for (int64_t k = 0; !*identity && k < skipped; k++)
        seen[k] = k;
    return n;
}

/* One query of one head, any d (attend_block takes d % 8 == 0). */
static void attend_one(const float *qv, int64_t d, const float *keys, const float *values, int64_t kv_len,
                       const float *mrow, float scale, float *o) {
    float *sc = malloc((size_t)kv_len * sizeof(float)), *p = malloc((size_t)((kv_len + 7) / 8 * 8) * sizeof(float));
    int64_t *seen = malloc((size_t)kv_len * sizeof(int64_t));
    for (int64_t s = 0; s < kv_len; s++)
        sc[s] = mrow && mrow[s] == -INFINITY ? 0.0f : dot(qv, keys + s * d, d);
    float best;
    const int64_t n = pack_scores(sc, mrow, kv_len, scale, p, seen, &best);
    if (best == -INFINITY) {
        memset(o, 0, (size_t)d * sizeof(float));
    } else {
        const float inv = softmax_packed(p, n, best);
        for (int64_t i = 0; i < d; i++)
            o[i] = 0.0f;
        for (int64_t k = 0; k < n; k++) {
            if (p[k] == 0.0f)  /* underflowed: contributes nothing, skip it */
                continue;
            const float w = p[k], *v = values + seen[k] * d;
            for (int64_t i = 0; i < d; i++)
                o[i] = fmaf(w, v[i], o[i]);
        }
        for (int64_t i = 0; i < d; i++)
            o[i] *= inv;
    }
    free(seen);
    free(p);
    free(sc);
}

/* o[0 .. 8 cn) = inv * sum_k p[k] v[seen[k]] over the nonzero p[k] in order, one FMA per
 * key, as attend_one (and attend_avx512.c), for chunks c0 .. c0 + cn - 1 of the values;
 * cn <= 8 chunks of 8, held in registers (inlined with cn = 8 a constant: a variable count
 * left them in memory). kv16: float16 values, widened as they are read. */
static inline __attribute__((always_inline)) void weighted_sum(const float *p, const int64_t *seen, int64_t n,
                                                                const void *values, int64_t c0, int kv16, int64_t d,
                                                                int64_t cn, float inv, float *o) {
    __m256 acc[8];
    for (int64_t c = 0; c < cn; c++)
        acc[c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; k++) {
        if (p[k] == 0.0f) /* underflowed: contributes nothing, skip it */
            continue;
        const __m256 w = _mm256_set1_ps(p[k]);
        const int64_t v = (seen ? seen[k] : k) * d + 8 * c0; /* this key's chunk c0 (NULL seen: slot k) */
        for (int64_t c = 0; c < cn; c++)
            acc[c] = _mm256_fmadd_ps(w, kv_load8(values, v + 8 * c, kv16), acc[c]);
    }
    const __m256 scaled = _mm256_set1_ps(inv);
    for (int64_t c = 0; c < cn; c++)
        _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], scaled));
}

/* 1 + the last slot below kv_len that mask row mrow shows (0: none); without a mask,
 * causal_end. */
static int64_t visible_end(const float *mrow, int64_t kv_len) {
    int64_t s = kv_len;
    const __m256 hidden = _mm256_set1_ps(-INFINITY);
    while (s >= 8 && _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(mrow + s - 8), hidden, _CMP_EQ_OQ)) == 0xff)
        s -= 8;
    while (s > 0 && mrow[s - 1] == -INFINITY)
        s--;
    return s;
}

/* 1 + the slot of query j (slots[j], or start + j where slots is NULL), below kv_len: the
 * end of what it sees without a mask. */
static int64_t causal_end(const int64_t *slots, int64_t start, int64_t j, int64_t kv_len) {
    const int64_t end = (slots ? slots[j] : start + j) + 1;
    return end < kv_len ? end : kv_len;
}

void qd_weighted_values_avx512(const float *const *w, int64_t kv_len, int nq, const float *values, int64_t d,
                               const float *inv, float *out, int64_t out_stride);
void qd_scores_avx512(const float *const *q, int nq, const float *keys, int64_t n8, int64_t d, float *scores,
                      int64_t stride);

/* Queries an attend_block task takes (of one head). */
#define QUERY_BLOCK 4

/* Queries j0 .. j0 + nq - 1 of head h (nq <= QUERY_BLOCK, d % 8 == 0): attend_one's
 * result for each, bit for bit (the same operations per query, in the same order). One
 * query at a time, a key's score was a chain of d / 8 dependent FMAs, and the weighted
 * sum of values reloaded and stored its output every key: a verify pass of 9 tokens
 * after 1,100 spent a fifth of its time here. Here the block's chains interleave over
 * each key read once, and the output sits in registers. Attention alone (a layer of the
 * embedded target, interleaved against attend_one in one process): 0.54-0.62x the time
 * for 9 queries over 1,100 keys, ~0.75x for one; the embedded target's whole pass of 9
 * tokens after 1,100 0.79x, after 128 0.95x, one token unchanged (its keys stream from
 * memory either way). Since then (session 33) keys go 8 at a time, 8 independent
 * chains for each query however few share the block, their sums reduced together
 * (lanes_sum4); and on AVX-512 a block of 2+ queries sums values in 16 lanes, each value
 * read once for the block (attend_avx512.c; one query stays on AVX2: 512-bit operations
 * made the one-token step slower). All bit for bit as before. The embedded target with
 * int8 weights after 1,000 tokens (scripts/step_ab.py build --quantize int8 --context
 * 1000): a 9-token pass 0.94x the time, a 3-token one 0.94x, one token 0.99x. (Before
 * the 8-key chains, a reduction of 8 keys' lanes at once and a weighted sum sharing each
 * value between the block's queries in 8 lanes were no faster; an FMA in the weighted
 * sum, which rounds differently, would take the 9-token pass to 0.89x.) A block scores
 * only the slots up to the last one its queries see: a causal prefill's query j sees j + 1,
 * and scoring all of them doubled the work (SmolLM2's attention in a 1,024-token prefill,
 * 30 layers: 716 ms before the session, 453 ms after). Session 34: on AVX-512 a block of
 * 2+ queries scores its keys two queries a 16-lane FMA (qd_scores_avx512), bit for bit;
 * the embedded target's 13-token pass after 1,150 tokens (int8) 0.90-0.95x the time.
 * Session 35: the weighted sums (here, attend_one and attend_avx512.c alike) take an FMA
 * per key, not a product and then a sum: a step and a pass still round alike, as every
 * path sums the same way (the outputs moved by an ulp from earlier builds'); blocks of 3-4
 * queries score two pairs at once and a head's queries split into even blocks where they
 * can (block_size). The 13-token pass after 1,100 tokens (int8, scripts/step_ab.py build):
 * 0.945x for the FMA, 0.88x for all three; one token unchanged. */
static inline __attribute__((always_inline)) void attend_block(
    const float *q, int64_t j0, int nq, int64_t h, int64_t hq, int64_t d, const void *keys, const void *values,
    int kv16, const int64_t *ends, const float *mask, int64_t mask_stride, float scale, float *out) {
    int64_t kv_len = 0; /* the slots up to the last one a query of the block sees */
    for (int b = 0; b < nq; b++)
        kv_len = ends[j0 + b] > kv_len ? ends[j0 + b] : kv_len;
    const int64_t chunks = d / 8, padded = (kv_len + 7) / 8 * 8;
    const float *qv[QUERY_BLOCK];
    for (int b = 0; b < nq; b++)
        qv[b] = q + ((j0 + b) * hq + h) * d;
    /* Every query's score of every key, masked or not (a masked one is dropped below):
     * keys 8 at a time, each query's 8 chains of FMAs side by side, then summed together. */
    float *scores = malloc((size_t)(nq * kv_len) * sizeof(float));
    int64_t s = 0;
    if (nq > 1 && !kv16 && d <= 128 && qd_kernel_isa(-1)) { /* two queries a 16-lane FMA, bit for bit */
        s = kv_len / 8 * 8;
        qd_scores_avx512(qv, nq, (const float *)keys, s, d, scores, kv_len);
    }
    for (; s + 8 <= kv_len; s += 8) {
        const int64_t key = s * d;
        for (int b = 0; b < nq; b++) {
            __m256 acc[8];
            for (int k = 0; k < 8; k++)
                acc[k] = _mm256_setzero_ps();
            for (int64_t c = 0; c < chunks; c++) {
                const __m256 qc = _mm256_loadu_ps(qv[b] + 8 * c);
                for (int k = 0; k < 8; k++)
                    acc[k] = _mm256_fmadd_ps(qc, kv_load8(keys, key + k * d + 8 * c, kv16), acc[k]);
            }
            _mm_storeu_ps(scores + b * kv_len + s, lanes_sum4(acc[0], acc[1], acc[2], acc[3]));
            _mm_storeu_ps(scores + b * kv_len + s + 4, lanes_sum4(acc[4], acc[5], acc[6], acc[7]));
        }
    }
    for (; s < kv_len; s++) {
        __m256 acc[QUERY_BLOCK];
        for (int b = 0; b < nq; b++)
            acc[b] = _mm256_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) { /* dot()'s chain, chunk by chunk, every query at once */
            const __m256 kc = kv_load8(keys, s * d + 8 * c, kv16);
            for (int b = 0; b < nq; b++)
                acc[b] = _mm256_fmadd_ps(_mm256_loadu_ps(qv[b] + 8 * c), kc, acc[b]);
        }
        for (int b = 0; b < nq; b++)
            scores[b * kv_len + s] = lanes_sum(acc[b]);
    }
    /* Each query's visible scores packed, their softmax numerators and 1 / total. */
    float *p = malloc((size_t)(nq * padded) * sizeof(float)), inv[QUERY_BLOCK];
    int64_t *seen = malloc((size_t)(nq * kv_len) * sizeof(int64_t)), n[QUERY_BLOCK];
    int identity[QUERY_BLOCK];
    for (int b = 0; b < nq; b++) {
        float best;
        n[b] = pack_scores8(scores + b * kv_len, mask ? mask + (j0 + b) * mask_stride : NULL, ends[j0 + b], scale,
                            p + b * padded, seen + b * kv_len, &best, identity + b);
        if (best == -INFINITY)
            n[b] = 0, inv[b] = 0.0f; /* no visible key: zeros (0 * 0 below) */
        else
            inv[b] = softmax_packed(p + b * padded, n[b], best);
    }
    float *o = out + (j0 * hq + h) * d;
    if (nq > 1 && !kv16 && qd_kernel_isa(-1) && d % 16 == 0) {
        /* Each query's numerators by slot, 0 where hidden (the block's queries share each
         * value read): packed as they are where the query sees every slot up to its last
         * (a causal pass; spreading them out was a tenth of a prefill's attention), else
         * spread out. */
        const float *rows[QUERY_BLOCK];
        float *spread = NULL;
        for (int b = 0; b < nq; b++) {
            float *packed = p + b * padded;
            if (identity[b]) { /* seen[k] = k: slots 0 .. n - 1 */
                memset(packed + n[b], 0, (size_t)(padded - n[b]) * sizeof(float));
                rows[b] = packed;
                continue;
            }
            if (!spread)
                spread = calloc((size_t)(nq * kv_len), sizeof(float));
            for (int64_t k = 0; k < n[b]; k++)
                spread[b * kv_len + seen[b * kv_len + k]] = packed[k];
            rows[b] = spread + b * kv_len;
        }
        qd_weighted_values_avx512(rows, kv_len, nq, (const float *)values, d, inv, o, hq * d);
        free(spread);
    } else {
        for (int b = 0; b < nq; b++, o += hq * d) {
            if (n[b] == 0) {
                memset(o, 0, (size_t)d * sizeof(float));
                continue;
            }
            const int64_t *rank = identity[b] ? NULL : seen + b * kv_len; /* NULL: slot k is key k */
            for (int64_t c0 = 0; c0 < chunks; c0 += 8) { /* attend_one's o += w v, 64 output floats in registers */
                if (chunks - c0 >= 8)
                    weighted_sum(p + b * padded, rank, n[b], values, c0, kv16, d, 8, inv[b], o + 8 * c0);
                else
                    weighted_sum(p + b * padded, rank, n[b], values, c0, kv16, d, chunks - c0, inv[b],
                                 o + 8 * c0);
            }
        }
    }
    free(seen);
    free(p);
    free(scores);
}

/* Queries in block b of the n_blocks = ceil(n / QUERY_BLOCK) blocks that n queries of a
 * head take: full blocks, then the rest split into an even block and an odd one (n = 13:
 * 4, 4, 3, 2), as AVX-512 scores keys two queries at a time: 13 as 3, 3, 3, 4 left a
 * query alone in three of the four blocks. */
static int64_t block_size(int64_t n, int64_t b, int64_t n_blocks) {
    const int64_t rest = n - QUERY_BLOCK * (n_blocks - 1); /* 1 .. QUERY_BLOCK */
    if (rest == QUERY_BLOCK || rest == 2 || n_blocks == 1)
        return b < n_blocks - 1 ? QUERY_BLOCK : rest;
    /* rest 1 or 3: the last full block and the rest as 3 + 2 (rest 1) or 4 + 3 (rest 3) */
    if (b < n_blocks - 2)
        return QUERY_BLOCK;
    const int64_t pair = QUERY_BLOCK + rest; /* the last two blocks' queries: 5 or 7 */
    return b == n_blocks - 2 ? pair - pair / 2 : pair / 2;
}

/* One row of a pass: t queries, their new keys and values in qkv [t, (hq + 2 hkv) * d]
 * (q heads, then k heads, then v heads). Stores the rotated keys and the values at cache
 * slots slots[j] (or start + j when slots is NULL) of k_cache / v_cache ([hkv, max_len, d],
 * this layer's and this row's), then attends: query j sees slot s < kv_len where mask
 * [t, mask_stride] (additive, -inf = hidden) allows it; without a mask (NULL), the slots
 * up to its own (causal: a chain or a prefill after the cache, and a one-token step sees
 * them all), with the result bit for bit that of the causal mask, which costs a pass
 * building it (~30 us) and attention reading it. cos / ssin:
 * [t, d] or NULL (no rotation). out: [t, hq * d]. Query j with no visible slot gets 0.
 * kv16: the cache holds float16 (stored rounded to nearest even, read back exactly): each
 * thread widens a kv head's slots into float32 before attending over them, so attention
 * is the float32 cache's, bit for bit, over the rounded keys and values. */
void qd_attend(const float *qkv, int64_t t, int64_t hq, int64_t hkv, int64_t d,
               const float *cos, const float *ssin, void *k_cache, void *v_cache, int64_t max_len, int64_t kv16,
               const int64_t *slots, int64_t start, int64_t kv_len,
               const float *mask, int64_t mask_stride, float *out, int threads) {
    const int64_t width = (hq + 2 * hkv) * d, group = hq / hkv;
    float *q = malloc((size_t)(t * (hq + (kv16 ? hkv : 0)) * d) * sizeof(float));
    float *rotated = q + t * hq * d; /* kv16: a token's rotated keys before they are rounded */
    QD_FOR_IF(t >= MANY_ROWS && threads > 1, j, t, {
        const float *row = qkv + j * width;
        const int64_t slot = slots ? slots[j] : start + j;
        for (int64_t h = 0; h < hq + hkv; h++) {
            const int64_t at = ((h - hq) * max_len + slot) * d; /* a key head's cache element */
            float *dst = h < hq ? q + (j * hq + h) * d : kv16 ? rotated + (j * hkv + h - hq) * d : (float *)k_cache + at;
            if (cos)
                rope(row + h * d, cos + j * d, ssin + j * d, d, dst);
            else
                memcpy(dst, row + h * d, (size_t)d * sizeof(float));
            if (kv16 && h >= hq)
                store_half((uint16_t *)k_cache + at, dst, d);
        }
        for (int64_t h = 0; h < hkv; h++) {
            const int64_t at = (h * max_len + slot) * d;
            if (kv16)
                store_half((uint16_t *)v_cache + at, row + (hq + hkv + h) * d, d);
            else
                memcpy((float *)v_cache + at, row + (hq + hkv + h) * d, (size_t)d * sizeof(float));
        }
    });
    const float scale = 1.0f / sqrtf((float)d);
    /* Threads only where the work outweighs waking them; the result is the same either way. */
    const int parallel = threads > 1 && t * hq * kv_len * d >= (1 << 17);
    if (d % 8 == 0) {
        /* Where each query's visible slots end: a causal prefill's query j sees j + 1 of
         * them, and scoring the hidden rest doubled its attention's work. */
        int64_t *ends = malloc((size_t)t * sizeof(int64_t));
        for (int64_t j = 0; j < t; j++)
            ends[j] = mask ? visible_end(mask + j * mask_stride, kv_len) : causal_end(slots, start, j, kv_len);
        /* Each thread takes an equal, contiguous share of the (head, query) pairs, head by
         * head, in blocks of at most QUERY_BLOCK queries of a head (each key read once for a
         * block, see attend_block). Whole blocks of 4 per task left 9 queries of 7 heads as
         * 21 tasks, 35 queries on one thread and 28 on the other. Each query's result is the
         * same whatever block it falls in. */
#pragma omp parallel num_threads(threads) if (parallel)
        {
            const int64_t total = hq * t, share = omp_get_num_threads(), id = omp_get_thread_num();
            const int64_t hi = total * (id + 1) / share;
            /* kv16: one query reads float16 as it goes; a pass of 2+ has each thread widen a kv
             * head's keys and values to float32 once for its blocks (each reads them again) */
            const int read16 = kv16 && t == 1;
            float *wide = kv16 && !read16 ? malloc((size_t)(2 * kv_len * d) * sizeof(float)) : NULL;
            int64_t widened = -1;
            for (int64_t i = total * id / share; i < hi;) {
                const int64_t h = i / t, head_end = (h + 1) * t < hi ? (h + 1) * t : hi;
                const int64_t n = head_end - i, n_blocks = (n + QUERY_BLOCK - 1) / QUERY_BLOCK;
                const void *keys, *values;
                if (wide) {
                    if (h / group != widened) {
                        widened = h / group;
                        load_half(wide, (const uint16_t *)k_cache + widened * max_len * d, kv_len * d);
                        load_half(wide + kv_len * d, (const uint16_t *)v_cache + widened * max_len * d, kv_len * d);
                    }
                    keys = wide, values = wide + kv_len * d;
                } else {
                    keys = kv_at(k_cache, h / group * max_len * d, kv16);
                    values = kv_at(v_cache, h / group * max_len * d, kv16);
                }
                for (int64_t b = 0, j0 = i % t; b < n_blocks; b++) {
                    const int64_t nq = block_size(n, b, n_blocks);
                    switch (nq) { /* each block size its own specialization */
#define BLOCK_CASE(c, half) attend_block(q, j0, c, h, hq, d, keys, values, half, ends, mask, mask_stride, scale, out)
                    case 1: /* read16: a one-token pass, so one query a block */
                        if (read16)
                            BLOCK_CASE(1, 1);
                        else
                            BLOCK_CASE(1, 0);
                        break;
                    case 2: BLOCK_CASE(2, 0); break;
                    case 3: BLOCK_CASE(3, 0); break;
                    case 4: BLOCK_CASE(4, 0); break;
#undef BLOCK_CASE
                    }
                    j0 += nq;
                }
                i = head_end;
            }
            free(wide);
        }
        free(ends);
        free(q);
        return;
    }
    /* kv16: every kv head's slots widened first (a head size that is not a multiple of 8 is rare) */
    float *wide = kv16 ? malloc((size_t)(2 * hkv * kv_len * d) * sizeof(float)) : NULL;
    for (int64_t h = 0; wide && h < hkv; h++) {
        load_half(wide + h * kv_len * d, (const uint16_t *)k_cache + h * max_len * d, kv_len * d);
        load_half(wide + (hkv + h) * kv_len * d, (const uint16_t *)v_cache + h * max_len * d, kv_len * d);
    }
    const float *keys = wide ? wide : (const float *)k_cache, *values = wide ? wide + hkv * kv_len * d : v_cache;
    const int64_t stride = wide ? kv_len : max_len;
    QD_FOR_IF(parallel, task, t * hq, {
        const int64_t j = task / hq, h = task % hq, kvh = h / group;
        attend_one(q + task * d, d, keys + kvh * stride * d, values + kvh * stride * d,
                   mask ? kv_len : causal_end(slots, start, j, kv_len), mask ? mask + j * mask_stride : NULL, scale,
                   out + (j * hq + h) * d);
    });
    free(wide);
    free(q);
}

/* A whole pre-norm Llama block for one row of a pass, composed of the calls above and the
 * products of qmatmul.c: the same kernels, in the same order, as the model's per-op path
 * (Block.forward with the fused ops), so the result is the same bit for bit; what it
 * saves is the Python and PyTorch calls between them (~100 us a layer). */
void qd_q8_matmul(const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t N, float *y, int threads);
void qd_q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t N, float *y, int threads);
void qd_f32_matmul(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int threads);
void qd_bf16_matmul(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y, int threads);
void qd_f16_matmul(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y, int threads);
void qd_bf16dp_matmul(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y, int threads);

/* One linear layer's weights: kind 0 float32 [out, in], 1 int8 blocks (q8a8.h), 2 int4
 * blocks (q4a8.h; both hold their scales), 3 bfloat16 [out, in], 4 float16 [out, in], 6
 * bfloat16 [out, in] times bfloat16-rounded x (bf16_products.c); bias may be NULL. (5, a
 * drafter's own int8 kernel, was retired.) */
typedef struct {
    int64_t kind, in, out;
    const void *q;
    const float *bias;
} QdLinear;

static void linear(const QdLinear *l, const float *x, int64_t m, float *y, int threads) {
    if (l->kind == 0)
        qd_f32_matmul(x, m, l->in, (const float *)l->q, l->out, y, threads);
    else if (l->kind == 1)
        qd_q8_matmul(x, m, l->in, (const uint8_t *)l->q, l->out, y, threads);
    else if (l->kind == 3)
        qd_bf16_matmul(x, m, l->in, (const uint16_t *)l->q, l->out, y, threads);
    else if (l->kind == 4)
        qd_f16_matmul(x, m, l->in, (const uint16_t *)l->q, l->out, y, threads);
    else if (l->kind == 6)
        qd_bf16dp_matmul(x, m, l->in, (const uint16_t *)l->q, l->out, y, threads);
    else
        qd_q4_matmul(x, m, l->in, (const uint8_t *)l->q, l->out, y, threads);
    if (l->bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t n = 0; n < l->out; n++)
                y[r * l->out + n] = y[r * l->out + n] + l->bias[n];
}

/* The rows of a pass, each attending on its own: the row's tokens at offset .. offset +
 * tokens - 1 of the pass, its keys and values in the cache row `cache` elements into a
 * layer's cache, at `slots` (NULL: start, start + 1, ...), its queries attending over the
 * first kv_len slots with an additive mask of mask_stride floats a query (NULL: causal, as
 * qd_attend reads it). One
 * row is a plain pass; several are a ragged pass of the batched engine, which packs its
 * rows' tokens one after another (Transformer.forward(ragged=...)). */
typedef struct {
    int64_t offset, tokens, cache;
    const int64_t *slots;
    int64_t start, kv_len;
    const float *mask;
    int64_t mask_stride;
} QdRows;

/* x [t, hidden] -> y [t, hidden] (y = x + attn(norm(x)); y = y + mlp(norm(y))), each row's
 * attention a qd_attend call on its tokens; tokens no row holds (a packed pass's padding)
 * attend to nothing (0), as the per-op path's zeroed output leaves them. */
static void block_rows(const float *x, int64_t t, int64_t hidden, const float *attn_norm, const float *mlp_norm,
                       float eps, const QdLinear *wqkv, const QdLinear *wo, const QdLinear *w_in,
                       const QdLinear *w_out, int64_t hq, int64_t hkv, int64_t d, const float *cos,
                       const float *ssin, void *k_cache, void *v_cache, int64_t max_len, int64_t kv16,
                       const QdRows *rows, int64_t n_rows, float *y, int threads) {
    int64_t widest = wqkv->out > w_in->out ? wqkv->out : w_in->out;
    if (hidden > widest)
        widest = hidden;
    float *a = malloc((size_t)(t * widest) * sizeof(float)), *b = malloc((size_t)(t * widest) * sizeof(float));
    const int split = t >= MANY_ROWS && threads > 1; /* a prefill: per-row work shared too (same result) */
    QD_FOR_IF(split, r, t, { qd_rms_norm(x + r * hidden, 1, hidden, attn_norm, eps, a + r * hidden); });
    linear(wqkv, a, t, b, threads);
    if (n_rows != 1 || rows[0].offset != 0 || rows[0].tokens != t)
        memset(a, 0, (size_t)(t * hq * d) * sizeof(float));
    const int64_t width = (hq + 2 * hkv) * d;
    for (int64_t r = 0; r < n_rows; r++) {
        const QdRows *row = rows + r;
        qd_attend(b + row->offset * width, row->tokens, hq, hkv, d, cos ? cos + row->offset * d : NULL,
                  ssin ? ssin + row->offset * d : NULL, kv_at(k_cache, row->cache, kv16),
                  kv_at(v_cache, row->cache, kv16), max_len, kv16, row->slots, row->start, row->kv_len, row->mask, row->mask_stride, a + row->offset * hq * d,
                  threads);
    }
    linear(wo, a, t, b, threads);
    QD_FOR_IF(split, r, t, {
        for (int64_t i = r * hidden; i < (r + 1) * hidden; i++)
            y[i] = x[i] + b[i];
        qd_rms_norm(y + r * hidden, 1, hidden, mlp_norm, eps, a + r * hidden);
    });
    linear(w_in, a, t, b, threads);
    const int64_t inner = w_in->out / 2;
    QD_FOR_IF(split, r, t, { qd_silu_mul(b + r * 2 * inner, 1, inner, a + r * inner); });
    linear(w_out, a, t, b, threads);
    QD_FOR_IF(split, i, t * hidden, { y[i] = y[i] + b[i]; });
    free(a);
    free(b);
}

/* x [t, hidden] -> y [t, hidden] for one row: block_rows with the attention arguments of
 * qd_attend. */
void qd_block(const float *x, int64_t t, int64_t hidden, const float *attn_norm, const float *mlp_norm, float eps,
              const QdLinear *wqkv, const QdLinear *wo, const QdLinear *w_in, const QdLinear *w_out,
              int64_t hq, int64_t hkv, int64_t d, const float *cos, const float *ssin,
              void *k_cache, void *v_cache, int64_t max_len, int64_t kv16, const int64_t *slots, int64_t start,
              int64_t kv_len, const float *mask, int64_t mask_stride, float *y, int threads) {
    const QdRows one = {0, t, 0, slots, start, kv_len, mask, mask_stride};
    block_rows(x, t, hidden, attn_norm, mlp_norm, eps, wqkv, wo, w_in, w_out, hq, hkv, d, cos, ssin, k_cache, v_cache,
               max_len, kv16, &one, 1, y, threads);
}

/* Blocks 0 .. n-1 of a Llama stack over one row, in one call: qd_block layer after layer,
 * in place in y (qd_block reads each element of its input before it writes that element
 * of its output, and nothing of the input after), so the same result bit for bit as n
 * qd_block calls; what it saves is the Python between them (~30 us a layer). norms: 2
 * per layer (attention, MLP); linears: 4 per layer (qkv, output, gate/up, down); layer l's
 * cache l * layer_stride elements after k_cache / v_cache; the rest as qd_block. */
void qd_blocks(const float *x, int64_t t, int64_t hidden, int64_t n, const float *const *norms, float eps,
               const QdLinear *linears, int64_t hq, int64_t hkv, int64_t d, const float *cos, const float *ssin,
               void *k_cache, void *v_cache, int64_t layer_stride, int64_t max_len, int64_t kv16, const int64_t *slots,
               int64_t start, int64_t kv_len, const float *mask, int64_t mask_stride, float *y, int threads) {
    memmove(y, x, (size_t)(t * hidden) * sizeof(float));
    for (int64_t l = 0; l < n; l++) {
        const QdLinear *lin = linears + 4 * l;
        qd_block(y, t, hidden, norms[2 * l], norms[2 * l + 1], eps, lin, lin + 1, lin + 2, lin + 3, hq, hkv, d, cos,
                 ssin, kv_at(k_cache, l * layer_stride, kv16), kv_at(v_cache, l * layer_stride, kv16), max_len, kv16,
                 slots, start, kv_len, mask, mask_stride, y, threads);
    }
}

/* qd_blocks over the rows of a ragged pass (QdRows: each row's tokens, cache row, slots and
 * mask), the batched engine's: the same operations as the per-op path's row loop
 * (Attention._fused), bit for bit, in one call. */
void qd_blocks_ragged(const float *x, int64_t t, int64_t hidden, int64_t n, const float *const *norms, float eps,
                      const QdLinear *linears, int64_t hq, int64_t hkv, int64_t d, const float *cos,
                      const float *ssin, void *k_cache, void *v_cache, int64_t layer_stride, int64_t max_len,
                      int64_t kv16, const QdRows *rows, int64_t n_rows, float *y, int threads) {
    memmove(y, x, (size_t)(t * hidden) * sizeof(float));
    for (int64_t l = 0; l < n; l++) {
        const QdLinear *lin = linears + 4 * l;
        block_rows(y, t, hidden, norms[2 * l], norms[2 * l + 1], eps, lin, lin + 1, lin + 2, lin + 3, hq, hkv, d, cos,
                   ssin, kv_at(k_cache, l * layer_stride, kv16), kv_at(v_cache, l * layer_stride, kv16), max_len, kv16,
                   rows, n_rows, y, threads);
    }
}

/* The index of the largest of n logits, as torch.argmax picks it: the first maximum, a NaN
 * above everything (the first NaN). ids (NULL: 0 .. n-1) name the logits; only those below
 * vocab count, and ties go to the smaller id. None counting: 0 (torch.argmax of a row of
 * -inf, which is what the model's logits are outside ids and vocab). */
/* The maximum of x[0 .. n) (a maximum is exact in any order) and whether one is NaN. */
static float row_max(const float *x, int64_t n, int *has_nan) {
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, v);
    }
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int j = 0; j < 8; j++)
        best = lanes[j] > best ? lanes[j] : best;
    *has_nan = _mm256_movemask_ps(nan) != 0;
    for (; i < n; i++) {
        *has_nan |= isnan(x[i]);
        best = x[i] > best ? x[i] : best;
    }
    return best;
}

/* The id of the largest of n logits, as torch.argmax picks it over the logits spread to the
 * vocabulary: ids (NULL: 0 .. n-1) name them, only those below vocab count, ties go to the
 * smaller id, a NaN is above everything (the smallest NaN id). None counting: 0. The fast
 * way: the maximum of all n, then the smallest counted id among the logits equal to it,
 * which is the answer whenever one of them counts and none is NaN (element by element, a
 * drafter's 2,048-logit head took ~5 us a level); else the rule element by element. */
static int64_t argmax_logits(const float *logits, int64_t n, const int64_t *ids, int64_t vocab) {
    int has_nan;
    const float top = row_max(logits, n, &has_nan);
    int64_t best = -1;
    if (!has_nan) {
        const __m256 b = _mm256_set1_ps(top);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8)
            for (unsigned hit = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(logits + j), b, _CMP_EQ_OQ));
                 hit; hit &= hit - 1) {
                const int64_t id = ids ? ids[j + __builtin_ctz(hit)] : j + __builtin_ctz(hit);
                if (id < vocab && (best < 0 || id < best))
                    best = id;
            }
        for (; j < n; j++) {
            const int64_t id = ids ? ids[j] : j;
            if (logits[j] == top && id < vocab && (best < 0 || id < best))
                best = id;
        }
        if (best >= 0)
            return best;
    }
    float kept = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const int64_t id = ids ? ids[j] : j;
        if (id >= vocab)
            continue;
        const float v = logits[j];
        int better;
        if (best < 0)
            better = 1;
        else if (isnan(kept))
            better = isnan(v) && id < best;
        else if (isnan(v) || v > kept)
            better = 1;
        else
            better = v == kept && id < best;
        if (better) {
            best = id;
            kept = v;
        }
    }
    return best < 0 ? 0 : best;
}

/* argmax_logits as a library call (the chains call it inline; tests check its rule). */
int64_t qd_argmax_ids(const float *logits, int64_t n, const int64_t *ids, int64_t vocab) {
    return argmax_logits(logits, n, ids, vocab);
}

/* out[r] = torch.argmax(x[r * stride .. + n)) for rows r < rows: the first maximum, or
 * the first NaN where a row has one (NaN counts above everything), 0 for a row of -inf.
 * Why: torch's argmax took ~100 us for a 13-token verify pass's logits over 8,192 ids
 * (scalar, 1.7 ns an element) and ~15 us for a plain step's one row; here one vector
 * sweep finds the maximum (and notes a NaN), a second finds its first place. */
void qd_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        int has_nan;
        const float best = row_max(row, n, &has_nan);
        int64_t at = 0;
        if (has_nan) { /* the first NaN */
            while (!isnan(row[at]))
                at++;
        } else if (n > 0) { /* the first element equal to the maximum (-0 == +0, as torch's > sees them) */
            const __m256 b = _mm256_set1_ps(best);
            at = n;
            for (int64_t j = 0; j + 8 <= n && at == n; j += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), b, _CMP_EQ_OQ));
                if (hit)
                    at = j + __builtin_ctz((unsigned)hit);
            }
            for (int64_t j = n / 8 * 8; at == n && j < n; j++)
                if (row[j] == best) /* (a row of -inf: best is -inf, found at 0, as torch gives) */
                    at = j;
        }
        out[r] = at;
    }
}

/* The softmax's largest probability over the logits argmax_logits reads (ids below vocab):
 * 1 / sum_j exp(l_j - max). What a --draft-stop confidence floor compares (the drafter's
 * Python loop: q = softmax(logits), q.max()), within float rounding: it sets how long a
 * chain is, never which tokens it holds. */
static float top_probability(const float *logits, int64_t n, const int64_t *ids, int64_t vocab) {
    float top = -INFINITY, sum = 0.0f;
    if (ids == NULL) {
        const int64_t len = n < vocab ? n : vocab;
        for (int64_t j = 0; j < len; j++)
            top = logits[j] > top ? logits[j] : top;
        __m256 acc = _mm256_setzero_ps();
        const __m256 shift = _mm256_set1_ps(top);
        int64_t j = 0;
        for (; j + 8 <= len; j += 8)
            acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(logits + j), shift)));
        sum = lanes_sum(acc);
        for (; j < len; j++)
            sum += expf(logits[j] - top);
    } else {
        for (int64_t j = 0; j < n; j++)
            if (ids[j] < vocab && logits[j] > top)
                top = logits[j];
        for (int64_t j = 0; j < n; j++)
            if (ids[j] < vocab)
                sum += expf(logits[j] - top);
    }
    return sum > 0.0f ? 1.0f / sum : 0.0f;
}

/* qd_forward's pass, also handing out the states after taps[0] < taps[1] < ... blocks (each
 * in 1 .. n_layers - 1; n_taps 0: none) side by side in tapped [m, n_taps * hidden]: an
 * EAGLE-3 drafter's fused layers. The blocks run in one qd_blocks call per stretch between
 * the taps, as Transformer.forward's stretches do: the same arithmetic, bit for bit. */
int64_t qd_forward_tapped(const float *embed, int64_t hidden, int64_t n_layers, const float *const *norms,
                          float eps, const QdLinear *linears, int64_t hq, int64_t hkv, int64_t d, const float *cos,
                          const float *ssin, void *k_cache, void *v_cache, int64_t layer_stride, int64_t max_len,
                          int64_t kv16, int64_t start, const float *final_norm, float final_eps,
                          const QdLinear *head, int64_t n_embed, const int64_t *tokens, int64_t m, float *x,
                          int64_t rows, float *logits, const int64_t *taps, int64_t n_taps, float *tapped,
                          int threads) {
    for (int64_t j = 0; j < m; j++)
        if (tokens[j] < 0 || tokens[j] >= n_embed)
            return -1;
    for (int64_t j = 0; j < m; j++)
        memcpy(x + j * hidden, embed + tokens[j] * hidden, (size_t)hidden * sizeof(float));
    for (int64_t c = 0, done = 0; c <= n_taps; c++) {
        const int64_t upto = c < n_taps ? taps[c] : n_layers;
        qd_blocks(x, m, hidden, upto - done, norms + 2 * done, eps, linears + 4 * done, hq, hkv, d, cos, ssin,
                  kv_at(k_cache, done * layer_stride, kv16), kv_at(v_cache, done * layer_stride, kv16), layer_stride,
                  max_len, kv16, NULL, start, start + m, NULL, 0, x, threads); /* causal (qd_attend) */
        if (c < n_taps)
            for (int64_t j = 0; j < m; j++)
                memcpy(tapped + (j * n_taps + c) * hidden, x + j * hidden, (size_t)hidden * sizeof(float));
        done = upto;
    }
    if (rows > 0) {
        float *h = malloc((size_t)(rows * hidden) * sizeof(float));
        qd_rms_norm(x + (m - rows) * hidden, rows, hidden, final_norm, final_eps, h);
        linear(head, h, rows, logits, threads);
        free(h);
    }
    return 0;
}

/* One causal pass of a Llama model over batch row 0, in one call: the m tokens' embedding
 * rows (into x [m, hidden]), the n_layers blocks at positions and cache slots start ..
 * start + m - 1 (qd_blocks, in place in x: x ends as the final hidden state, before the
 * norm), then the final RMSNorm and the head over the last `rows` of them into logits
 * [rows, head->out] (rows 0: no logits). What Transformer.forward computes for such a pass
 * (the same kernels in the same order, so the same result bit for bit) without the
 * Python between its parts: ~0.5 ms of a SmolLM2 step, run cold after the weights'
 * stream has evicted the interpreter from the caches. cos / ssin: the RoPE rows of
 * positions start .. start + m - 1. A token outside the embedding's n_embed rows: nothing
 * written, -1 returned (the caller's PyTorch path raises its error); else 0. */
int64_t qd_forward(const float *embed, int64_t hidden, int64_t n_layers, const float *const *norms, float eps,
                   const QdLinear *linears, int64_t hq, int64_t hkv, int64_t d, const float *cos, const float *ssin,
                   void *k_cache, void *v_cache, int64_t layer_stride, int64_t max_len, int64_t kv16, int64_t start,
                   const float *final_norm, float final_eps, const QdLinear *head, int64_t n_embed,
                   const int64_t *tokens, int64_t m, float *x, int64_t rows, float *logits, int threads) {
    return qd_forward_tapped(embed, hidden, n_layers, norms, eps, linears, hq, hkv, d, cos, ssin, k_cache, v_cache,
                             layer_stride, max_len, kv16, start, final_norm, final_eps, head, n_embed, tokens, m, x,
                             rows, logits, NULL, 0, NULL, threads);
}

static int is_stop(int64_t token, const int64_t *stop_ids, int64_t n_stop) {
    for (int64_t j = 0; j < n_stop; j++)
        if (token == stop_ids[j])
            return 1;
    return 0;
}

/* A greedy draft chain of a Llama model over one row, in one call. First, if m > 0, the
 * feed: tokens feed[0 .. m-1] (what the model's cache lacks) at positions and cache slots
 * start - m .. start - 1 in one causal m-row pass (qd_forward, as the model's forward over
 * them), and tokens[0] = the argmax of its last row's logits (the final RMSNorm, the head);
 * with m = 0 the caller gives tokens[0]. Then for i = 0 .. n-1, feed tokens[i] at position
 * and cache slot start + i (qd_forward: embedding row, blocks, the final RMSNorm, the head) and
 * write its argmax to tokens[i + 1]. What the model's forward and torch.argmax give a step
 * at a time (the same kernels in the same order), without returning to Python between the
 * steps (~130 us a step of the embedded draft, ~0.2 ms for the feed's forward). cos /
 * ssin: the RoPE tables from position start - m on, [m + n, d]; head_ids (NULL: none) the
 * vocabulary of a restricted head (head->out ids); vocab: only ids below it are drafted.
 * min_confidence > 0 (--draft-stop confidence:T, dv): the chain ends at the first token
 * tokens[i], i < n, whose top_probability is below it (that token still drafted, nothing
 * fed after it), as the Python loop's keep_going does. stop_ids (n_stop of them, NULL for
 * none): the chain also ends at the first token that is one of them (plain decoding's EOS
 * ids: nothing is computed past the end of the text). Returns how many tokens it wrote
 * (n + 1 unless it ended early; the cache then holds the first count - 1 after the feed). */
int64_t qd_greedy_chain(const float *embed, int64_t hidden, int64_t n_layers, const float *const *norms, float eps,
                     const QdLinear *linears, int64_t hq, int64_t hkv, int64_t d, const float *cos, const float *ssin,
                     void *k_cache, void *v_cache, int64_t layer_stride, int64_t max_len, int64_t kv16, int64_t start,
                     const float *final_norm, float final_eps, const QdLinear *head, const int64_t *head_ids,
                     int64_t vocab, const int64_t *feed, int64_t m, int64_t *tokens, int64_t n, float min_confidence,
                     const int64_t *stop_ids, int64_t n_stop, int threads) {
    float *x = malloc((size_t)hidden * sizeof(float)), *logits = malloc((size_t)head->out * sizeof(float));
    int64_t count = n + 1;
    if (m > 0) {
        float *fx = malloc((size_t)(m * hidden) * sizeof(float));
        qd_forward(embed, hidden, n_layers, norms, eps, linears, hq, hkv, d, cos, ssin, k_cache, v_cache, layer_stride,
                   max_len, kv16, start - m, final_norm, final_eps, head, INT64_MAX, feed, m, fx, 1, logits, threads);
        tokens[0] = argmax_logits(logits, head->out, head_ids, vocab);
        free(fx);
    }
    for (int64_t i = 0; i < n; i++) {
        /* (With m = 0 the caller drew tokens[0]: its logits are not here to weigh.) */
        if ((min_confidence > 0.0f && (m > 0 || i > 0) &&
             top_probability(logits, head->out, head_ids, vocab) < min_confidence) ||
            is_stop(tokens[i], stop_ids, n_stop)) {
            count = i + 1;
            break;
        }
        qd_forward(embed, hidden, n_layers, norms, eps, linears, hq, hkv, d, cos ? cos + (m + i) * d : NULL,
                   ssin ? ssin + (m + i) * d : NULL, k_cache, v_cache, layer_stride, max_len, kv16, start + i,
                   final_norm, final_eps, head, INT64_MAX, tokens + i, 1, x, 1, logits, threads);
        tokens[i + 1] = argmax_logits(logits, head->out, head_ids, vocab);
    }
    free(x);
    free(logits);
    return count;
}

/* models/eagle.py's UNIT_RMS_EPS: the epsilon of every unit-RMS feature fc reads. */
#define QD_UNIT_RMS_EPS 1e-6f

/* fc's input for one token of an EAGLE drafter: [embed[token] * embed_scale ; feature /
 * rms(feature)] (a zero feature stays zero). */
static void eagle_input(const float *embed, float embed_scale, int64_t hidden, int64_t token, const float *feature,
                        float *in) {
    const float *e = embed + token * hidden;
    for (int64_t j = 0; j < hidden; j++)
        in[j] = e[j] * embed_scale;
    qd_rms_norm(feature, 1, hidden, NULL, QD_UNIT_RMS_EPS, in + hidden);
}

/* An EAGLE drafter's greedy chain (models/eagle.py) in one call. First, if m > 0, the feed:
 * the m tokens the target accepted since the last proposal (feed_tokens), each with the
 * target's feature of the token before it (feed_features [m, hidden]), through fc and the
 * drafter's block at cache slots start - m .. start - 1, causally, in one m-row pass; its
 * last output becomes `feature` ([hidden], written). Then n tokens, each the argmax of
 * head(final_norm(feature)) (a reduced head's row index mapped through head_ids); after
 * each token but the last, one level: x = fc([embed[token] * embed_scale ; feature /
 * rms(feature)]), the block at cache slot start + i, and x becomes the next feature. cos /
 * ssin: [m + n - 1, d] (the feed's positions, then the levels'). With feature_in (a drafter
 * narrower than its target), feed_features are the target's own states [m, feature_in->in]
 * (feature_chunks states of one layer each, side by side), mapped here as
 * EagleHead.from_target maps them (each state at unit RMS, then feature_in). What the drafter's Python
 * extend and levels compute, up to float rounding (a drafter's rounding never changes what
 * the target accepts); it saves ~0.35 ms of Python and PyTorch calls a level. min_confidence
 * > 0: the chain ends at the first token before the last whose top_probability is below it,
 * as qd_greedy_chain's does. Returns how many tokens it wrote. */
int64_t qd_eagle_chain(const float *embed, float embed_scale, int64_t hidden, const QdLinear *fc,
                    const float *const *norms, float eps, const QdLinear *linears, int64_t hq, int64_t hkv, int64_t d,
                    const float *cos, const float *ssin, void *k_cache, void *v_cache, int64_t layer_stride,
                    int64_t max_len, int64_t kv16, int64_t start, const float *final_norm, float final_eps, const QdLinear *head,
                    const int64_t *head_ids, int64_t vocab, float *feature, const int64_t *feed_tokens,
                    const float *feed_features, const QdLinear *feature_in, int64_t feature_chunks, int64_t m,
                    int64_t *tokens, int64_t n, float min_confidence, int threads) {
    float *in = malloc((size_t)(2 * hidden) * sizeof(float)), *x = malloc((size_t)hidden * sizeof(float));
    float *h = malloc((size_t)hidden * sizeof(float)), *logits = malloc((size_t)head->out * sizeof(float));
    if (m > 0) {
        float *fin = malloc((size_t)(2 * m * hidden) * sizeof(float)), *fx = malloc((size_t)(m * hidden) * sizeof(float));
        float *mapped = NULL;
        if (feature_in != NULL) {
            float *unit = malloc((size_t)(m * feature_in->in) * sizeof(float));
            mapped = malloc((size_t)(m * hidden) * sizeof(float));
            qd_rms_norm(feed_features, m * feature_chunks, feature_in->in / feature_chunks, NULL, QD_UNIT_RMS_EPS, unit);
            linear(feature_in, unit, m, mapped, threads);
            free(unit);
            feed_features = mapped;
        }
        for (int64_t j = 0; j < m; j++)
            eagle_input(embed, embed_scale, hidden, feed_tokens[j], feed_features + j * hidden, fin + j * 2 * hidden);
        linear(fc, fin, m, fx, threads);
        qd_blocks(fx, m, hidden, 1, norms, eps, linears, hq, hkv, d, cos, ssin, k_cache, v_cache, layer_stride,
                  max_len, kv16, NULL, start - m, start, NULL, 0, fx, threads); /* causal (qd_attend) */
        memcpy(feature, fx + (m - 1) * hidden, (size_t)hidden * sizeof(float));
        free(mapped);
        free(fin);
        free(fx);
    }
    for (int64_t i = 0; i < n; i++) {
        qd_rms_norm(feature, 1, hidden, final_norm, final_eps, h);
        linear(head, h, 1, logits, threads);
        tokens[i] = argmax_logits(logits, head->out, head_ids, vocab);
        if (i + 1 == n)
            break;
        if (min_confidence > 0.0f && top_probability(logits, head->out, head_ids, vocab) < min_confidence) {
            n = i + 1;
            break;
        }
        eagle_input(embed, embed_scale, hidden, tokens[i], feature, in);
        linear(fc, in, 1, x, threads);
        qd_blocks(x, 1, hidden, 1, norms, eps, linears, hq, hkv, d, cos ? cos + (m + i) * d : NULL,
                  ssin ? ssin + (m + i) * d : NULL, k_cache, v_cache, layer_stride, max_len, kv16, NULL, start + i,
                  start + i + 1, NULL, 0, feature, threads);
    }
    free(in);
    free(x);
    free(h);
    free(logits);
    return n;
}

/* Prompt lookup (drafters/ngram.py's NgramDrafter.lookup without a datastore) over seq[0 ..
 * n): the longest tail of ngram_max down to ngram_min tokens that occurred earlier, and at
 * most k tokens after its occurrence (the latest with k tokens after it, else the earliest)
 * into out. Returns how many (0: no match). */
static int64_t ngram_lookup(const int64_t *seq, int64_t n, int64_t k, int64_t ngram_max, int64_t ngram_min,
                            int64_t *out) {
    for (int64_t g = ngram_max < n - 1 ? ngram_max : n - 1; g >= ngram_min; g--) {
        const size_t bytes = (size_t)g * sizeof(int64_t);
        const int64_t *tail = seq + n - g;
        int64_t at = -1;
        for (int64_t s = n - k - g; s >= 0 && at < 0; s--) /* inside tokens 0 .. n - k - 1 */
            if (memcmp(seq + s, tail, bytes) == 0)
                at = s;
        for (int64_t s = 0; at < 0 && s + g <= n - 1; s++) /* inside tokens 0 .. n - 2 */
            if (memcmp(seq + s, tail, bytes) == 0)
                at = s;
        if (at < 0)
            continue;
        const int64_t begin = at + g, count = n - begin < k ? n - begin : k;
        memcpy(out, seq + begin, (size_t)count * sizeof(int64_t));
        return count;
    }
    return 0;
}

/* A --draft-stop policy's state in qd_spec_rounds (drafters/draft_stop.py's rounds_state):
 * p[0] its kind (0 fixed, 1 confidence:T, 2 dv, 3 heuristic), p[1] the confidence floor
 * (confidence, dv), p[2] dv's smoothed acceptance, p[3 .. 6] dv's target, eps, beta1 and
 * beta2, p[7] dv's most drafts, p[8] heuristic's n (-1: not set yet), p[9] dv's cap of the
 * last chain, heuristic's largest k. The Python classes' arithmetic, in double and in their
 * order, so the chains' lengths and the state after the rounds are theirs. NULL: fixed. */
static int64_t stop_depth(double *p, int64_t k) { /* max_depth */
    if (p != NULL && p[0] == 2) {
        p[9] = k < p[7] ? (double)k : p[7];
        return (int64_t)p[9];
    }
    if (p != NULL && p[0] == 3) {
        if (p[8] < 0)
            p[8] = (double)k;
        if (k > p[9])
            p[9] = (double)k;
        return p[8] < k ? (int64_t)p[8] : k;
    }
    return k;
}

static float stop_floor(const double *p) { /* the floor the chain applies token by token */
    return p != NULL && (p[0] == 1 || p[0] == 2) ? (float)p[1] : 0.0f;
}

static void stop_observe(double *p, int64_t drafted, int64_t accepted) { /* observe */
    if (p == NULL || drafted <= 0)
        return;
    if (p[0] == 2) {
        p[2] = p[5] * p[2] + (1 - p[5]) * (double)accepted / (double)drafted;
        const double goal = p[2] < p[3] ? p[1] + p[4] : (double)drafted >= p[9] ? p[1] : p[1] - p[4];
        p[1] = p[6] * p[1] + (1 - p[6]) * goal;
    } else if (p[0] == 3 && p[8] >= 0) {
        const double n = p[8] + (accepted == drafted ? 2 : -1);
        p[8] = n < 1 ? 1 : n < p[9] ? n : p[9];
    }
}

/* Greedy speculative rounds of the decode loop (decoding/engine.py) in one call, for a chain
 * drafter: prompt lookup (ngram_min > 0) when it matches, else an EAGLE drafter's chain
 * (e_embed non-NULL: hybrid-eagle, or eagle alone with ngram_min = 0) or a draft model's
 * greedy chain (g_embed non-NULL: hybrid, draft; qd_greedy_chain, fed the tokens its cache
 * lacks, at most depth long; g_cos / g_ssin: its RoPE tables). Each round is
 * what the loop's Python does, in its order: k = min(k_max, remaining - 1, context - length
 * - 1) tokens may be drafted (none at 0); the chain (qd_eagle_chain, fed the tokens the
 * drafter lacks with the target's states of the tokens before them, min(k, depth) deep);
 * the target's pass over what its cache lacks plus the chain (qd_forward, the logits of the
 * chain's rows and the one before); the longest prefix of the chain each of whose tokens is
 * the argmax of the row before (qd_argmax_rows: torch.argmax's pick), then that argmax
 * after it; the accepted tokens' states into features. So the tokens and the caches are
 * those of the Python loop bit for bit; what it saves is the Python between the calls
 * (~0.7 ms a SmolLM2 round). The drafter (e_hidden wide: e_feature_in maps the target's
 * states where that differs) reads the target's final states, one row of hidden a token, or
 * (taps, n_taps > 0: an EAGLE-3 drafter's fused layers) the states after taps[0] < taps[1]
 * < ... blocks and the final one side by side, feature_width = (n_taps + 1) hidden.
 *
 * seq [capacity] holds state[0] tokens (the sequence: the settled tokens are written after
 * them); state = {length, the target's cache length, the EAGLE drafter's fed, known and
 * offset, the draft model's cache length}, updated. features [.., feature_width]: the
 * target's states the drafter reads, by position. cos / ssin: the target's RoPE tables from
 * position 0 (the EAGLE drafter's too). Rounds run until `chunk` tokens are
 * settled, the budget (`remaining` tokens) or the context is spent, a token in stop_ids is
 * settled, `max_rounds` rounds, or the drafter's cache has no room (returns; the caller's
 * loop goes on). records[3 r ..]: round r's drafted, accepted and settled counts. Returns the
 * rounds run, or -1 - rounds where the target's pass refused a token (nothing written).
 * policy (NULL: fixed): the drafter's --draft-stop state (stop_depth), updated after every
 * round its chain drafted (prompt lookup's rounds are not its own). */
int64_t qd_spec_rounds(const float *embed, int64_t hidden, int64_t n_layers, const float *const *norms, float eps,
                       const QdLinear *linears, int64_t hq, int64_t hkv, int64_t d, void *k_cache, void *v_cache,
                       int64_t layer_stride, int64_t max_len, int64_t kv16, const float *final_norm, float final_eps,
                       const QdLinear *head, int64_t n_embed,
                       const float *e_embed, float e_scale, int64_t e_hidden, const QdLinear *e_fc,
                       const float *const *e_norms,
                       float e_eps, const QdLinear *e_linears, int64_t e_hq, int64_t e_hkv, void *e_k_cache,
                       void *e_v_cache, int64_t e_layer_stride, int64_t e_max_len, int64_t e_kv16,
                       const float *e_final_norm, float e_final_eps, const QdLinear *e_head, const int64_t *e_head_ids,
                       int64_t e_vocab, float *e_feature, const QdLinear *e_feature_in, int64_t e_chunks,
                       const float *g_embed, int64_t g_hidden, int64_t g_n_layers, const float *const *g_norms,
                       float g_eps, const QdLinear *g_linears, int64_t g_hq, int64_t g_hkv, int64_t g_d,
                       const float *g_cos, const float *g_ssin, void *g_k_cache, void *g_v_cache,
                       int64_t g_layer_stride, int64_t g_max_len, int64_t g_kv16, const float *g_final_norm,
                       float g_final_eps, const QdLinear *g_head, const int64_t *g_head_ids, int64_t g_vocab,
                       const float *cos, const float *ssin, int64_t *seq, int64_t *state, float *features,
                       int64_t feature_width, const int64_t *taps, int64_t n_taps, int64_t k_max, int64_t depth,
                       int64_t ngram_max, int64_t ngram_min,
                       int64_t remaining, int64_t context, int64_t chunk, const int64_t *stop_ids, int64_t n_stop,
                       double *policy, int64_t *records, int64_t max_rounds, int threads) {
    int64_t length = state[0], cached = state[1], fed = state[2], known = state[3], drafted = state[5];
    const int64_t offset = state[4], vocab = head->out;
    int64_t *prop = malloc((size_t)(k_max + 1) * sizeof(int64_t)), *fedtok = NULL, *best = NULL;
    float *x = NULL, *tapx = NULL, *logits = malloc((size_t)((k_max + 1) * vocab) * sizeof(float));
    int64_t rounds = 0, settled = 0, refused = 0;
    while (rounds < max_rounds && settled < chunk && remaining > 0 && length < context) {
        const int64_t k0 = remaining - 1 < context - length - 1 ? remaining - 1 : context - length - 1;
        const int64_t k = k_max < k0 ? k_max : (k0 > 0 ? k0 : 0);
        int64_t n = 0, chained = 0; /* chained: the drafter's own chain drafted this round */
        if (k > 0 && ngram_min > 0)
            n = ngram_lookup(seq, length, k, ngram_max, ngram_min, prop);
        if (k > 0 && n == 0 && e_embed != NULL && depth > 0 && known >= length - 1) {
            const int64_t levels = stop_depth(policy, k < depth ? k : depth), m = length - fed, base = length - offset;
            if (m < 1 || base < m || base + levels - 1 > e_max_len)
                break; /* (EagleHead.greedy_chain's refusals: the caller drafts in Python) */
            n = qd_eagle_chain(e_embed, e_scale, e_hidden, e_fc, e_norms, e_eps, e_linears, e_hq, e_hkv, d,
                               cos + (length - m) * d, ssin + (length - m) * d, e_k_cache, e_v_cache, e_layer_stride,
                               e_max_len, e_kv16, base, e_final_norm, e_final_eps, e_head, e_head_ids, e_vocab,
                               e_feature, seq + fed, features + (fed - 1) * feature_width, e_feature_in, e_chunks, m,
                               prop, levels, stop_floor(policy), threads);
            fed = length;
            chained = 1;
        }
        if (k > 0 && n == 0 && g_embed != NULL && depth > 0) { /* a draft model's (NativeLM.greedy_chain) */
            const int64_t levels = stop_depth(policy, k < depth ? k : depth), lacks = length - drafted;
            if (lacks < 1 || length + levels - 1 > g_max_len)
                break; /* (Transformer.greedy_chain's refusals: the caller drafts in Python) */
            n = qd_greedy_chain(g_embed, g_hidden, g_n_layers, g_norms, g_eps, g_linears, g_hq, g_hkv, g_d,
                                g_cos + drafted * g_d, g_ssin + drafted * g_d, g_k_cache, g_v_cache, g_layer_stride,
                                g_max_len, g_kv16, length, g_final_norm, g_final_eps, g_head, g_head_ids, g_vocab,
                                seq + drafted, lacks, prop, levels - 1, stop_floor(policy), NULL, 0, threads);
            drafted = length + n - 1; /* the chain's last token is not fed */
            chained = 2;
        }
        const int64_t lead = length - cached, m = lead + n;
        fedtok = realloc(fedtok, (size_t)m * sizeof(int64_t));
        x = realloc(x, (size_t)(m * hidden) * sizeof(float));
        if (n_taps > 0)
            tapx = realloc(tapx, (size_t)(m * n_taps * hidden) * sizeof(float));
        best = realloc(best, (size_t)(n + 1) * sizeof(int64_t));
        memcpy(fedtok, seq + cached, (size_t)lead * sizeof(int64_t));
        memcpy(fedtok + lead, prop, (size_t)n * sizeof(int64_t));
        if (qd_forward_tapped(embed, hidden, n_layers, norms, eps, linears, hq, hkv, d, cos + cached * d,
                              ssin + cached * d, k_cache, v_cache, layer_stride, max_len, kv16, cached, final_norm,
                              final_eps, head, n_embed, fedtok, m, x, n + 1, logits, taps, n_taps, tapx, threads)) {
            refused = 1;
            break;
        }
        qd_argmax_rows(logits, n + 1, vocab, vocab, best);
        int64_t path = 0;
        while (path < n && prop[path] == best[path])
            path++;
        cached = length + path;
        if (chained == 2 && drafted > length + (path < n - 1 ? path : n - 1))
            drafted = length + (path < n - 1 ? path : n - 1); /* its accepted tokens stay */
        if (chained)
            stop_observe(policy, n, path);
        if (e_embed != NULL) { /* the drafter's observe: the kept tokens' states (taps first) */
            for (int64_t j = 0; j < lead + path; j++) {
                float *row = features + (length - lead + j) * feature_width;
                if (n_taps > 0)
                    memcpy(row, tapx + j * n_taps * hidden, (size_t)(n_taps * hidden) * sizeof(float));
                memcpy(row + n_taps * hidden, x + j * hidden, (size_t)hidden * sizeof(float));
            }
            known = length + path;
        }
        memcpy(seq + length, prop, (size_t)path * sizeof(int64_t));
        seq[length + path] = best[path];
        records[3 * rounds] = n;
        records[3 * rounds + 1] = path;
        records[3 * rounds + 2] = path + 1;
        rounds++;
        int stop = 0;
        for (int64_t j = 0; j <= path && !stop; j++)
            stop = is_stop(seq[length + j], stop_ids, n_stop);
        length += path + 1;
        settled += path + 1;
        remaining -= path + 1;
        if (stop)
            break;
    }
    state[0] = length;
    state[1] = cached;
    state[2] = fed;
    state[3] = known;
    state[5] = drafted;
    free(prop);
    free(fedtok);
    free(best);
    free(x);
    free(tapx);
    free(logits);
    return refused ? -1 - rounds : rounds;
}
