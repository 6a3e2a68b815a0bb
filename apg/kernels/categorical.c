/* Categorical distributions over a short last axis (a handful of clusters), one per row.
 *
 * Assignment blocks have tens of thousands of rows of 3 or 4 logits. In eager PyTorch
 * their log-softmax, inverse-CDF draw and gather are a dozen small ops (each a pass over
 * memory, some looping one scalar row at a time); here each is one pass. Logits are
 * (R, K) contiguous; indices are int64.
 *
 * Rows are processed in blocks of ROWS, transposed into a (K, ROWS) buffer, so that every
 * exp and log runs across rows in SIMD lanes (glibc's vector expf/logf): a row of 3 or 4
 * values alone would not vectorize. -inf logits (impossible categories) are fine: only
 * exp(-inf) = 0 is ever taken of them; a row needs one finite logit.
 *
 * sample:   out[r] = first k with cumsum(softmax(logits[r]))[k] > u[r]
 * log_prob: out[r] = logits[r, idx[r]] - lse[r], and lse[r] = logsumexp(logits[r]) saved
 * log_prob_backward: glogits[r, k] = g[r] ((k == idx[r]) - exp(logits[r, k] - lse[r]))
 *
 * The block distributions' passes (apg/distributions.py: CategoricalBlock), over G groups of
 * Nr rows (a group is one particle's points, R = G Nr):
 * sample_rows:   sample with u[r] = uniform r % 2 of Philox block (key; r / 2, 0) (the
 *                numbers apg.random.uniform draws), also writing lse[r]; no uniforms tensor.
 * rows_log_prob: out[g] = sum over the group's rows of logits[r, idx[r]] - lse[r], computing
 *                lse first where have_lse is 0; the block's log q is one pass, and the draw's
 *                lse serves both the new and the old values' scores.
 * rows_log_prob_backward: glogits[r, k] = g[r / Nr] ((k == idx[r]) - exp(logits[r, k] - lse[r])),
 *                exact zeros for groups with g = 0 (particles whose weight was flushed).
 * propose_rows:  sample_rows, then rows_log_prob of the drawn and of given old indices, in
 *                one pass (CategoricalBlock.propose: a block update's forward and reverse
 *                kernel at once).
 */
#include <math.h>
#include <stdint.h>

#include "philox.h"

#define ROWS 64
#define MAX_K 64 /* larger K falls back to one row at a time */

/* e[k][j] = exp(l[j, k] - max_k l[j, k]) for the rows of one block; returns via tot[j]
 * the row sums and via m[j] the maxima. */
#define DEFINE_BLOCK_EXP(T, EXP, SUFFIX)                                                       \
static inline void block_exp_##SUFFIX(const T *logits, long r0, long n, long K,               \
                                      T e[][ROWS], T *m, T *tot) {                             \
    for (long k = 0; k < K; ++k)                                                               \
        for (long j = 0; j < n; ++j) e[k][j] = logits[(r0 + j) * K + k];                       \
    for (long j = 0; j < n; ++j) m[j] = e[0][j];                                               \
    for (long k = 1; k < K; ++k)                                                               \
        for (long j = 0; j < n; ++j) m[j] = e[k][j] > m[j] ? e[k][j] : m[j];                   \
    for (long j = 0; j < n; ++j) tot[j] = 0;                                                   \
    for (long k = 0; k < K; ++k)                                                               \
        for (long j = 0; j < n; ++j) {                                                         \
            e[k][j] = EXP(e[k][j] - m[j]);                                                     \
            tot[j] += e[k][j];                                                                 \
        }                                                                                      \
}                                                                                               \
/* out[j] = the first k with cum_k = e[0][j] + .. + e[k][j] > u[j] tot[j] (K - 1 if none): as   \
 * cum_k never decreases, the number of k < K - 1 with cum_k <= u tot. The target is scaled by \
 * the row's own total, so round-off can never step past the end. */                          \
