/* The Gaussian mixture model's log-density terms, one pass per (particle, dataset).
 *
 * In eager PyTorch each is ~15 small ops on (L, B, I, D) or (L, B, I, N) tensors (a
 * one-hot, a matrix product of moments, broadcasts over a cluster axis of 3), and a GMM
 * training step evaluates them at every block update. The model has no parameters, so
 * these run only where nothing asks for a gradient (apg/tasks/gmm/ keeps the PyTorch
 * twins for the rest; tests/apg/tasks/test_gmm.py checks both agree).
 *
 * Shapes: x (B, N, D); mu, tau (L, B, I, D); c (L, B, N) cluster indices.
 *
 * gmm_assignment_change: out[l,b] = sum_n ll(x_n; c_new_n) - ll(x_n; c_old_n) with
 *   ll(x; i) = sum_d (log tau_id - tau_id (x_d - mu_id)^2) / 2: the change of the log joint
 *   when the assignments change and the globals stay (the uniform prior on c cancels).
 * gmm_log_globals: for P = 1 or 2 sets of globals (mu, tau) and (mu2, tau2), each (L, B, I, D),
 *   under the same assignments, out[l,b] (and out2 for the second set) = sum_{i,d} (a0 - 1/2
 *   + n_i / 2) log tau - tau (b0 + nu0 (mu - m0)^2 / 2 + (S_id + n_i (xbar_id - mu)^2) / 2)
 *   + const, with each cluster's count n_i, mean xbar and scatter S from one pass over the
 *   points, consts = (a0, b0, nu0, m0) and const the prior's normalizer summed over the I D
 *   cells: the NormalGamma prior plus the likelihood without its -N D log(2 pi) / 2
 *   (GMM._log_globals). Separate arrays, so the caller stacks nothing.
 *
 * gmm_soft_moments: the globals kernel's neural sufficient statistics (GlobalsProposal on
 *   u_n = [x_n, one-hot(c_n)]): o = W u_n + bias with W (I + D, D + I) the two heads' weights
 *   stacked, Wr (I, D + I) over Ws (D, D + I), and bias = (br, bs); resp = softmax(o[:I]),
 *   t = o[I:]; sums[l,b,i,:] += (resp_i, resp_i t, resp_i t^2), sums (L, B, I, 1 + 2D) zeroed
 *   by the caller. gmm_soft_moments_backward accumulates gWr, gbr, gWs, gbs (zeroed) from
 *   gsums. The heads come apart, so the caller concatenates nothing (nor its backward).
 *
 * The globals proposals' NormalGamma (apg/tasks/gmm/conjugate.py: NormalGamma, NormalGammaFromSums):
 *   in eager PyTorch its conjugate update is ~20 small ops on (L, B, I, D) tensors and its
 *   log-density ~20 more (lgamma alone ~140 us), with as many again in the backward, at
 *   every globals update. gmm_ng_log_prob (and _backward, into all six inputs) scores values
 *   under given parameters; gmm_ng_sums_sample (its Gamma draws from Philox, gamma.h),
 *   gmm_ng_sums_log_prob (and _backward, into the sums and the values) and
 *   gmm_ng_sums_propose (a draw and both scores) start from the per-cluster sums. lgamma is the reentrant lgamma_r (OpenMP
 *   threads); digamma is written here (gmm_digamma exposes it to the tests).
 *
 * This file includes itself once per dtype (T float, then double).
 */
#ifndef GMM_BODY
#define GMM_BODY

/* Below these sizes a kernel stays on the calling thread, where a parallel region would cost
 * about what it saves: PAR_MIN_CELLS (L, B, I, D) cells for the NormalGamma kernels,
 * PAR_MIN_WORK (point, cluster or moment) terms for the others. Both are far below the
 * paper's GMM sizes (1,200 cells; 36,000 to 180,000 terms): there the second thread,
 * otherwise idle between the pairwise layers, takes half of every kernel. Measured against
 * thresholds that kept them all serial (in-process A/B, 2 threads): 0.895-0.898 of the step
 * on a quiet machine, and 0.867 with another process busy on one of the two cores. */
#define PAR_MIN_CELLS 256
#define PAR_MIN_WORK 8192

#define _GNU_SOURCE /* lgamma_r, lgammaf_r: plain lgamma writes the global signgam */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "gamma.h"
#include "thread_order.h"

#define GMM_CAT_(a, b) a##b
#define GMM_CAT(a, b) GMM_CAT_(a, b)
#define S(name) GMM_CAT(name, SUFFIX)
#define MAX_CELLS 256  /* I * D per dataset on the stack; larger falls back to PyTorch */
#define MAX_OUTPUTS 16 /* I + D of the globals kernel, likewise */

#define HALF_LOG_2PI 0.91893853320467274178

#define T float
#define SUFFIX _f32
#define M(fn) fn##f
#define LGAMMA_R lgammaf_r
#define TINY FLT_MIN
#include __FILE__
#undef T
#undef SUFFIX
#undef M
#undef LGAMMA_R
#undef TINY

#define T double
#define SUFFIX _f64
#define M(fn) fn
#define LGAMMA_R lgamma_r
#define TINY DBL_MIN
#include __FILE__

#else /* the body, once per dtype */

