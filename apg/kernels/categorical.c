/* Categorical distributions over a short last axis (a handful of clusters), one per row.
 *
 * Assignment blocks have tens of thousands of rows of 3 or 4 logits. In eager PyTorch
 * their log-softmax, inverse-CDF draw and gather are a dozen small ops (each a pass over
 * memory, some looping one scalar row at a time); here each is one pass. Logits are
 * (R, K) contiguous; indices are int64.
 *
 * sample:   out[r] = first k with cumsum(softmax(logits[r]))[k] > u[r]
 * log_prob: out[r] = logits[r, idx[r]] - lse[r], and lse[r] = logsumexp(logits[r]) saved
 * log_prob_backward: glogits[r, k] = g[r] ((k == idx[r]) - exp(logits[r, k] - lse[r]))
 */
#include <math.h>

/* Logits may be -inf (an impossible category): keep IEEE infinities despite -ffast-math. */
#pragma GCC optimize("no-finite-math-only")

#define DEFINE_CATEGORICAL(T, EXP, LOG, SUFFIX)                                                \
void categorical_sample_##SUFFIX(const T *logits, const T *u, long *out, long R, long K) {     \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (long r = 0; r < R; ++r) {                                                             \
        const T *l = logits + r * K;                                                           \
        T m = l[0];                                                                            \
        for (long k = 1; k < K; ++k) m = l[k] > m ? l[k] : m;                                  \
        T total = 0;                                                                           \
        for (long k = 0; k < K; ++k) total += EXP(l[k] - m);                                   \
        /* scaled by the row's own total, so round-off can never step past the end */         \
        const T target = u[r] * total;                                                         \
        T cum = 0;                                                                             \
        long pick = K - 1;                                                                     \
        for (long k = 0; k < K - 1; ++k) {                                                     \
            cum += EXP(l[k] - m);                                                              \
            if (cum > target) { pick = k; break; }                                             \
        }                                                                                      \
        out[r] = pick;                                                                         \
    }                                                                                          \
}                                                                                              \
                                                                                               \
void categorical_log_prob_##SUFFIX(const T *logits, const long *idx, T *out, T *lse, long R,   \
                                   long K) {                                                   \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (long r = 0; r < R; ++r) {                                                             \
        const T *l = logits + r * K;                                                           \
        T m = l[0];                                                                            \
        for (long k = 1; k < K; ++k) m = l[k] > m ? l[k] : m;                                  \
        T total = 0;                                                                           \
        for (long k = 0; k < K; ++k) total += EXP(l[k] - m);                                   \
        lse[r] = m + LOG(total);                                                               \
        out[r] = l[idx[r]] - lse[r];                                                           \
    }                                                                                          \
}                                                                                              \
                                                                                               \
void categorical_log_prob_backward_##SUFFIX(const T *logits, const long *idx, const T *lse,    \
                                            const T *g, T *glogits, long R, long K) {          \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (long r = 0; r < R; ++r) {                                                             \
        const T *l = logits + r * K;                                                           \
        T *gl = glogits + r * K;                                                               \
        for (long k = 0; k < K; ++k) gl[k] = -g[r] * EXP(l[k] - lse[r]);                       \
        gl[idx[r]] += g[r];                                                                    \
    }                                                                                          \
}

DEFINE_CATEGORICAL(float, expf, logf, f32)
DEFINE_CATEGORICAL(double, exp, log, f64)