static inline void block_pick_##SUFFIX(T e[][ROWS], const T *tot, const T *u, long n, long K,  \
                                       long *out) {                                            \
    T cum[ROWS], target[ROWS];                                                                 \
    for (long j = 0; j < n; ++j) {                                                             \
        target[j] = tot[j] * u[j];                                                             \
        cum[j] = 0;                                                                            \
        out[j] = 0;                                                                            \
    }                                                                                          \
    for (long k = 0; k < K - 1; ++k)                                                           \
        for (long j = 0; j < n; ++j) {                                                         \
            cum[j] += e[k][j];                                                                 \
            out[j] += cum[j] <= target[j];                                                     \
        }                                                                                      \
}


/* The block distributions' passes (see the top of the file). K <= MAX_K only: the Python side
 * takes the per-row functions above for wider rows. Threads from 4096 values on (36,000 at
 * the paper's GMM sizes: see gmm.c's PAR_MIN_WORK for the measurement). */
#define DEFINE_ROWS(T, EXP, LOG, UNIFORMS, SUFFIX)                                             \
/* Rows r0 .. r0 + n (n <= ROWS) drawn: row r takes uniform r % 2 of Philox block (key; r / 2,  \
 * 0), whatever r0; out[r] and lse[r] written. */                                              \
static inline void block_draw_##SUFFIX(const T *logits, long key, long r0, long n, long K,   \
                                       long *out, T *lse) {                                    \
    const long first = r0 / 2, blocks = (r0 + n - 1) / 2 - first + 1;                          \
    T e[MAX_K][ROWS], m[ROWS], tot[ROWS], u[ROWS], u0[ROWS / 2 + 1], u1[ROWS / 2 + 1];          \
    long el[ROWS / 2 + 1];                                                                     \
    for (long j = 0; j < blocks; ++j) el[j] = first + j;                                       \
    UNIFORMS((uint64_t)key, el, 0, blocks, u0, u1);                                            \
    for (long j = 0; j < n; ++j) {                                                             \
        const long r = r0 + j;                                                                 \
        u[j] = r % 2 ? u1[r / 2 - first] : u0[r / 2 - first];                                  \
    }                                                                                          \
    block_exp_##SUFFIX(logits, r0, n, K, e, m, tot);                                           \
    for (long j = 0; j < n; ++j) lse[r0 + j] = m[j] + LOG(tot[j]);                             \
    block_pick_##SUFFIX(e, tot, u, n, K, out + r0);                                            \
}                                                                                              \
                                                                                               \
void categorical_sample_rows_##SUFFIX(const T *logits, long key, long *out, T *lse, long R,   \
                                      long K) {                                                \
    _Pragma("omp parallel for schedule(static) if (R * K > (1 << 12))")                        \
    for (long r0 = 0; r0 < R; r0 += ROWS)                                                      \
        block_draw_##SUFFIX(logits, key, r0, R - r0 < ROWS ? R - r0 : ROWS, K, out, lse);      \
}                                                                                              \
                                                                                               \
/* sample_rows and rows_log_prob of the new and of the old indices in one pass over the rows, \
 * a group (particle) at a time: the same uniforms per row as sample_rows, so the same draws  \
 * (blocks of rows start elsewhere, so an lse can differ in its last bit, vector against      \
 * scalar exp: a draw differs only for a uniform within that of a category's boundary);      \
 * lq_new[g] and lq_old[g] are the group's sums. */                                           \
void categorical_propose_rows_##SUFFIX(const T *logits, const long *old, long key, long *out,  \
                                       T *lse, T *lq_new, T *lq_old, long G, long Nr, long K) { \
    _Pragma("omp parallel for schedule(static) if (G * Nr * K > (1 << 12))")                   \
    for (long g = 0; g < G; ++g) {                                                             \
        T total_new = 0, total_old = 0;                                                        \
        for (long b0 = 0; b0 < Nr; b0 += ROWS) {                                               \
            const long r0 = g * Nr + b0, n = Nr - b0 < ROWS ? Nr - b0 : ROWS;                  \
            block_draw_##SUFFIX(logits, key, r0, n, K, out, lse);                              \
            for (long j = 0; j < n; ++j) {                                                     \
                const T *l = logits + (r0 + j) * K;                                            \
                total_new += l[out[r0 + j]] - lse[r0 + j];                                     \
                total_old += l[old[r0 + j]] - lse[r0 + j];                                     \
            }                                                                                  \
        }                                                                                      \
        lq_new[g] = total_new;                                                                 \
        lq_old[g] = total_old;                                                                 \
    }                                                                                          \
}                                                                                              \
                                                                                               \