/* Both kernels below run over blocks of PBLOCK points, point axis innermost: per cluster
 * they form a mask of the block's points assigned to it and accumulate masked sums in SIMD
 * lanes. A loop over points that indexes per-cluster arrays by c[n] (a scatter) chains its
 * adds through memory, and one that skips unchanged points mispredicts its branch; at the
 * paper's sizes both ran ~100 us per call against a few us of arithmetic. */
#define PBLOCK 64

/* xs[d][j] = x[(n0 + j) * D + d] and mk[i][j] = [c[n0 + j] == i] for j < m, 0 past m;
 * xs (D, PBLOCK), mk (I, PBLOCK). */
static inline void S(point_block)(const T *x, const long *c, long n0, long m, long I, long D,
                                  T (*xs)[PBLOCK], T (*mk)[PBLOCK]) {
    T cf[PBLOCK];
    for (long j = 0; j < PBLOCK; ++j) cf[j] = j < m ? (T)c[n0 + j] : -1;
    for (long i = 0; i < I; ++i)
        for (long j = 0; j < PBLOCK; ++j) mk[i][j] = cf[j] == (T)i ? 1 : 0;
    for (long d = 0; d < D; ++d)
        for (long j = 0; j < PBLOCK; ++j) xs[d][j] = j < m ? x[(n0 + j) * D + d] : 0;
}

void S(gmm_assignment_change)(const T *X, const T *MU, const T *TAU, const long *c_new,
                              const long *c_old, T *out, long L, long B, long N, long I, long D) {
#pragma omp parallel for schedule(static) if (L * B * N * I > PAR_MIN_WORK)
    for (long lb = 0; lb < L * B; ++lb) {
        const T *x = X + (lb % B) * N * D, *mu = MU + lb * I * D, *tau = TAU + lb * I * D;
        T log_tau[MAX_CELLS], acc[PBLOCK];
        for (long k = 0; k < I * D; ++k) log_tau[k] = M(log)(tau[k]);
        for (long j = 0; j < PBLOCK; ++j) acc[j] = 0;
        for (long n0 = 0; n0 < N; n0 += PBLOCK) {
            const long m = N - n0 < PBLOCK ? N - n0 : PBLOCK;
            T xs[D][PBLOCK], mk_new[I][PBLOCK], mk_old[I][PBLOCK]; /* sized by the call: I D <= MAX_CELLS */
            S(point_block)(x, c_new + lb * N, n0, m, I, D, xs, mk_new);
            S(point_block)(x, c_old + lb * N, n0, m, I, D, xs, mk_old);
            for (long i = 0; i < I; ++i) {
                T ll[PBLOCK];
                for (long j = 0; j < PBLOCK; ++j) ll[j] = 0;
                for (long d = 0; d < D; ++d) {
                    const T lt = log_tau[i * D + d], t = tau[i * D + d], mm = mu[i * D + d];
                    for (long j = 0; j < PBLOCK; ++j) {
                        const T e = xs[d][j] - mm;
                        ll[j] += lt - t * e * e;
                    }
                }
                for (long j = 0; j < PBLOCK; ++j) acc[j] += (mk_new[i][j] - mk_old[i][j]) * ll[j];
            }
        }
        T total = 0;
        for (long j = 0; j < PBLOCK; ++j) total += acc[j];
        out[lb] = total / 2;
    }
}

void S(gmm_log_globals)(const T *X, const long *C, const T *MU, const T *TAU, const T *MU2, const T *TAU2,
                        const T *consts, T *out, T *out2, long P, long L, long B, long N, long I, long D) {
    const T a0 = consts[0], b0 = consts[1], nu0 = consts[2], m0 = consts[3];
    int sign;
    const T prior = (T)(I * D) * (a0 * M(log)(b0) - LGAMMA_R(a0, &sign) + M(log)(nu0) / 2 - (T)HALF_LOG_2PI);
#pragma omp parallel for schedule(static) if (L * B * N * I > PAR_MIN_WORK)
    for (long lb = 0; lb < L * B; ++lb) {
        const T *x = X + (lb % B) * N * D;
        const long *c = C + lb * N;
        T count[MAX_CELLS], mean[MAX_CELLS], scatter[MAX_CELLS];
        T a_count[I][PBLOCK], a_sum[I * D][PBLOCK];
        for (long k = 0; k < I * (D + 1); ++k)
            for (long j = 0; j < PBLOCK; ++j) (k < I ? a_count[k] : a_sum[k - I])[j] = 0;
        for (long n0 = 0; n0 < N; n0 += PBLOCK) {
            T xs[D][PBLOCK], mk[I][PBLOCK];
            S(point_block)(x, c, n0, N - n0 < PBLOCK ? N - n0 : PBLOCK, I, D, xs, mk);
            for (long i = 0; i < I; ++i) {
                for (long j = 0; j < PBLOCK; ++j) a_count[i][j] += mk[i][j];
                for (long d = 0; d < D; ++d)
                    for (long j = 0; j < PBLOCK; ++j) a_sum[i * D + d][j] += mk[i][j] * xs[d][j];
            }
        }
        for (long i = 0; i < I; ++i) {
            T n_i = 0;
            for (long j = 0; j < PBLOCK; ++j) n_i += a_count[i][j];
            count[i] = n_i;
            for (long d = 0; d < D; ++d) {
                T s = 0;
                for (long j = 0; j < PBLOCK; ++j) s += a_sum[i * D + d][j];
                mean[i * D + d] = n_i > 0 ? s / n_i : 0;
            }
        }
        /* centred second pass: no cancellation, and an empty cluster's scatter is exactly 0 */
        for (long k = 0; k < I * D; ++k)
            for (long j = 0; j < PBLOCK; ++j) a_sum[k][j] = 0;
        for (long n0 = 0; n0 < N; n0 += PBLOCK) {
            T xs[D][PBLOCK], mk[I][PBLOCK];
            S(point_block)(x, c, n0, N - n0 < PBLOCK ? N - n0 : PBLOCK, I, D, xs, mk);
            for (long i = 0; i < I; ++i)
                for (long d = 0; d < D; ++d) {
                    const T mn = mean[i * D + d];
                    for (long j = 0; j < PBLOCK; ++j) {
                        const T e = xs[d][j] - mn;
                        a_sum[i * D + d][j] += mk[i][j] * e * e;
                    }
                }
        }
        for (long k = 0; k < I * D; ++k) {
            T s = 0;
            for (long j = 0; j < PBLOCK; ++j) s += a_sum[k][j];
            scatter[k] = s;
        }
        for (long p = 0; p < P; ++p) {
            const T *mu = (p ? MU2 : MU) + lb * I * D, *tau = (p ? TAU2 : TAU) + lb * I * D;
            T total = prior;
            for (long k = 0; k < I * D; ++k) {
                const T n_i = count[k / D], dm = mean[k] - mu[k], d0 = mu[k] - m0;
                total += (a0 - (T)0.5 + n_i / 2) * M(log)(tau[k]) -
                         tau[k] * (b0 + nu0 * d0 * d0 / 2 + (scatter[k] + n_i * dm * dm) / 2);
            }
            (p ? out2 : out)[lb] = total;
        }
    }
}

