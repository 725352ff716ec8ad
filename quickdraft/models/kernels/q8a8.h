/* int8 weights times 8-bit activations (llama.cpp's Q8_0 x Q8_0 rule), in tiles of 16
 * weight rows: the layout and rule qmatmul.c (AVX2) and qmatmul_avx512.c (AVX-512 VNNI)
 * both compute, and the activation quantizer they (and q4a8.h) share.
 * y [M, N] = x [M, K] @ W.T for int8 W in groups of 32 along K with a float32 scale each.
 *
 * x is quantized first, per row and group of 32 (q8a8_quantize): d = max|x| / 127,
 * xq = x / d rounded to nearest even, as llama.cpp quantizes activations for Q8_0
 * weights (it stores d in float16; here float32). A group's product is then an exact
 * integer sum I = sum(q * xq), and output (m, n) is computed in one vector lane, group
 * after group: acc = fma(float(I), scale * d, acc), with no sum across lanes. So each
 * output's operations depend only on its own row of x and weight row, in a fixed order,
 * whatever the row count, the pass, the thread count or the instruction set: a row of a
 * k+1-row verify pass rounds as a one-row step does (what lossless speculative decoding
 * needs), and AVX2 and VNNI give the same bits.
 *
 * Layout (cpu_kernels.pack_q8 writes it): weight rows in tiles of 16 (N padded with zero
 * rows), one block of Q8_BLOCK_BYTES (576) per tile t and group g, at byte (t * G + g) *
 * 576, G = K / 32. Its first 512 bytes: eight chunks of 64 bytes, chunk h byte 4 * i + b =
 * q[16t + i][32g + 4h + b] + 128 (unsigned), so a chunk is one 16-lane vector of 4 weights
 * per row (lane i: row 16t + i) and a group is 8 byte products per lane with 4 bytes of x
 * broadcast. Then the 16 rows' scales (float32). VNNI multiplies unsigned bytes by signed
 * ones: it takes q + 128 times xq and subtracts 128 * sum(xq) of the row and group (exact
 * integers, the same I); AVX2 flips q + 128 back to q and takes |q| times xq with q's sign,
 * |q| <= 128, |xq| <= 127, so its 16-bit pair sums cannot saturate. One block, one stream
 * of memory, 1.125 bytes a weight (session 42: weights, float32 scales and int32 shifts
 * of 128 * the weight sum had been three arrays, 1.25 bytes a weight; q4a8.h has figures).
 *
 * Why tiles: with one weight row after another (the layout before, two groups a vector,
 * summed across lanes at the end) every group cost a conversion, a multiply and an FMA per
 * row for 64 weights; here a row's 32 weights of 16 outputs cost 8 integer instructions
 * and 3 float ones, so several-row products (verify passes) cost much less.
 */
#ifndef QD_Q8A8_H
#define QD_Q8A8_H

#include <stdlib.h>

/* Weight rows a tile of int8 or int4 weights holds (a 512-bit vector of float32 lanes),
 * and the bytes of one group of 32 weights of a tile. */
#define Q_TILE 16
#define Q8_TILE_BYTES (Q_TILE * GROUP)          /* a tile's weights of one group */
#define Q8_BLOCK_BYTES (Q8_TILE_BYTES + Q_TILE * 4) /* then its 16 float32 scales */

/* Row r of x [M, K] -> xq [M, K] int8 and dx [M, K / 32], group by group. Scalar-exact
 * operations only (max, divide, round, convert), so every instruction set gets the same
 * bytes. */
static void q8a8_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, int threads) {
    QD_FOR_IF(M >= MANY_ROWS && threads > 1, i, M * K / GROUP, {
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
    });
}

/* The activations' side of an int8 or int4 product: x quantized (xq [M, K], dx [M, G])
 * and, with `sums`, each row and group's sum(xq) (qs [M, G]: int8 on VNNI, q8 blocks) and
 * s = d * sum(xq) (sx [M, G]: int4, q4a8.h); NULL without. */
typedef struct {
    int8_t *xq;
    float *dx, *sx;
    int32_t *qs;
} QInput;

static QInput q_input(const float *x, int64_t M, int64_t K, int sums, int threads) {
    const int64_t groups = K / GROUP;
    QInput in = {malloc((size_t)(M * K)), malloc((size_t)(M * groups) * sizeof(float)),
                 sums ? malloc((size_t)(M * groups) * sizeof(float)) : NULL,
                 sums ? malloc((size_t)(M * groups) * sizeof(int32_t)) : NULL};
    q8a8_quantize(x, M, K, in.xq, in.dx, threads);
    QD_FOR_IF(sums && M >= MANY_ROWS && threads > 1, i, sums ? M * groups : 0, {
        int32_t sum = 0;
        for (int j = 0; j < GROUP; j++) sum += in.xq[i * GROUP + j];
        in.qs[i] = sum;
        in.sx[i] = in.dx[i] * (float)sum;
    });
    return in;
}

static void q_input_free(QInput in) {
    free(in.xq);
    free(in.dx);
    free(in.sx);
    free(in.qs);
}

#endif
