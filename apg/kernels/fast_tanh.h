/* Float32 tanh for the compiled kernels (tanh_layers.c, rings.c): one of any argument, and
 * one of a sum of two parts each computed once.
 *
 * An odd/even [9/8] rational minimax fit on [0, 9] (relative error 2e-8 in exact
 * arithmetic; at most 3.9e-7 absolute evaluated in float32 vector code, against 1.1e-7 for
 * glibc's tanhf), the argument clamped to +-9, where tanh rounds to +-1 within one ulp.
 * Inline and branch-free, so a vector of points costs ~12 fused multiply-adds and one
 * division: about 1.4x faster than libmvec's tanhf in the kernels' loops. Float64 code
 * keeps libm's tanh (the gradchecks run in float64).
 */
#ifndef APG_FAST_TANH_H
#define APG_FAST_TANH_H

#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float fast_tanhf(float v) {
    const float x = v > 9.0f ? 9.0f : (v < -9.0f ? -9.0f : v), x2 = x * x;
    const float p = x + x * x2 * (1.338398308e-01f + x2 * (3.498999169e-03f
                    + x2 * (2.066131310e-05f + x2 * 1.341989186e-08f)));
    const float q = 1 + x2 * (4.671730399e-01f + x2 * (2.589021809e-02f
                    + x2 * (3.291043395e-04f + x2 * 7.804757729e-07f)));
    return p / q;
}

/* The exp-product tanh of a sum, for layers whose pre-activation is a + b with a from one
 * set (points) and b from another (particles and clusters): with ea = exp(2 a) and
 * eb = exp(2 b) computed once per element of each set, tanh(a + b) = 1 - 2 / (1 + ea eb)
 * costs one fused multiply-add, a reciprocal (rcp14 and one fused Newton step) and one more
 * fused op per pair, against fast_tanhf's ~12 fused ops and a reciprocal. Its absolute
 * error is at most half the relative error of 1 + ea eb (d tanh / d ln(ea eb) <= 1/2) plus
 * the reciprocal's rounding: 2.0e-7 at most on a dense grid (3.6e-7 with the plain division
 * of builds without AVX-512), against 3.3e-7 for fast_tanhf. It needs both exps normal and
 * finite (-ffast-math assumes no inf) and exact parts (clamping a = 25, b = -24 would be
 * wrong): exp2_checked refuses any part beyond EXP_TANH_MAX, and the caller then takes
 * fast_tanhf. |parts| <= 20 keeps ea eb within [e^-80, e^80], normal floats. */
#define EXP_TANH_MAX 20.0f

/* out[k] = exp(2 v[k]) for k < n (libmvec's vector expf), returning 1; returns 0 (out
 * unset) where some |v| > EXP_TANH_MAX. */
static inline int exp2_checked(const float *v, long n, float *out) {
    float m = 0;
    for (long k = 0; k < n; ++k) m = fmaxf(m, fabsf(v[k]));
    if (!(m <= EXP_TANH_MAX)) return 0;
    for (long k = 0; k < n; ++k) out[k] = expf(2 * v[k]);
    return 1;
}

/* t[k] = tanh(a_k + b) = 1 - 2 / (1 + ea[k] eb) for k < n, n a multiple of 16. GCC turns
 * the vector division into rcp14 and a Newton step under -ffast-math too, but with unfused
 * products (up to 2.9e-7 error in t); the fused step here gives 2.0e-7, in fewer ops. */
static inline void exp_pair_tanh(const float *ea, float eb, float *t, long n) {
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1), two = _mm512_set1_ps(2), b = _mm512_set1_ps(eb);
    for (long k = 0; k < n; k += 16) {
        const __m512 d = _mm512_fmadd_ps(_mm512_loadu_ps(ea + k), b, one);
        __m512 r = _mm512_rcp14_ps(d);
        r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, one), r);
        _mm512_storeu_ps(t + k, _mm512_fnmadd_ps(two, r, one));
    }
#else
    for (long k = 0; k < n; ++k) t[k] = 1 - 2 / (1 + ea[k] * eb);
#endif
}

#endif