/* The kernel works on blocks of BLOCK points, point axis innermost, so that every loop
 * over points vectorizes (loops over I = 3 clusters or D = 2 dims do not). */
#define BLOCK 64

/* For points n0 .. n0 + m of one dataset, all with assignment k: o[q][j] = bias + W[q, :D] x
 * + W[q, D + k], then o[:I] replaced by its softmax over q (resp); o[I:] is t. Every loop runs
 * over the whole block (points past m read x = 0 and give finite values the callers ignore):
 * with a constant trip count the loops vectorize without remainder loops or versioning, which
 * cost more than the arithmetic at these sizes. */
static inline void S(soft_outputs)(const T *W, const T *bias, const T *x, long m, long k, T (*o)[BLOCK],
                                   long I, long D) {
    const long F = D + I;
    T xs[MAX_OUTPUTS][BLOCK];
    for (long d = 0; d < D; ++d)
        for (long j = 0; j < BLOCK; ++j) xs[d][j] = j < m ? x[j * D + d] : 0;
    for (long q = 0; q < I + D; ++q) {
        const T *w = W + q * F;
        for (long j = 0; j < BLOCK; ++j) o[q][j] = bias[q] + w[D + k];
        for (long d = 0; d < D; ++d)
            for (long j = 0; j < BLOCK; ++j) o[q][j] += w[d] * xs[d][j];
    }
    T top[BLOCK], total[BLOCK];
    for (long j = 0; j < BLOCK; ++j) top[j] = o[0][j];
    for (long i = 1; i < I; ++i)
        for (long j = 0; j < BLOCK; ++j) top[j] = o[i][j] > top[j] ? o[i][j] : top[j];
    for (long j = 0; j < BLOCK; ++j) total[j] = 0;
    for (long i = 0; i < I; ++i)
        for (long j = 0; j < BLOCK; ++j) {
            o[i][j] = M(exp)(o[i][j] - top[j]);
            total[j] += o[i][j];
        }
    for (long j = 0; j < BLOCK; ++j) total[j] = 1 / total[j];
    for (long i = 0; i < I; ++i)
        for (long j = 0; j < BLOCK; ++j) o[i][j] *= total[j];
}

/* A point's contribution depends on its particle only through its assignment c_n, which takes
 * I values: so the kernel's outputs are computed once per (dataset, value k, point), B I N
 * rows, instead of once per (particle, dataset, point), L B N rows (L = 10 particles against
 * I = 3 values at the paper's sizes), into a table of each row's moments (R = I (1 + 2D)
 * values). Each particle's sums then add up the rows its assignments pick. The table is laid
 * out (B, I, R, Np), point axis innermost and padded with zeros to whole blocks, so that the
 * picking is a masked sum over a block of points per (k, moment): vertical vector code, where
 * a row-by-row gather would chain every add through memory. The backward runs the same way
 * round: each particle's sums gradient goes to the rows it picked, and the network's backward
 * runs once per row. */
#define PCHUNK 16 /* particles per pass of the backward's picking */

