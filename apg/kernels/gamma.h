/* Gamma(alpha, 1) draws from Philox4x32-10 (philox.h), for random.c (philox_standard_gamma)
 * and gmm.c (the NormalGamma proposals' draws); apg/random.py's standard_gamma is the twin.
 *
 * Marsaglia & Tsang (ACM TOMS 26(3), 2000) for shape a1 >= 1, d = a1 - 1/3, c = 1/sqrt(9 d):
 * try k of element e takes the float64 uniforms (u1, u2) of block (key; e, 2k) and (u3, u4)
 * of block (key; e, 2k + 1); x = sqrt(-2 log(1 - u1)) cos(2 pi u2) (Box-Muller), v = (1 + c x)^3,
 * accepted when v > 0 and log u3 < x^2 / 2 + d - d v + d log v, giving d v. For a < 1 the
 * draw is Gamma(a + 1) u4^(1/a) with the accepted try's u4, which the test never reads.
 * Everything runs in float64 for both dtypes, so the builds and the twin agree to rounding.
 * Acceptance is at least 95% for a1 >= 1: the first try of a block of elements runs as one
 * vector loop (torch's own sampler is a serial loop, ~0.1 us per value here), and the few
 * rejected elements then try again one at a time, GAMMA_TRIES at most. A shape that is not
 * positive and finite (checked on its bits: -ffast-math assumes no NaN or infinity) gets NaN.
 */
#ifndef APG_GAMMA_H
#define APG_GAMMA_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "philox.h"

#define GAMMA_TRIES 64
#define GAMMA_BLOCK 64

static inline __attribute__((always_inline)) int gamma_try(uint64_t key, uint64_t e, uint32_t k, double d,
                                                            double c, double *g, double *u_boost) {
    double u1, u2, u3, u4;
    philox_uniform2d(key, e, 2 * k, &u1, &u2);
    philox_uniform2d(key, e, 2 * k + 1, &u3, &u4);
    const double x = sqrt(-2 * log(1 - u1)) * cos(2 * M_PI * u2), t = 1 + c * x, v = t * t * t;
    *g = d * v;
    *u_boost = u4;
    return v > 0 && log(u3) < x * x / 2 + d - d * v + d * log(v > 0 ? v : 1);
}

/* a > 0 and finite, from its bits (exponent not all ones) so that -ffast-math cannot fold it. */
static inline int gamma_shape_valid(double a) {
    uint64_t bits;
    memcpy(&bits, &a, sizeof bits);
    return ((bits >> 52) & 0x7FF) != 0x7FF && a > 0;
}

/* out[j] ~ Gamma(a[j], 1) for the elements e0 + j, j < m <= GAMMA_BLOCK. */
static inline void gamma_block(uint64_t key, long e0, long m, const double *a, double *out) {
    double d[GAMMA_BLOCK], c[GAMMA_BLOCK], ub[GAMMA_BLOCK];
    int ok[GAMMA_BLOCK];
    for (long j = 0; j < m; ++j) {
        d[j] = (a[j] < 1 ? a[j] + 1 : a[j]) - 1.0 / 3;
        c[j] = 1 / sqrt(9 * (d[j] > 0 ? d[j] : 1));
        ok[j] = gamma_try(key, (uint64_t)(e0 + j), 0, d[j], c[j], &out[j], &ub[j]);
    }
    for (long j = 0; j < m; ++j) {
        const int valid = gamma_shape_valid(a[j]);
        for (uint32_t k = 1; valid && !ok[j] && k < GAMMA_TRIES; ++k)
            ok[j] = gamma_try(key, (uint64_t)(e0 + j), k, d[j], c[j], &out[j], &ub[j]);
        if (a[j] < 1) out[j] *= pow(ub[j], 1 / a[j]);
        if (!(valid && ok[j])) out[j] = NAN;
    }
}

#endif
