/* int8 weights times 8-bit activations (llama.cpp's Q8_0 x Q8_0 dot product): the rule
 * qmatmul.c (AVX2) and qmatmul_avx512.c (AVX-512 VNNI) both compute, and the activation
 * quantizer they share. y [M, N] = x [M, K] @ W.T for int8 W in groups of 32 with a
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
 * row of a k+1-row pass rounds as a one-row step does). isum_g lane i is the exact sum of
 * the products of bytes 4i .. 4i+3 of the group (AVX2: maddubs then madd; VNNI: one
 * vpdpbusd); the sign trick (|w| times x with w's sign) keeps every operand of the byte
 * products in range: |w| <= 128, |xq| <= 127.
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

#endif