static void S(soft_table)(const T *X, const T *W, const T *bias, T *table, long B, long N, long I, long D) {
    const long width = 1 + 2 * D, R = I * width, blocks = (N + BLOCK - 1) / BLOCK, Np = blocks * BLOCK;
#pragma omp parallel for schedule(static) if (B * N * I * R > PAR_MIN_WORK)
    for (long task = 0; task < B * I * blocks; ++task) {
        const long b = task / (I * blocks), k = task / blocks % I, n0 = task % blocks * BLOCK;
        const long m = N - n0 < BLOCK ? N - n0 : BLOCK;
        T o[MAX_OUTPUTS][BLOCK];
        S(soft_outputs)(W, bias, X + (b * N + n0) * D, m, k, o, I, D);
        T *base = table + (b * I + k) * R * Np + n0;
        for (long i = 0; i < I; ++i) {
            T r[BLOCK];
            for (long j = 0; j < BLOCK; ++j) r[j] = j < m ? o[i][j] : 0; /* padding: exact zeros */
            for (long j = 0; j < BLOCK; ++j) base[i * width * Np + j] = r[j];
            for (long d = 0; d < D; ++d) {
                T *first = base + (i * width + 1 + d) * Np, *second = base + (i * width + 1 + D + d) * Np;
                for (long j = 0; j < BLOCK; ++j) {
                    const T t = j < m ? o[I + d][j] : 0;
                    first[j] = r[j] * t;
                    second[j] = r[j] * t * t;
                }
            }
        }
    }
}

/* mk[k][j] = 1 where point n0 + j of assignments c has c = k, else 0 (and 0 past m). */
static inline void S(pick_masks)(const long *c, long m, long I, T (*mk)[BLOCK]) {
    T cf[BLOCK];
    for (long j = 0; j < BLOCK; ++j) cf[j] = j < m ? (T)c[j] : -1;
    for (long k = 0; k < I; ++k)
        for (long j = 0; j < BLOCK; ++j) mk[k][j] = cf[j] == (T)k ? 1 : 0;
}

/* W = [Wr; Ws] (I + D, F) and bias = (br, bs), F = D + I. */
static inline void S(stack_heads)(const T *Wr, const T *br, const T *Ws, const T *bs, long I, long D,
                                  T *W, T *bias) {
    const long F = D + I;
    memcpy(W, Wr, sizeof(T) * I * F);
    memcpy(W + I * F, Ws, sizeof(T) * D * F);
    memcpy(bias, br, sizeof(T) * I);
    memcpy(bias + I, bs, sizeof(T) * D);
}

/* One particle's sums[q] += the table rows (B's slice tb) its assignments c pick. Moments
 * outside, one at a time, with a block-wide accumulator kept in registers across the I
 * values, where I and R are constants: pick_sums inlines the body with the paper's I = 3,
 * D = 2 (R = 15) and runs it generic otherwise; a separate function, because as the body of
 * the parallel loop the outlined code kept reloading the loop's sizes. Specialized, the pass
 * is ~1.8x faster than one with I x R accumulators spilled to the stack; generic, it is not. */
static inline __attribute__((always_inline)) void S(pick_sums_body)(const T *tb, const long *c, T *sums, long N,
                                                                     long I, long R) {
    const long Np = (N + BLOCK - 1) / BLOCK * BLOCK;
    T mk[MAX_OUTPUTS][BLOCK];
    for (long n0 = 0; n0 < N; n0 += BLOCK) {
        S(pick_masks)(c + n0, N - n0 < BLOCK ? N - n0 : BLOCK, I, mk);
        for (long q = 0; q < R; ++q) {
            T acc[BLOCK];
            for (long j = 0; j < BLOCK; ++j) acc[j] = 0;
            for (long k = 0; k < I; ++k) {
                const T *row = tb + (k * R + q) * Np + n0;
                for (long j = 0; j < BLOCK; ++j) acc[j] += mk[k][j] * row[j];
            }
            T total = 0;
            for (long j = 0; j < BLOCK; ++j) total += acc[j];
            sums[q] += total;
        }
    }
}

static __attribute__((noinline)) void S(pick_sums)(const T *tb, const long *c, T *sums, long N, long I, long R) {
    if (I == 3 && R == 15)
        S(pick_sums_body)(tb, c, sums, N, 3, 15);
    else
        S(pick_sums_body)(tb, c, sums, N, I, R);
}

void S(gmm_soft_moments)(const T *X, const long *C, const T *Wr, const T *br, const T *Ws, const T *bs,
                         T *sums, long L, long B, long N, long I, long D) {
    const long R = I * (1 + 2 * D), blocks = (N + BLOCK - 1) / BLOCK, Np = blocks * BLOCK;
    T W[MAX_OUTPUTS * MAX_OUTPUTS], bias[MAX_OUTPUTS];
    S(stack_heads)(Wr, br, Ws, bs, I, D, W, bias);
    T *table = malloc(sizeof(T) * B * I * R * Np);
    if (!table) return; /* sums stay zero; cannot happen at the sizes this runs at */
    S(soft_table)(X, W, bias, table, B, N, I, D);
    /* dataset-major, as soft_table splits its rows: each thread reads the rows it wrote, not
     * rows in the other core's cache (particle-major, 2 threads ran slower than 1) */
#pragma omp parallel for collapse(2) schedule(static) if (L * B * N * R > PAR_MIN_WORK)
    for (long b = 0; b < B; ++b)
        for (long l = 0; l < L; ++l)
            S(pick_sums)(table + b * I * R * Np, C + (l * B + b) * N, sums + (l * B + b) * R, N, I, R);
    free(table);
}

