/* Uniform and Gamma draws from Philox4x32-10 (philox.h) for the Python side (apg/random.py).
 *
 * philox_uniform: out[2 j + s] = uniform s of block (key; j, 0), s = 0, 1; the PyTorch
 *   twin draws the same numbers. Threads only from 2^15 numbers: below, a parallel region
 *   costs about what it saves. philox_block: the four words of one block, for the tests'
 *   known-answer vectors (in/out: c0 c1 c2 c3 k0 k1, words as uint32).
 * philox_standard_gamma: out[e] ~ Gamma(alpha[e], 1) (see gamma_try below); the PyTorch
 *   twin (apg.random.standard_gamma) takes the same steps in float64.
 */
#include <math.h>
#include <stdint.h>

#include "philox.h"

#define FILL(name, T, uniform2)                                             \
    void name(long key, T *out, long n) {                                   \
        _Pragma("omp parallel for schedule(static) if (n > (1 << 15))")       \
        for (long j = 0; j < n / 2; ++j)                                    \
            uniform2((uint64_t)key, (uint64_t)j, 0, &out[2 * j], &out[2 * j + 1]); \
        if (n % 2) {                                                        \
            T spare;                                                        \
            uniform2((uint64_t)key, (uint64_t)(n / 2), 0, &out[n - 1], &spare); \
        }                                                                   \
    }

FILL(philox_uniform_f32, float, philox_uniform2f)
FILL(philox_uniform_f64, double, philox_uniform2d)

void philox_block(uint32_t *v) { philox4x32_10(&v[0], &v[1], &v[2], &v[3], v[4], v[5]); }

/* Marsaglia & Tsang (ACM TOMS 26(3), 2000) for shape a1 >= 1, d = a1 - 1/3, c = 1/sqrt(9 d):
 * try k of element e takes the float64 uniforms (u1, u2) of block (key; e, 2k) and (u3, u4)
 * of block (key; e, 2k + 1); x = sqrt(-2 log(1 - u1)) cos(2 pi u2) (Box-Muller), v = (1 + c x)^3,
 * accepted when v > 0 and log u3 < x^2 / 2 + d - d v + d log v, giving d v. For a < 1 the
 * draw is Gamma(a + 1) u4^(1/a) with the accepted try's u4, which the test never reads.
 * Everything runs in float64 for both dtypes, so the two builds and the twin agree to
 * rounding. Acceptance is at least 95% for a1 >= 1: the first try of a block of elements
 * runs as one vector loop (torch's own sampler is a serial loop, ~0.1 us per value here),
 * and the few rejected elements then try again one at a time, GAMMA_TRIES at most (a shape
 * that is NaN or not positive never accepts: its draw is NaN, as torch's is). */
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

#define GAMMA(name, T)                                                                           \
    void name(long key, const T *alpha, T *out, long n) {                                        \
        _Pragma("omp parallel for schedule(static) if (n > (1 << 14))")                            \
        for (long e0 = 0; e0 < n; e0 += GAMMA_BLOCK) {                                           \
            const long m = n - e0 < GAMMA_BLOCK ? n - e0 : GAMMA_BLOCK;                           \
            double a[GAMMA_BLOCK], d[GAMMA_BLOCK], c[GAMMA_BLOCK], g[GAMMA_BLOCK], ub[GAMMA_BLOCK]; \
            int ok[GAMMA_BLOCK];                                                                 \
            for (long j = 0; j < m; ++j) {                                                       \
                a[j] = alpha[e0 + j];                                                            \
                d[j] = (a[j] < 1 ? a[j] + 1 : a[j]) - 1.0 / 3;                                   \
                c[j] = 1 / sqrt(9 * (d[j] > 0 ? d[j] : 1));                                      \
                ok[j] = gamma_try((uint64_t)key, (uint64_t)(e0 + j), 0, d[j], c[j], &g[j], &ub[j]); \
            }                                                                                    \
            for (long j = 0; j < m; ++j) {                                                       \
                const int valid = a[j] > 0 && a[j] < INFINITY;                                   \
                for (uint32_t k = 1; valid && !ok[j] && k < GAMMA_TRIES; ++k)                    \
                    ok[j] = gamma_try((uint64_t)key, (uint64_t)(e0 + j), k, d[j], c[j], &g[j], &ub[j]); \
                double v = g[j];                                                                 \
                if (a[j] < 1) v *= pow(ub[j], 1 / a[j]);                                         \
                out[e0 + j] = valid && ok[j] ? (T)v : (T)NAN;                                    \
            }                                                                                    \
        }                                                                                        \
    }

GAMMA(philox_standard_gamma_f32, float)
GAMMA(philox_standard_gamma_f64, double)
