/* Uniform and Gamma draws from Philox4x32-10 (philox.h) for the Python side (apg/random.py).
 *
 * philox_uniform: out[2 j + s] = uniform s of block (key; j, 0), s = 0, 1; the PyTorch
 *   twin draws the same numbers. Threads only from 2^15 numbers: below, a parallel region
 *   costs about what it saves. philox_block: the four words of one block, for the tests'
 *   known-answer vectors (in/out: c0 c1 c2 c3 k0 k1, words as uint32).
 * philox_standard_gamma: out[e] ~ Gamma(alpha[e], 1), gamma.h's draw of element e; the PyTorch
 *   twin (apg.random.standard_gamma) takes the same steps in float64.
 */
#include <stdint.h>

#include "gamma.h"
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

#define GAMMA(name, T)                                                                    \
    void name(long key, const T *alpha, T *out, long n) {                                 \
        _Pragma("omp parallel for schedule(static) if (n > (1 << 14))")                     \
        for (long e0 = 0; e0 < n; e0 += GAMMA_BLOCK) {                                    \
            const long m = n - e0 < GAMMA_BLOCK ? n - e0 : GAMMA_BLOCK;                    \
            double a[GAMMA_BLOCK], g[GAMMA_BLOCK];                                        \
            for (long j = 0; j < m; ++j) a[j] = alpha[e0 + j];                            \
            gamma_block((uint64_t)key, e0, m, a, g);                                      \
            for (long j = 0; j < m; ++j) out[e0 + j] = (T)g[j];                           \
        }                                                                                 \
    }

GAMMA(philox_standard_gamma_f32, float)
GAMMA(philox_standard_gamma_f64, double)