void S(gmm_soft_moments_backward)(const T *X, const long *C, const T *Wr, const T *br, const T *Ws,
                                  const T *bs, const T *gsums, T *gWr, T *gbr, T *gWs, T *gbs, long L, long B,
                                  long N, long I, long D) {
    const long width = 1 + 2 * D, R = I * width, F = D + I, K = I + D, blocks = (N + BLOCK - 1) / BLOCK;
    const long Np = blocks * BLOCK;
    T W[MAX_OUTPUTS * MAX_OUTPUTS], bias[MAX_OUTPUTS];
    S(stack_heads)(Wr, br, Ws, bs, I, D, W, bias);
    T *gtable = calloc((size_t)B * I * R * Np, sizeof(T));
    if (!gtable) return;
    /* each particle's gradient to the rows it picked; threads split the datasets, and each
     * row takes the particles PCHUNK at a time with its accumulator in registers (a pass
     * per particle read and wrote every row through memory) */
#pragma omp parallel for schedule(static) if (L * B * N * R > PAR_MIN_WORK)
    for (long b = 0; b < B; ++b) {
        T mk[PCHUNK][I][BLOCK]; /* I <= MAX_OUTPUTS */
        for (long n0 = 0; n0 < N; n0 += BLOCK) {
            const long m = N - n0 < BLOCK ? N - n0 : BLOCK;
            for (long l0 = 0; l0 < L; l0 += PCHUNK) {
                const long lc = L - l0 < PCHUNK ? L - l0 : PCHUNK;
                for (long p = 0; p < lc; ++p) S(pick_masks)(C + ((l0 + p) * B + b) * N + n0, m, I, mk[p]);
                for (long k = 0; k < I; ++k)
                    for (long q = 0; q < R; ++q) {
                        T acc[BLOCK];
                        for (long j = 0; j < BLOCK; ++j) acc[j] = 0;
                        for (long p = 0; p < lc; ++p) {
                            const T gq = gsums[((l0 + p) * B + b) * R + q];
                            for (long j = 0; j < BLOCK; ++j) acc[j] += mk[p][k][j] * gq;
                        }
                        T *row = gtable + ((b * I + k) * R + q) * Np + n0;
                        for (long j = 0; j < BLOCK; ++j) row[j] += acc[j];
                    }
            }
        }
    }
    /* each thread's gWr, gWs (as gw: K F) and gbr, gbs (K), in one row */
    const int parallel = B * N * I * R > PAR_MIN_WORK;
    T *parts = parallel ? THREAD_PARTS(T, K * F + K) : NULL;
    T fallback[MAX_OUTPUTS * (MAX_OUTPUTS + 1)]; /* K F + K <= 16 * 17 */
    if (!parts) memset(fallback, 0, sizeof(T) * (K * F + K));
    int team = 1;
#pragma omp parallel if (parts != NULL)
    {
        T gw[MAX_OUTPUTS * MAX_OUTPUTS], gb[MAX_OUTPUTS], o[MAX_OUTPUTS][BLOCK], go[MAX_OUTPUTS][BLOCK];
        memset(gw, 0, sizeof(T) * K * F);
        memset(gb, 0, sizeof(T) * K);
#pragma omp for schedule(static)
        for (long task = 0; task < B * I * blocks; ++task) {
            const long b = task / (I * blocks), k = task / blocks % I, n0 = task % blocks * BLOCK;
            const long m = N - n0 < BLOCK ? N - n0 : BLOCK;
            const T *x = X + (b * N + n0) * D, *gt = gtable + (b * I + k) * R * Np + n0;
            S(soft_outputs)(W, bias, x, m, k, o, I, D);
            /* d/d resp_i and d/d t_d of sum_i g_i . (r_i, r_i t, r_i t^2), g the rows' gradient
             * (zero in the padding, so the padded lanes contribute nothing below) */
            T mean_gr[BLOCK];
            for (long j = 0; j < BLOCK; ++j) mean_gr[j] = 0;
            for (long d = 0; d < D; ++d)
                for (long j = 0; j < BLOCK; ++j) go[I + d][j] = 0;
            for (long i = 0; i < I; ++i) {
                const T *g0 = gt + i * width * Np;
                for (long j = 0; j < BLOCK; ++j) go[i][j] = g0[j];
                for (long d = 0; d < D; ++d) {
                    const T *g1 = gt + (i * width + 1 + d) * Np, *g2 = gt + (i * width + 1 + D + d) * Np;
                    for (long j = 0; j < BLOCK; ++j) {
                        const T t = o[I + d][j];
                        go[i][j] += (g1[j] + g2[j] * t) * t;
                        go[I + d][j] += o[i][j] * (g1[j] + 2 * g2[j] * t);
                    }
                }
                for (long j = 0; j < BLOCK; ++j) mean_gr[j] += o[i][j] * go[i][j];
            }
            /* softmax backward */
            for (long i = 0; i < I; ++i)
                for (long j = 0; j < BLOCK; ++j) go[i][j] = o[i][j] * (go[i][j] - mean_gr[j]);
            for (long q = 0; q < K; ++q) {
                T sb = 0;
                for (long j = 0; j < BLOCK; ++j) sb += go[q][j];
                gb[q] += sb;
                gw[q * F + D + k] += sb; /* every point of this pass has assignment k */
                for (long d = 0; d < D; ++d) {
                    T sw = 0;
                    for (long j = 0; j < m; ++j) sw += go[q][j] * x[j * D + d];
                    gw[q * F + d] += sw;
                }
            }
        }
        {
            T *mine = MY_ROW(parts, fallback, K * F + K);
            for (long q = 0; q < K * F; ++q) mine[q] += gw[q];
            for (long q = 0; q < K; ++q) mine[K * F + q] += gb[q];
        }
        TEAM_SIZE(team);
    }
    for (int t = 0; t < team; ++t) {
        const T *row = ROW(parts, fallback, K * F + K, t);
        for (long q = 0; q < K * F; ++q) (q < I * F ? gWr + q : gWs + q - I * F)[0] += row[q];
        for (long q = 0; q < K; ++q) (q < I ? gbr + q : gbs + q - I)[0] += row[K * F + q];
    }
    free(parts);
    free(gtable);
}

