/* Systematic resampling in one pass per dataset.
 *
 * In eager PyTorch a resampling step is ~20 small ops on (L, B) tensors (softmax, cumsum,
 * searchsorted, the ancestors' flat row indices, the outgoing log-weights), and the
 * sampler resamples before every block update. apg/smc/resampling.py keeps the PyTorch
 * twin; tests run both.
 *
 * systematic_resample: for each dataset b, with w = softmax(log_w[:, b]) and its running
 *   sum cdf, particle j takes the first ancestor a with cdf[a] >= (u[b] + j) / L (the last
 *   one if round-off leaves cdf below the point). Writes ancestors (L, B), flat = a * B + b
 *   (rows of an (L * B, ...) view) and the outgoing log-weights (L, B), each the
 *   log-mean-exp of the incoming ones. log_w must have a finite maximum per dataset.
 *
 * systematic_resample_gather: the same draw (flat and outgoing log-weights), then tensors of
 *   the population gathered by ancestor in the same call: meta[t] = (source address,
 *   destination address, row bytes) of tensor t, an (L, B, ...) contiguous array whose
 *   (l, b) rows are copied (any dtype). In eager PyTorch a gather is three small ops per
 *   tensor, at every block update.
 *
 * This file includes itself once per dtype (T float, then double).
 */
#ifndef SMC_BODY
#define SMC_BODY

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define SMC_CAT_(a, b) a##b
#define SMC_CAT(a, b) SMC_CAT_(a, b)
#define S(name) SMC_CAT(name, SUFFIX)

#define T float
#define SUFFIX _f32
#define M(fn) fn##f
#include __FILE__
#undef T
#undef SUFFIX
#undef M

#define T double
#define SUFFIX _f64
#define M(fn) fn
#include __FILE__

#else /* the body, once per dtype */

void S(systematic_resample)(const T *log_w, const T *u, long *ancestors, long *flat, T *out_log_w, long L,
                            long B) {
    for (long b = 0; b < B; ++b) {
        T top = log_w[b];
        for (long l = 1; l < L; ++l) top = log_w[l * B + b] > top ? log_w[l * B + b] : top;
        T total = 0;
        for (long l = 0; l < L; ++l) total += M(exp)(log_w[l * B + b] - top);
        const T log_mean = top + M(log)(total) - M(log)((T)L);
        T cdf = M(exp)(log_w[b] - top) / total;
        long a = 0;
        for (long j = 0; j < L; ++j) {
            const T point = (u[b] + (T)j) / (T)L;
            while (a < L - 1 && cdf < point) {
                ++a;
                cdf += M(exp)(log_w[a * B + b] - top) / total;
            }
            ancestors[j * B + b] = a;
            flat[j * B + b] = a * B + b;
            out_log_w[j * B + b] = log_mean;
        }
    }
}

void S(systematic_resample_gather)(const T *log_w, const T *u, long *flat, T *out_log_w, const long *meta,
                                   long n_tensors, long L, long B) {
    long *ancestors = malloc(sizeof(long) * L * B);
    if (!ancestors) return; /* cannot happen at a population's sizes */
    S(systematic_resample)(log_w, u, ancestors, flat, out_log_w, L, B);
    for (long t = 0; t < n_tensors; ++t) {
        const char *from = (const char *)meta[3 * t];
        char *to = (char *)meta[3 * t + 1];
        const long rb = meta[3 * t + 2];
        for (long r = 0; r < L * B; ++r) memcpy(to + r * rb, from + flat[r] * rb, (size_t)rb);
    }
    free(ancestors);
}

#endif
