#ifndef QD_EXP_POLY_H
#define QD_EXP_POLY_H

/* e^x to ~1 ulp over float's range (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in
 * r, 2^n through the exponent bits); x below -88 gives 0 or a tiny value. One body for 8
 * lanes (layer_ops.c's exp8) and 16 (attend_avx512.c's exp16): the same operations lane
 * by lane, so the same results, which the AVX-512 softmax relies on to round as the AVX2
 * one. W: the vector width (256 or 512); ROUND: that width's round-to-nearest. */
#define QD_EXP(W, ROUND, x_in)                                                                                 \
    __extension__({                                                                                            \
        __m##W x_ = _mm##W##_max_ps(_mm##W##_min_ps((x_in), _mm##W##_set1_ps(88.3762626647949f)),              \
                                    _mm##W##_set1_ps(-88.3762626647949f));                                     \
        const __m##W n_ = ROUND(_mm##W##_mul_ps(x_, _mm##W##_set1_ps(1.44269504088896341f)),                   \
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                \
        __m##W r_ = _mm##W##_fnmadd_ps(n_, _mm##W##_set1_ps(0.693359375f), x_);                                \
        r_ = _mm##W##_fnmadd_ps(n_, _mm##W##_set1_ps(-2.12194440e-4f), r_);                                    \
        __m##W y_ = _mm##W##_set1_ps(1.9875691500e-4f);                                                        \
        y_ = _mm##W##_fmadd_ps(y_, r_, _mm##W##_set1_ps(1.3981999507e-3f));                                    \
        y_ = _mm##W##_fmadd_ps(y_, r_, _mm##W##_set1_ps(8.3334519073e-3f));                                    \
        y_ = _mm##W##_fmadd_ps(y_, r_, _mm##W##_set1_ps(4.1665795894e-2f));                                    \
        y_ = _mm##W##_fmadd_ps(y_, r_, _mm##W##_set1_ps(1.6666665459e-1f));                                    \
        y_ = _mm##W##_fmadd_ps(y_, r_, _mm##W##_set1_ps(5.0000001201e-1f));                                    \
        y_ = _mm##W##_fmadd_ps(y_, _mm##W##_mul_ps(r_, r_), _mm##W##_add_ps(r_, _mm##W##_set1_ps(1.0f)));      \
        const __m##W##i bits_ = _mm##W##_slli_epi32(                                                           \
            _mm##W##_add_epi32(_mm##W##_cvtps_epi32(n_), _mm##W##_set1_epi32(127)), 23);                       \
        _mm##W##_mul_ps(y_, _mm##W##_castsi##W##_ps(bits_));                                                   \
    })

#endif