/* ---- The assignment proposal's first layer, split per point and per cluster ----------- */

/* P[b,n,h] = bo[h] + sum_d Wo[h,d] x[b,n,d] and C[l,b,i,h] = sum_d (Wp[h,d] log tau[l,b,i,d]
 * - Wo[h,d] mu[l,b,i,d]): the two parts of W (x_n - mu_i) + V log tau_i + b that the pairwise
 * tanh layer (tanh_layers.c) adds. In eager PyTorch these are ~10 small ops (two linears, a
 * log, a matrix product and a difference) at every assignment update, and as many in the
 * backward; the arithmetic is a few microseconds. Wo, Wp (H, D); bo (H). */
void S(gmm_assignment_inputs)(const T *X, const T *MU, const T *TAU, const T *Wo, const T *bo, const T *Wp,
                              T *restrict P, T *restrict C, long L, long B, long N, long I, long D, long H) {
    /* the weights transposed to (D, H), so that every loop runs over h in SIMD lanes (a loop
     * over d is a serial chain of D fused multiply-adds per output) */
    T wo[D][H], wp[D][H];
    for (long h = 0; h < H; ++h)
        for (long d = 0; d < D; ++d) {
            wo[d][h] = Wo[h * D + d];
            wp[d][h] = Wp[h * D + d];
        }
    for (long bn = 0; bn < B * N; ++bn) {
        T *p = P + bn * H;
        for (long h = 0; h < H; ++h) p[h] = bo[h];
        for (long d = 0; d < D; ++d) {
            const T v = X[bn * D + d];
            for (long h = 0; h < H; ++h) p[h] += wo[d][h] * v;
        }
    }
    for (long r = 0; r < L * B * I; ++r) {
        T *c = C + r * H;
        for (long h = 0; h < H; ++h) c[h] = 0;
        for (long d = 0; d < D; ++d) {
            const T lt = M(log)(TAU[r * D + d]), m = MU[r * D + d];
            for (long h = 0; h < H; ++h) c[h] += wp[d][h] * lt - wo[d][h] * m;
        }
    }
}

/* Its backward from gP (B, N, H) and gC (L, B, I, H), accumulated into zeroed gWo, gbo, gWp. */
void S(gmm_assignment_inputs_backward)(const T *X, const T *MU, const T *TAU, const T *gP, const T *gC, T *gWo,
                                       T *gbo, T *gWp, long L, long B, long N, long I, long D, long H) {
    T go[D][H], gp[D][H], gb[H];
    for (long h = 0; h < H; ++h) {
        gb[h] = 0;
        for (long d = 0; d < D; ++d) go[d][h] = gp[d][h] = 0;
    }
    for (long bn = 0; bn < B * N; ++bn) {
        const T *g = gP + bn * H;
        for (long h = 0; h < H; ++h) gb[h] += g[h];
        for (long d = 0; d < D; ++d) {
            const T v = X[bn * D + d];
            for (long h = 0; h < H; ++h) go[d][h] += g[h] * v;
        }
    }
    for (long r = 0; r < L * B * I; ++r) {
        const T *g = gC + r * H;
        for (long d = 0; d < D; ++d) {
            const T lt = M(log)(TAU[r * D + d]), m = MU[r * D + d];
            for (long h = 0; h < H; ++h) {
                gp[d][h] += g[h] * lt;
                go[d][h] -= g[h] * m;
            }
        }
    }
    for (long h = 0; h < H; ++h) {
        gbo[h] += gb[h];
        for (long d = 0; d < D; ++d) {
            gWo[h * D + d] += go[d][h];
            gWp[h * D + d] += gp[d][h];
        }
    }
}

/* ---- The NormalGamma proposal: its conjugate update, draws and log-density ------------ */

/* digamma(x), x > 0: the recurrence psi(x) = psi(x + 1) - 1/x up to x >= 10 (at most 10
 * steps, a bound that also ends the loop for invalid x), then the asymptotic series
 * ln x - 1/(2x) - sum_k B_2k / (2k x^2k) through x^-14 (truncation error below 1e-16). */
static inline T S(ng_digamma)(T x) {
    T shift = 0;
    for (int k = 0; k < 10 && x < 10; ++k, x += 1) shift -= 1 / x;
    const T f = 1 / (x * x);
    const T series =
        f * ((T)(-1.0 / 12) +
             f * ((T)(1.0 / 120) +
                  f * ((T)(-1.0 / 252) +
                       f * ((T)(1.0 / 240) + f * ((T)(-1.0 / 132) + f * ((T)(691.0 / 32760) + f * (T)(-1.0 / 12)))))));
    return shift + M(log)(x) - (T)0.5 / x + series;
}