void categorical_rows_log_prob_##SUFFIX(const T *logits, const long *idx, T *lse, T *out,      \
                                        long have_lse, long G, long Nr, long K) {              \
    _Pragma("omp parallel for schedule(static) if (G * Nr * K > (1 << 12))")                   \
    for (long g = 0; g < G; ++g) {                                                             \
        const long r0 = g * Nr;                                                                \
        T total = 0;                                                                           \
        for (long b0 = 0; b0 < Nr; b0 += ROWS) {                                               \
            const long n = Nr - b0 < ROWS ? Nr - b0 : ROWS;                                    \
            if (!have_lse) {                                                                   \
                T e[MAX_K][ROWS], m[ROWS], tot[ROWS];                                          \
                block_exp_##SUFFIX(logits, r0 + b0, n, K, e, m, tot);                          \
                for (long j = 0; j < n; ++j) lse[r0 + b0 + j] = m[j] + LOG(tot[j]);            \
            }                                                                                  \
            for (long j = 0; j < n; ++j) {                                                     \
                const long r = r0 + b0 + j;                                                    \
                total += logits[r * K + idx[r]] - lse[r];                                      \
            }                                                                                  \
        }                                                                                      \
        out[g] = total;                                                                        \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* One group's rows: ROWS rows at a time as one contiguous run of n K values, each row's lse  \
 * repeated K times beside it, so the exps run in SIMD lanes (strided by K, they did not).  \
 * Inlined with K a constant 3 and 4 (the mixtures' I), where the repeat loop unrolls. */    \
static inline __attribute__((always_inline)) void rows_backward_group_##SUFFIX(             \
    const T *l, const T *ls, const long *ix, T gg, T *out, long Nr, long K) {                 \
    for (long j0 = 0; j0 < Nr; j0 += ROWS) {                                                   \
        const long n = Nr - j0 < ROWS ? Nr - j0 : ROWS;                                        \
        T rep[ROWS * MAX_K];                                                                   \
        for (long j = 0; j < n; ++j)                                                           \
            for (long k = 0; k < K; ++k) rep[j * K + k] = ls[j0 + j];                          \
        for (long q = 0; q < n * K; ++q) out[j0 * K + q] = -gg * EXP(l[j0 * K + q] - rep[q]);  \
    }                                                                                          \
    for (long j = 0; j < Nr; ++j) out[j * K + ix[j]] += gg;                                    \
}                                                                                              \
                                                                                               \
void categorical_rows_log_prob_backward_##SUFFIX(const T *logits, const long *idx, const T *lse, \
                                                 const T *g, T *glogits, long G, long Nr,      \
                                                 long K) {                                     \
    _Pragma("omp parallel for schedule(static) if (G * Nr * K > (1 << 12))")                   \
    for (long grp = 0; grp < G; ++grp) {                                                       \
        const T gg = g[grp];                                                                   \
        T *out = glogits + grp * Nr * K;                                                       \
        const T *l = logits + grp * Nr * K, *ls = lse + grp * Nr;                              \
        const long *ix = idx + grp * Nr;                                                       \
        if (gg == 0) {                                                                         \
            for (long q = 0; q < Nr * K; ++q) out[q] = 0;                                      \
        } else if (K == 3) {                                                                   \
            rows_backward_group_##SUFFIX(l, ls, ix, gg, out, Nr, 3);                           \
        } else if (K == 4) {                                                                   \
            rows_backward_group_##SUFFIX(l, ls, ix, gg, out, Nr, 4);                           \
        } else {                                                                               \
            rows_backward_group_##SUFFIX(l, ls, ix, gg, out, Nr, K);                           \
        }                                                                                      \
    }                                                                                          \
}

#define DEFINE_CATEGORICAL(T, EXP, LOG, UNIFORMS, SUFFIX)                                      \
DEFINE_BLOCK_EXP(T, EXP, SUFFIX)                                                               \
DEFINE_ROWS(T, EXP, LOG, UNIFORMS, SUFFIX)                                                     \
                                                                                               \
void categorical_sample_##SUFFIX(const T *logits, const T *u, long *out, long R, long K) {     \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (long r0 = 0; r0 < R; r0 += ROWS) {                                                    \
        const long n = R - r0 < ROWS ? R - r0 : ROWS;                                          \
        T e[MAX_K][ROWS], m[ROWS], tot[ROWS];                                                  \
        if (K > MAX_K) {                                                                       \
            for (long j = 0; j < n; ++j) {                                                     \
                const T *l = logits + (r0 + j) * K;                                            \
                T mx = l[0], total = 0, c = 0;                                                 \
                for (long k = 1; k < K; ++k) mx = l[k] > mx ? l[k] : mx;                       \
                for (long k = 0; k < K; ++k) total += EXP(l[k] - mx);                          \
                long pick = K - 1;                                                             \
                for (long k = 0; k < K - 1; ++k) {                                             \
                    c += EXP(l[k] - mx);                                                       \
                    if (c > u[r0 + j] * total) { pick = k; break; }                            \
                }                                                                              \
                out[r0 + j] = pick;                                                            \
            }                                                                                  \
            continue;                                                                          \
        }                                                                                      \
        block_exp_##SUFFIX(logits, r0, n, K, e, m, tot);                                       \
        block_pick_##SUFFIX(e, tot, u + r0, n, K, out + r0);                                   \
    }                                                                                          \
}                                                                                              \
                                                                                               \
void categorical_log_prob_##SUFFIX(const T *logits, const long *idx, T *out, T *lse, long R,   \
                                   long K) {                                                   \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (long r0 = 0; r0 < R; r0 += ROWS) {                                                    \
        const long n = R - r0 < ROWS ? R - r0 : ROWS;                                          \
        if (K > MAX_K) {                                                                       \
            for (long j = 0; j < n; ++j) {                                                     \
                const T *l = logits + (r0 + j) * K;                                            \
                T mx = l[0], total = 0;                                                        \
                for (long k = 1; k < K; ++k) mx = l[k] > mx ? l[k] : mx;                       \
                for (long k = 0; k < K; ++k) total += EXP(l[k] - mx);                          \
                lse[r0 + j] = mx + LOG(total);                                                 \
                out[r0 + j] = l[idx[r0 + j]] - lse[r0 + j];                                    \
            }                                                                                  \
            continue;                                                                          \
        }                                                                                      \
        T e[MAX_K][ROWS], m[ROWS], tot[ROWS];                                                  \
        block_exp_##SUFFIX(logits, r0, n, K, e, m, tot);                                       \
        for (long j = 0; j < n; ++j) lse[r0 + j] = m[j] + LOG(tot[j]);                         \
        for (long j = 0; j < n; ++j)                                                           \
            out[r0 + j] = logits[(r0 + j) * K + idx[r0 + j]] - lse[r0 + j];                    \
    }                                                                                          \
}                                                                                              \
                                                                                               \
void categorical_log_prob_backward_##SUFFIX(const T *logits, const long *idx, const T *lse,    \
                                            const T *g, T *glogits, long R, long K) {          \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (long r0 = 0; r0 < R; r0 += ROWS) {                                                    \
        const long n = R - r0 < ROWS ? R - r0 : ROWS;                                          \
        T p[ROWS];                                                                             \
        for (long k = 0; k < K; ++k) {                                                         \
            for (long j = 0; j < n; ++j) p[j] = EXP(logits[(r0 + j) * K + k] - lse[r0 + j]);   \
            for (long j = 0; j < n; ++j) glogits[(r0 + j) * K + k] = -g[r0 + j] * p[j];        \
        }                                                                                      \
        for (long j = 0; j < n; ++j) glogits[(r0 + j) * K + idx[r0 + j]] += g[r0 + j];         \
    }                                                                                          \
}

DEFINE_CATEGORICAL(float, expf, logf, philox_uniform2f_many, f32)
DEFINE_CATEGORICAL(double, exp, log, philox_uniform2d_many, f64)