void S(gmm_digamma)(const T *x, T *out, long n) {
    for (long k = 0; k < n; ++k) out[k] = S(ng_digamma)(x[k]);
}

/* log NormalGamma, per cell: Gamma(tau; alpha, rate beta) Normal(x; m, 1 / (nu tau)), summed
 * over the K = I D cells of each of R rows. All six (R, K) contiguous. */
void S(gmm_ng_log_prob)(const T *m, const T *nu, const T *alpha, const T *beta, const T *x, const T *tau, T *out,
                        long R, long K) {
#pragma omp parallel for schedule(static) if (R * K > PAR_MIN_CELLS)
    for (long r = 0; r < R; ++r) {
        T total = 0;
        for (long k = r * K; k < (r + 1) * K; ++k) {
            int sign;
            const T e = x[k] - m[k];
            total += alpha[k] * M(log)(beta[k]) - LGAMMA_R(alpha[k], &sign) + (T)0.5 * M(log)(nu[k]) +
                     (alpha[k] - (T)0.5) * M(log)(tau[k]) - tau[k] * (beta[k] + (T)0.5 * nu[k] * e * e);
        }
        out[r] = total - (T)HALF_LOG_2PI * K;
    }
}

/* Its gradients in all six, from g (R,) = d loss / d out. */
void S(gmm_ng_log_prob_backward)(const T *m, const T *nu, const T *alpha, const T *beta, const T *x, const T *tau,
                                 const T *g, T *gm, T *gnu, T *galpha, T *gbeta, T *gx, T *gtau, long R, long K) {
#pragma omp parallel for schedule(static) if (R * K > PAR_MIN_CELLS)
    for (long k = 0; k < R * K; ++k) {
        const T gk = g[k / K], e = x[k] - m[k], half_e2 = (T)0.5 * e * e;
        gm[k] = gk * tau[k] * nu[k] * e;
        gnu[k] = gk * ((T)0.5 / nu[k] - tau[k] * half_e2);
        galpha[k] = gk * (M(log)(beta[k]) - S(ng_digamma)(alpha[k]) + M(log)(tau[k]));
        gbeta[k] = gk * (alpha[k] / beta[k] - tau[k]);
        gx[k] = -gm[k];
        gtau[k] = gk * ((alpha[k] - (T)0.5) / tau[k] - beta[k] - nu[k] * half_e2);
    }
}

/* The same from the per-cluster sums s = (sum r, sum r t, sum r t^2) (I, W = 1 + 2D) that
 * the conjugate update reads (normal_gamma_from_moments of moments_from_sums): count c,
 * mean = s1 / max(c, 1e-12), scatter = max(s2 - s1 mean, 0); nu = nu0 + c, alpha = a0 + c/2,
 * m = (nu0 m0 + c mean) / nu, beta = b0 + scatter / 2 + nu0 c (mean - m0)^2 / (2 nu);
 * consts = (a0, b0, nu0, m0). Sums are (L, B, I, W), or (B, I, W) shared by the L particles
 * when per_particle is 0. Values x, tau and out are per particle. */
#define NG_CLUSTER                                                                                 \
    const T c = si[0], cc = c > (T)1e-12 ? c : (T)1e-12, nu = nu0 + c, alpha = a0 + (T)0.5 * c
#define NG_CELL                                                                                    \
    const T s1 = si[1 + d], mean = s1 / cc, raw = si[1 + D + d] - s1 * mean, dm0 = mean - m0;     \
    const T m = (nu0 * m0 + c * mean) / nu,                                                        \
            beta = b0 + (T)0.5 * (raw > 0 ? raw : 0) + (T)0.5 * nu0 * c * dm0 * dm0 / nu

/* The draws NormalGamma.sample makes from these parameters, in place: mu holds standard normal
 * draws on entry; tau = max(g / beta, tiny) (torch's Gamma clamps so) with g ~ Gamma(alpha, 1)
 * gamma.h's draw of element k (the cell's flat index, as apg.random.standard_gamma numbers
 * it), and mu = m + mu / sqrt(nu tau). Cells are taken GAMMA_BLOCK at a time, across
 * particles, so the Gamma draw's first try runs on whole vectors. */
void S(gmm_ng_sums_sample)(const T *sums, const T *consts, long key, T *mu, T *tau, long L, long B, long I,
                           long D, long per_particle) {
    const T a0 = consts[0], b0 = consts[1], nu0 = consts[2], m0 = consts[3];
    const long W = 1 + 2 * D, n = L * B * I * D;
#pragma omp parallel for schedule(static) if (n > PAR_MIN_CELLS)
    for (long k0 = 0; k0 < n; k0 += GAMMA_BLOCK) {
        const long cnt = n - k0 < GAMMA_BLOCK ? n - k0 : GAMMA_BLOCK;
        double shape[GAMMA_BLOCK], g[GAMMA_BLOCK];
        T loc[GAMMA_BLOCK], prec[GAMMA_BLOCK], rate[GAMMA_BLOCK];
        for (long j = 0; j < cnt; ++j) {
            const long k = k0 + j, lb = k / (I * D), i = k / D % I, d = k % D;
            const T *si = sums + ((per_particle ? lb : lb % B) * I + i) * W;
            NG_CLUSTER;
            NG_CELL;
            shape[j] = alpha;
            loc[j] = m;
            prec[j] = nu;
            rate[j] = beta;
        }
        gamma_block((uint64_t)key, k0, cnt, shape, g);
        for (long j = 0; j < cnt; ++j) {
            const long k = k0 + j;
            T t = (T)g[j] / rate[j];
            t = t > TINY ? t : TINY;
            tau[k] = t;
            mu[k] = loc[j] + mu[k] / M(sqrt)(prec[j] * t);
        }
    }
}

void S(gmm_ng_sums_log_prob)(const T *sums, const T *consts, const T *X, const T *TAU, T *out, long L, long B,
                             long I, long D, long per_particle) {
    const T a0 = consts[0], b0 = consts[1], nu0 = consts[2], m0 = consts[3];
    const long W = 1 + 2 * D;
#pragma omp parallel for schedule(static) if (L * B * I * D > PAR_MIN_CELLS)
    for (long lb = 0; lb < L * B; ++lb) {
        const T *s = sums + (per_particle ? lb : lb % B) * I * W, *x = X + lb * I * D, *tau = TAU + lb * I * D;
        T total = 0;
        for (long i = 0; i < I; ++i) {
            const T *si = s + i * W;
            NG_CLUSTER;
            int sign;
            total += D * ((T)0.5 * M(log)(nu) - LGAMMA_R(alpha, &sign));
            for (long d = 0; d < D; ++d) {
                NG_CELL;
                const T t = tau[i * D + d], e = x[i * D + d] - m;
                total += alpha * M(log)(beta) + (alpha - (T)0.5) * M(log)(t) - t * (beta + (T)0.5 * nu * e * e);
            }
        }
        out[lb] = total - (T)HALF_LOG_2PI * I * D;
    }
}

/* gmm_ng_sums_sample, then gmm_ng_sums_log_prob of the drawn values (lp_new) and of given old
 * ones (lp_old): NormalGammaFromSums.propose, a globals update's forward and reverse kernel in
 * one call. mu holds standard normal draws on entry, as for gmm_ng_sums_sample. */
void S(gmm_ng_sums_propose)(const T *sums, const T *consts, long key, T *mu, T *tau, const T *mu_old,
                            const T *tau_old, T *lp_new, T *lp_old, long L, long B, long I, long D,
                            long per_particle) {
    S(gmm_ng_sums_sample)(sums, consts, key, mu, tau, L, B, I, D, per_particle);
    S(gmm_ng_sums_log_prob)(sums, consts, mu, tau, lp_new, L, B, I, D, per_particle);
    S(gmm_ng_sums_log_prob)(sums, consts, mu_old, tau_old, lp_old, L, B, I, D, per_particle);
}

/* Gradients in the sums (accumulated into gsums, zeroed by the caller, shaped as sums) and in
 * the values, from g (L, B). Parallel over datasets, so shared sums never race. */
void S(gmm_ng_sums_log_prob_backward)(const T *sums, const T *consts, const T *X, const T *TAU, const T *g,
                                      T *gsums, T *gX, T *gTAU, long L, long B, long I, long D,
                                      long per_particle) {
    const T a0 = consts[0], b0 = consts[1], nu0 = consts[2], m0 = consts[3];
    const long W = 1 + 2 * D;
#pragma omp parallel for schedule(static) if (L * B * I * D > PAR_MIN_CELLS)
    for (long b = 0; b < B; ++b)
        for (long l = 0; l < L; ++l) {
            const long lb = l * B + b, row = (per_particle ? lb : b) * I * W;
            const T gl = g[lb];
            for (long i = 0; i < I; ++i) {
                const T *si = sums + row + i * W;
                T *gs = gsums + row + i * W;
                NG_CLUSTER;
                const T psi = S(ng_digamma)(alpha), dmean_dcc = c >= (T)1e-12 ? -1 / cc : 0;
                T gcount = 0;
                for (long d = 0; d < D; ++d) {
                    NG_CELL;
                    const long k = (lb * I + i) * D + d;
                    const T t = TAU[k], e = X[k] - m, half_e2 = (T)0.5 * e * e;
                    /* the cell's partials in m, nu, alpha, beta */
                    const T pm = t * nu * e, pnu = (T)0.5 / nu - t * half_e2;
                    const T palpha = M(log)(beta) - psi + M(log)(t), pbeta = alpha / beta - t;
                    gX[k] = -gl * pm;
                    gTAU[k] = gl * ((alpha - (T)0.5) / t - beta - nu * half_e2);
                    /* to the moments (count, mean, scatter), then to the sums */
                    const T gscatter = raw >= 0 ? (T)0.5 * pbeta : 0;
                    const T gmean = pm * c / nu + pbeta * nu0 * c * dm0 / nu - gscatter * s1;
                    gcount += pnu + pm * (mean - m) / nu + (T)0.5 * palpha +
                              pbeta * (T)0.5 * nu0 * nu0 * dm0 * dm0 / (nu * nu) + gmean * mean * dmean_dcc;
                    gs[1 + d] += gl * (gmean / cc - gscatter * mean);
                    gs[1 + D + d] += gl * gscatter;
                }
                gs[0] += gl * gcount;
            }
        }
}
#undef NG_CLUSTER
#undef NG_CELL

#endif
