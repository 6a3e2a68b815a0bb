/* The rings (DGMM) local proposal and its von Mises draws, one pass per row.
 *
 * In eager PyTorch the local kernel q(c, alpha | x, mu) is ~40 small ops per update over
 * (L, B, N, I) rows: the skip features of d = x_n - mu_i, the pairwise tanh layer, the
 * assignment's log-softmax, atan2, softplus, i0e (all scalar loops in this build) and the
 * von Mises rejection sampler. Here each is one pass (apg/tasks/dgmm/ has the PyTorch
 * twins; tests/apg/tasks/test_dgmm_kernels.py checks both agree, values and gradients).
 *
 * local_forward:  Q[l,b,n,i,:] = Wt tanh(P[b,n,:] + C[l,b,i,:]) + bias + Ws f(x[b,n] - mu[l,b,i])
 *   with the skip features f(d) = (|d|^2 c0, |d| c1, log |d|, d / |d|), |d| clamped at 1e-6,
 *   consts = (c0, c1). Q (L, B, N, I, 4): assignment logit, direction (2), raw concentration.
 *   It runs point-axis-innermost, as tanh_layers.c's pairwise kernels: a block of up to
 *   BLOCK points of P (and x) is transposed once to (H, BLOCK) on the stack and reused for
 *   every (particle, cluster) row, so the tanh layer, the skip features (sqrt, log and
 *   divisions, through libmvec) and the four outputs are vertical vector ops over the
 *   block's points, with no horizontal sum per pair. In float32 the tanh layer uses
 *   fast_tanh.h's exp product, as tanh_layers.c's pairwise kernel (1.6x per call at 1
 *   thread), with the same exact fallback for parts beyond EXP_TANH_MAX.
 * local_backward: gradients of P, C, Wt, bias, Ws (x and mu carry none); rows whose output
 *   gradient is zero (particles whose weight was flushed to 0) are skipped.
 * local_sample:   per row r of Q (R, I, 4): c[r] ~ softmax(Q[r, :, 0]) by inverse CDF with
 *   u[r]; loc[r] = atan2(Q[r,c,2], Q[r,c,1]), k[r] = softplus(Q[r,c,3]) + 1e-3.
 * local_log_prob: lp[r] = log_softmax(Q[r,:,0])[c] + k (cos(alpha - loc) - 1) - log i0e(k)
 *   - log 2 pi, with cos(alpha - loc) = (d . (cos alpha, sin alpha)) / |d| (no atan2);
 *   local_log_prob_backward writes the whole gQ (R, I, 4).
 * centre_pool:    the centre kernel's statistics pooled over each cluster's points: with
 *   Q (L, B, N, 4) = (offset (2), raw log-precision (2)) per point, x (B, N, 2) and c (L, B, N),
 *   S[l,b,c_n,:2] += lambda_n = exp(raw_n), S[l,b,c_n,2:] += lambda_n (x_n - offset_n); S (L, B, I, 4)
 *   zeroed by the caller. centre_pool_backward writes the whole gQ (L, B, N, 4) from gS.
 * ring_residuals: out[l,b] = sum_n |x_n - mu[l,b,c_n] - shape[l,b,n]|^2, the likelihood's squared
 *   residuals with shape = g_theta(alpha); ring_residuals_backward: the gradient in shape only.
 * von_mises:      Best & Fisher candidates as sample_von_mises (same float32-stable form and
 *   the same Philox draws, philox.h, under one key per call), every round until each element
 *   has accepted a candidate; alpha = (theta + loc) mod 2 pi. todo: scratch of n longs.
 *
 * i0e and i1e are Cephes' Chebyshev expansions, as in PyTorch (ATen/native/Math.h).
 * This file includes itself once per dtype (T float, then double).
 */
#ifndef RINGS_BODY
#define RINGS_BODY

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "fast_tanh.h" /* the tanh layer's float32 tanh, as in tanh_layers.c */
#include "philox.h"    /* the von Mises draws' uniforms */
#include "thread_order.h"

static const double I0E_A[30] = {
    -4.41534164647933937950E-18, 3.33079451882223809783E-17, -2.43127984654795469359E-16,
    1.71539128555513303061E-15,  -1.16853328779934516808E-14, 7.67618549860493561688E-14,
    -4.85644678311192946090E-13, 2.95505266312963983461E-12, -1.72682629144155570723E-11,
    9.67580903537323691224E-11,  -5.18979560163526290666E-10, 2.65982372468238665035E-9,
    -1.30002500998624804212E-8,  6.04699502254191894932E-8,  -2.67079385394061173391E-7,
    1.11738753912010371815E-6,   -4.41673835845875056359E-6, 1.64484480707288970893E-5,
    -5.75419501008210370398E-5,  1.88502885095841655729E-4,  -5.76375574538582365885E-4,
    1.63947561694133579842E-3,   -4.32430999505057594430E-3, 1.05464603945949983183E-2,
    -2.37374148058994688156E-2,  4.93052842396707084878E-2,  -9.49010970480476444210E-2,
    1.71620901522208775349E-1,   -3.04682672343198398683E-1, 6.76795274409476084995E-1};
static const double I0E_B[25] = {
    -7.23318048787475395456E-18, -4.83050448594418207126E-18, 4.46562142029675999901E-17,
    3.46122286769746109310E-17,  -2.82762398051658348494E-16, -3.42548561967721913462E-16,
    1.77256013305652638360E-15,  3.81168066935262242075E-15,  -9.55484669882830764870E-15,
    -4.15056934728722208663E-14, 1.54008621752140982691E-14,  3.85277838274214270114E-13,
    7.18012445138366623367E-13,  -1.79417853150680611778E-12, -1.32158118404477131188E-11,
    -3.14991652796324136454E-11, 1.18891471078464383424E-11,  4.94060238822496958910E-10,
    3.39623202570838634515E-9,   2.26666899049817806459E-8,   2.04891858946906374183E-7,
    2.89137052083475648297E-6,   6.88975834691682398426E-5,   3.36911647825569408990E-3,
    8.04490411014108831608E-1};
static const double I1E_A[29] = {
    2.77791411276104639959E-18, -2.11142121435816608115E-17, 1.55363195773620046921E-16,
    -1.10559694773538630805E-15, 7.60068429473540693410E-15, -5.04218550472791168711E-14,
    3.22379336594557470981E-13, -1.98397439776494371520E-12, 1.17361862988909016308E-11,
    -6.66348972350202774223E-11, 3.62559028155211703701E-10, -1.88724975172282928790E-9,
    9.38153738649577178388E-9,  -4.44505912879632808065E-8,  2.00329475355213526229E-7,
    -8.56872026469545474066E-7, 3.47025130813767847674E-6,  -1.32731636560394358279E-5,
    4.78156510755005422638E-5,  -1.61760815825896745588E-4, 5.12285956168575772895E-4,
    -1.51357245063125314899E-3, 4.15642294431288815669E-3,  -1.05640848946261981558E-2,
    2.47264490306265168283E-2,  -5.29459812080949914269E-2, 1.02643658689847095384E-1,
    -1.76416518357834055153E-1, 2.52587186443633654823E-1};
static const double I1E_B[25] = {
    7.51729631084210481353E-18,  4.41434832307170791151E-18,  -4.65030536848935832153E-17,
    -3.20952592199342395980E-17, 2.96262899764595013876E-16,  3.30820231092092828324E-16,
    -1.88035477551078244854E-15, -3.81440307243700780478E-15, 1.04202769841288027642E-14,
    4.27244001671195135429E-14,  -2.10154184277266431302E-14, -4.08355111109219731823E-13,
    -7.19855177624590851209E-13, 2.03562854414708950722E-12,  1.41258074366137813316E-11,
    3.25260358301548823856E-11,  -1.89749581235054123450E-11, -5.58974346219658380687E-10,
    -3.83538038596423702205E-9,  -2.63146884688951950684E-8,  -2.51223623787020892529E-7,
    -3.88256480887769039346E-6,  -1.10588938762623716291E-4,  -9.76109749136146840777E-3,
    7.78576235018280120474E-1};

#define RINGS_CAT_(a, b) a##b
#define RINGS_CAT(a, b) RINGS_CAT_(a, b)
#define S(name) RINGS_CAT(name, SUFFIX)
#define SKIP 5    /* skip features */
#define OUT 4     /* outputs per (point, cluster) pair */
#define BLOCK 64  /* points per block of the local kernels */

#define T float
#define SUFFIX _f32
#define M(fn) fn##f
#define TANH fast_tanhf
#define UNIFORMS philox_uniform2f_many
#define EXP_PAIRS 1
#define MERGE_LOGS 1
#define TRIM_SERIES 1
#define EXP_FLOOR -87.0f /* exp of less is subnormal or 0 */
#include __FILE__
#undef T
#undef SUFFIX
#undef M
#undef EXP_FLOOR
#undef TANH
#undef UNIFORMS
#undef EXP_PAIRS
#undef MERGE_LOGS
#undef TRIM_SERIES

#define T double
#define SUFFIX _f64
#define M(fn) fn
#define TANH tanh
#define UNIFORMS philox_uniform2d_many
#define EXP_PAIRS 0
#define MERGE_LOGS 0
#define TRIM_SERIES 0
#define EXP_FLOOR -708.0
#include __FILE__

#else /* the body, once per dtype */

#include "exp_pairs.h" /* the local layer's exp-product tanh (float32 only) */

/* exp(d) for d <= 0, with results below the smallest normal number set to 0: glibc's
 * underflow path is ~20x slower, and such terms vanish beside the row maximum's exp(0).
 * The argument itself is clamped, not only the result selected: in a vectorized loop exp is
 * evaluated on every lane, and libmvec's SIMD exp hands each out-of-range lane to the scalar
 * exp (underflow path, errno) -- with real logits ~11% of the (row, cluster) gaps are below
 * the floor, which made local_sample and local_log_prob 2-3x slower. */
static inline T S(exp_floor)(T d) { return d < EXP_FLOOR ? EXP_FLOOR : d; }

static inline T S(exp_nonpositive)(T d) {
    const T e = M(exp)(S(exp_floor)(d));
    return d < EXP_FLOOR ? 0 : e;
}

/* softplus(x) for x < EXP_FLOOR is exp(EXP_FLOOR) (~1e-38 in float) instead of exp(x): the
 * concentration adds 1e-3 to it, so both round to the same value. softplus_exp is the exp
 * that softplus and softplus_grad share (the backward computes it once for both). */
static inline T S(softplus_exp)(T x) { return M(exp)(S(exp_floor)(x < 20 ? x : 20)); }

static inline T S(softplus_from)(T x, T z) { return x > 20 ? x : M(log1p)(z); }

static inline T S(softplus)(T x) { return S(softplus_from)(x, S(softplus_exp)(x)); }

static inline T S(softplus_grad_from)(T x, T z) { return x > 20 ? 1 : z / (z + 1); }

/* The block's points n0 .. n0 + nb: pt[h][n] = P[b, n0 + n, h], xs[d][n] = X[b, n0 + n, d],
 * 0 past nb, so whole blocks are computed (and the padding ignored) without branches. */
static inline void S(local_load_block)(const T *p, const T *x, long nb, long H, T (*pt)[BLOCK],
                                       T (*xs)[BLOCK]) {
    for (long h = 0; h < H; ++h) {
        for (long n = 0; n < nb; ++n) pt[h][n] = p[n * H + h];
        for (long n = nb; n < BLOCK; ++n) pt[h][n] = 0;
    }
    for (long d = 0; d < 2; ++d) {
        for (long n = 0; n < nb; ++n) xs[d][n] = x[n * 2 + d];
        for (long n = nb; n < BLOCK; ++n) xs[d][n] = 0;
    }
}

/* The skip features of d = x_n - mu over the block: f[j][n] = (|d|^2 c0, |d| c1, log |d|,
 * d / |d|), |d| clamped at 1e-6. */
static inline void S(skip_block)(T (*xs)[BLOCK], const T *mu, const T *consts, T (*f)[BLOCK]) {
    const T *x0 = xs[0], *x1 = xs[1], mu0 = mu[0], mu1 = mu[1], c0 = consts[0], c1 = consts[1];
    for (long n = 0; n < BLOCK; ++n) {
        const T dx = x0[n] - mu0, dy = x1[n] - mu1;
        const T sq = dx * dx + dy * dy;
        const T clamped = sq > (T)1e-12 ? sq : (T)1e-12, norm = M(sqrt)(clamped);
        f[0][n] = sq * c0;
        f[1][n] = norm * c1;
        /* log |d| as log |d|^2 / 2: GCC (-fopenmp) would fold log(sqrt(s)) into a form
         * that has no libmvec clone, and the whole loop would stay scalar */
        f[2][n] = M(log)(clamped) / 2;
        f[3][n] = dx / norm;
        f[4][n] = dy / norm;
    }
}

void S(local_forward)(const T *X, const T *MU, const T *P, const T *C, const T *Wt, const T *bias,
                      const T *Ws, const T *consts, T *Q, long L, long B, long N, long I, long H) {
    const long blocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
    for (long task = 0; task < B * blocks; ++task) {
        const long b = task / blocks, n0 = task % blocks * BLOCK;
        const long nb = N - n0 < BLOCK ? N - n0 : BLOCK;
        T pt[H][BLOCK], xs[2][BLOCK], ea[EXP_ROWS][BLOCK], eb[EXP_ROWS];
        S(local_load_block)(P + (b * N + n0) * H, X + (b * N + n0) * 2, nb, H, pt, xs);
        const int block_exp = EXP_BLOCK(pt, H, ea);
        for (long l = 0; l < L; ++l)
            for (long i = 0; i < I; ++i) {
                const long li = (l * B + b) * I + i;
                const T *c = C + li * H;
                const int row_exp = block_exp && EXP_ROW(c, H, eb);
                T f[SKIP][BLOCK], acc[OUT][BLOCK];
                S(skip_block)(xs, MU + li * 2, consts, f);
                for (long o = 0; o < OUT; ++o) {
                    const T *ws = Ws + o * SKIP;
                    for (long n = 0; n < BLOCK; ++n)
                        acc[o][n] = bias[o] + ws[0] * f[0][n] + ws[1] * f[1][n] + ws[2] * f[2][n] +
                                    ws[3] * f[3][n] + ws[4] * f[4][n];
                }
                if (row_exp)
                    S(pair_tanh_accumulate)((const T(*)[BLOCK])pt, (const T(*)[BLOCK])ea, c, eb, Wt, acc, H, OUT);
                else
                    S(pair_tanh_accumulate)((const T(*)[BLOCK])pt, NULL, c, eb, Wt, acc, H, OUT);
                T *q = Q + (((l * B + b) * N + n0) * I + i) * OUT;
                for (long n = 0; n < nb; ++n)
                    for (long o = 0; o < OUT; ++o) q[n * I * OUT + o] = acc[o][n];
            }
    }
}

/* Row by row, as before the blocked forward: in training ~90% of the rows' output gradients
 * are zero, scattered within blocks of points (particles flushed to weight 0, clusters whose
 * softmax share underflowed), and skipping them one by one beats any blocked form measured. */
static inline void S(skip_features)(T dx, T dy, const T *consts, T *f) {
    const T sq = dx * dx + dy * dy;
    const T norm = M(sqrt)(sq > (T)1e-12 ? sq : (T)1e-12);
    f[0] = sq * consts[0];
    f[1] = norm * consts[1];
    f[2] = M(log)(norm);
    f[3] = dx / norm;
    f[4] = dy / norm;
}

void S(local_backward)(const T *X, const T *MU, const T *P, const T *C, const T *Wt,
                       const T *consts, const T *G, T *gP, T *gC, T *gWt, T *gbias, T *gWs, long L,
                       long B, long N, long I, long H) {
    /* each thread's gWt, gbias and gWs, in one row */
    const long part = OUT * H + OUT + OUT * SKIP;
    T *parts = THREAD_PARTS(T, part);
    T fallback[parts ? 1 : part];
    if (!parts) memset(fallback, 0, sizeof(fallback));
    int team = 1;
#pragma omp parallel if (parts != NULL)
    {
        T t[H], a[H], gp[H], gwt[OUT * H], gb[OUT], gws[OUT * SKIP], f[SKIP];
        memset(gwt, 0, sizeof(gwt));
        memset(gb, 0, sizeof(gb));
        memset(gws, 0, sizeof(gws));
        /* Threads split the datasets b: the gP and gC rows they write are their own. */
#pragma omp for schedule(static)
        for (long b = 0; b < B; ++b)
            for (long l = 0; l < L; ++l)
                for (long n = 0; n < N; ++n) {
                    const T *p = P + (b * N + n) * H, *x = X + (b * N + n) * 2;
                    int any = 0;
                    for (long i = 0; i < I; ++i) {
                        const long li = (l * B + b) * I + i;
                        const T *g = G + (((l * B + b) * N + n) * I + i) * OUT;
                        if (g[0] == 0 && g[1] == 0 && g[2] == 0 && g[3] == 0) continue;
                        if (!any) memset(gp, 0, sizeof(gp));
                        any = 1;
                        const T *c = C + li * H, *mu = MU + li * 2;
                        T *gc = gC + li * H;
                        S(skip_features)(x[0] - mu[0], x[1] - mu[1], consts, f);
                        for (long h = 0; h < H; ++h) t[h] = TANH(p[h] + c[h]);
                        for (long h = 0; h < H; ++h) a[h] = 0;
                        for (long o = 0; o < OUT; ++o) {
                            const T go = g[o];
                            const T *w = Wt + o * H;
                            T *gw = gwt + o * H;
                            for (long h = 0; h < H; ++h) {
                                a[h] += w[h] * go;
                                gw[h] += t[h] * go;
                            }
                            gb[o] += go;
                            for (long j = 0; j < SKIP; ++j) gws[o * SKIP + j] += go * f[j];
                        }
                        for (long h = 0; h < H; ++h) {
                            a[h] *= 1 - t[h] * t[h];
                            gp[h] += a[h];
                            gc[h] += a[h];
                        }
                    }
                    if (any) {
                        T *gpr = gP + (b * N + n) * H;
                        for (long h = 0; h < H; ++h) gpr[h] += gp[h];
                    }
                }
        {
            T *mine = MY_ROW(parts, fallback, part);
            for (long k = 0; k < OUT * H; ++k) mine[k] += gwt[k];
            for (long k = 0; k < OUT; ++k) mine[OUT * H + k] += gb[k];
            for (long k = 0; k < OUT * SKIP; ++k) mine[OUT * H + OUT + k] += gws[k];
        }
        TEAM_SIZE(team);
    }
    for (int t = 0; t < team; ++t) {
        const T *row = ROW(parts, fallback, part, t);
        for (long k = 0; k < OUT * H; ++k) gWt[k] += row[k];
        for (long k = 0; k < OUT; ++k) gbias[k] += row[OUT * H + k];
        for (long k = 0; k < OUT * SKIP; ++k) gWs[k] += row[OUT * H + OUT + k];
    }
    free(parts);
}

/* Rows are taken CHUNK at a time, and every loop runs over the chunk's rows (row axis
 * innermost), so each is a vertical SIMD loop: the transcendental functions through libmvec,
 * the max over clusters as I vector max ops, the inverse-CDF pick as I - 1 compare-and-count
 * steps instead of a search with a break, and the component's fields as I - 1 vector selects.
 *
 * The chunk's rows are first transposed into qt (load_rows: one loop over each row's I * OUT
 * fields; with I = 4 a row is 16 values and gcc loads 16 rows as 16 vector loads and 64
 * two-source permutes), and every later loop reads qt. Before, the logits alone were loaded
 * by a strided loop (15 permutes per field per 16 rows) and the chosen component's four fields
 * by a scalar indexed load per row (~0.25 of local_log_prob's 0.6 ms at 1 thread, beside
 * ~0.15 ms for reading Q's 2.5 MB at all); selects over one strided load per field had been
 * slower still (240 permutes per 16 rows).
 *
 * A chunk's body is inlined twice (BY_SHAPE): with I = 4 (the paper's rings) and n = CHUNK
 * compile-time constants, and with both at run time (other I, and the last, partial chunk):
 * with the row stride I * OUT unknown gcc does not vectorize the transposition, and loops of a
 * known trip count need no remainder code. */
#define CHUNK 64
#define CHUNK_BODY static inline __attribute__((always_inline)) void
/* the chunk's body for I = 4 and a full chunk, and for any other I or n */
#define BY_SHAPE(call_with_I_n) \
    if (I == 4 && n == CHUNK)   \
        call_with_I_n(4, CHUNK); \
    else                        \
        call_with_I_n(I, n)

/* qt[j * CHUNK + r] = Q[r0 + r, j / OUT, j % OUT], the chunk's rows transposed. */
CHUNK_BODY S(load_rows)(const T *Q, long r0, long n, long I, T *qt) {
    const T *q = Q + r0 * I * OUT;
    for (long r = 0; r < n; ++r)
        for (long j = 0; j < I * OUT; ++j) qt[j * CHUNK + r] = q[r * I * OUT + j];
}

/* Per row of the chunk: m[r] the max of the logits qt[i * OUT * CHUNK + r], e[i * CHUNK + r] =
 * exp(logit - max), total[r] = sum_i e (summed in cluster order). */
CHUNK_BODY S(softmax_terms)(const T *qt, long n, long I, T *m, T *e, T *total) {
    for (long r = 0; r < n; ++r) m[r] = qt[r];
    for (long i = 1; i < I; ++i) {
        const T *lg = qt + i * OUT * CHUNK;
        for (long r = 0; r < n; ++r) m[r] = lg[r] > m[r] ? lg[r] : m[r];
    }
    for (long r = 0; r < n; ++r) total[r] = 0;
    for (long i = 0; i < I; ++i) {
        const T *lg = qt + i * OUT * CHUNK;
        for (long r = 0; r < n; ++r) {
            const T v = S(exp_nonpositive)(lg[r] - m[r]);
            e[i * CHUNK + r] = v;
            total[r] += v;
        }
    }
}

/* The four fields of each row's component pick[r]: logit, dx, dy, raw concentration. */
CHUNK_BODY S(chosen_fields)(const T *qt, const int *pick, long n, long I, T *lg, T *dx, T *dy,
                            T *raw) {
    for (long r = 0; r < n; ++r) {
        lg[r] = qt[r];
        dx[r] = qt[CHUNK + r];
        dy[r] = qt[2 * CHUNK + r];
        raw[r] = qt[3 * CHUNK + r];
    }
    for (long i = 1; i < I; ++i) {
        const T *f = qt + i * OUT * CHUNK;
        for (long r = 0; r < n; ++r) {
            const int on = pick[r] == i;
            lg[r] = on ? f[r] : lg[r];
            dx[r] = on ? f[CHUNK + r] : dx[r];
            dy[r] = on ? f[2 * CHUNK + r] : dy[r];
            raw[r] = on ? f[3 * CHUNK + r] : raw[r];
        }
    }
}

CHUNK_BODY S(sample_chunk)(const T *Q, const T *u, long *c, T *loc, T *k, long r0, long n, long I) {
    T qt[I * OUT * CHUNK], m[CHUNK], e[I * CHUNK], total[CHUNK], target[CHUNK], cum[CHUNK];
    T lg[CHUNK], dx[CHUNK], dy[CHUNK], raw[CHUNK];
    int pick[CHUNK];
    S(load_rows)(Q, r0, n, I, qt);
    S(softmax_terms)(qt, n, I, m, e, total);
    /* The first i < I - 1 with cum_i > target, else I - 1: as cum_i never decreases, the
     * number of i < I - 1 with cum_i <= target. target is scaled by the row's own total, so
     * round-off can never step past the end. */
    for (long r = 0; r < n; ++r) {
        target[r] = u[r0 + r] * total[r];
        cum[r] = 0;
        pick[r] = 0;
    }
    for (long i = 0; i < I - 1; ++i)
        for (long r = 0; r < n; ++r) {
            cum[r] += e[i * CHUNK + r];
            pick[r] += cum[r] <= target[r];
        }
    S(chosen_fields)(qt, pick, n, I, lg, dx, dy, raw);
    for (long r = 0; r < n; ++r) c[r0 + r] = pick[r];
    for (long r = 0; r < n; ++r) {
        loc[r0 + r] = M(atan2)(dy[r], dx[r]);
        k[r0 + r] = S(softplus)(raw[r]) + (T)1e-3;
    }
}

void S(local_sample)(const T *Q, const T *u, long *c, T *loc, T *k, long R, long I) {
#pragma omp parallel for schedule(static)
    for (long r0 = 0; r0 < R; r0 += CHUNK) {
        const long n = R - r0 < CHUNK ? R - r0 : CHUNK;
#define SAMPLE_CHUNK(i, n) S(sample_chunk)(Q, u, c, loc, k, r0, n, i)
        BY_SHAPE(SAMPLE_CHUNK);
#undef SAMPLE_CHUNK
    }
}

/* CHUNK values as one of GCC's generic vectors, which gcc splits into the target's registers. */
typedef T S(chunk_vec) __attribute__((vector_size(sizeof(T) * CHUNK)));

/* Cephes' chbevl (sum of the Chebyshev series a, as in PyTorch) at x[r] for all CHUNK r, the
 * CHUNK recurrences advancing together: each step is CHUNK / lanes independent FMAs. Written
 * per row, the row loop vectorized and the recurrence unrolled within it, each vector's ~30
 * dependent FMAs ran back to back, and i0e cost ~4x its arithmetic (~20% of local_log_prob). */
static inline void S(chbevl_chunk)(const T *x, const double *a, int len, T *out) {
    S(chunk_vec) vx, b0, b1 = {0}, b2 = {0};
    memcpy(&vx, x, sizeof vx);
    b0 = b1 + (T)a[0];
#pragma GCC unroll 32
    for (int i = 1; i < len; ++i) {
        b2 = b1;
        b1 = b0;
        b0 = vx * b1 - b2 + (T)a[i];
    }
    b0 = (T)0.5 * (b0 - b2);
    memcpy(out, &b0, sizeof b0);
}

/* Where a series starts: float32 drops the leading coefficients whose sum is below 1e-9 of
 * the series' least value on its interval (0.14 for I0E_A, 0.016 for I1E_A (i1e / k), 0.37
 * for the B series): 20, 8, 20 and 8 of the 30, 25, 29 and 25 terms, a change below 0.02 of
 * float32's rounding (PyTorch's own float i1e drops more: 17 and 7 terms). Float64 sums all. */
#define SERIES(a, skip) (a) + TRIM_SERIES * (skip), (int)(sizeof(a) / sizeof(a[0])) - TRIM_SERIES * (skip)

/* i0 = exp(-k) I0(k) and (where i1 is not NULL) i1 = exp(-k) I1(k) for the CHUNK values k > 0
 * (k[r], n <= r < CHUNK, any valid value): Cephes' expansions on (0, 8] ("low") and (8, inf)
 * ("high"), each on its own interval's clamped argument, selected by k <= 8 (NaN: high). Only
 * the expansions that the first n values need are evaluated, one branch per chunk: a select of
 * both made every row pay ~55 steps (~110 with i1e) where it needs ~30 (~60). */
CHUNK_BODY S(bessel_chunk)(const T *k, long n, T *i0, T *i1) {
    int low = 0, high = 0;
    for (long r = 0; r < n; ++r) {
        low |= k[r] <= 8;
        high |= !(k[r] <= 8);
    }
    T x[CHUNK], lo0[CHUNK], lo1[CHUNK], root[CHUNK];
    T *a0 = high ? lo0 : i0, *a1 = high ? lo1 : i1; /* low expansions: in place if alone */
    if (low) {
        for (long r = 0; r < CHUNK; ++r) x[r] = (k[r] < 8 ? k[r] : 8) / 2 - 2;
        S(chbevl_chunk)(x, SERIES(I0E_A, 10), a0);
        if (i1) {
            S(chbevl_chunk)(x, SERIES(I1E_A, 9), a1);
            for (long r = 0; r < CHUNK; ++r) a1[r] *= k[r] < 8 ? k[r] : 8;
        }
    }
    if (high) {
        for (long r = 0; r < CHUNK; ++r) {
            const T h = k[r] > 8 ? k[r] : 8;
            x[r] = 32 / h - 2;
            root[r] = M(sqrt)(h);
        }
        T b0[CHUNK], b1[CHUNK];
        S(chbevl_chunk)(x, SERIES(I0E_B, 17), b0);
        if (i1) S(chbevl_chunk)(x, SERIES(I1E_B, 17), b1);
        for (long r = 0; r < CHUNK; ++r) i0[r] = low && k[r] <= 8 ? a0[r] : b0[r] / root[r];
        if (i1)
            for (long r = 0; r < CHUNK; ++r) i1[r] = low && k[r] <= 8 ? a1[r] : b1[r] / root[r];
    }
}

/* The chunk's rows under their own component pick[r] = c: the von Mises pieces cos and sin
 * of (alpha - atan2(dy, dx)) (atan2(0, 0) = 0), 1 / |d|^2 (0 where d = 0), k (8 past n, for
 * bessel_chunk) and softplus_exp(raw); m, e and total as softmax_terms; lg, dx, dy and raw
 * the component's fields. */
CHUNK_BODY S(chosen_terms)(const T *Q, const long *c, const T *alpha, long r0, long n, long I,
                           T *cos_d, T *sin_d, T *inv_rho2, T *k, T *z, T *m, T *e, T *total,
                           T *lg, T *dx, T *dy, T *raw, int *pick) {
    T qt[I * OUT * CHUNK], ca[CHUNK], sa[CHUNK];
    S(load_rows)(Q, r0, n, I, qt);
    S(softmax_terms)(qt, n, I, m, e, total);
    for (long r = 0; r < n; ++r) pick[r] = (int)c[r0 + r];
    S(chosen_fields)(qt, pick, n, I, lg, dx, dy, raw);
    /* separate loops: cos and sin of one value would be fused into a scalar sincos call */
    for (long r = 0; r < n; ++r) ca[r] = M(cos)(alpha[r0 + r]);
    for (long r = 0; r < n; ++r) sa[r] = M(sin)(alpha[r0 + r]);
    for (long r = 0; r < n; ++r) {
        const T rho2 = dx[r] * dx[r] + dy[r] * dy[r];
        const T inv = rho2 > 0 ? 1 / M(sqrt)(rho2 > 0 ? rho2 : 1) : 0;
        cos_d[r] = rho2 > 0 ? (dx[r] * ca[r] + dy[r] * sa[r]) * inv : ca[r];
        sin_d[r] = rho2 > 0 ? (dx[r] * sa[r] - dy[r] * ca[r]) * inv : sa[r];
        inv_rho2[r] = inv * inv;
        z[r] = S(softplus_exp)(raw[r]);
        k[r] = S(softplus_from)(raw[r], z[r]) + (T)1e-3;
    }
    for (long r = n; r < CHUNK; ++r) k[r] = 8;
}

CHUNK_BODY S(log_prob_chunk)(const T *Q, const long *c, const T *alpha, T *lp, long r0, long n,
                             long I) {
    const T log_two_pi = (T)1.8378770664093453;
    T cos_d[CHUNK], sin_d[CHUNK], inv_rho2[CHUNK], k[CHUNK], z[CHUNK], i0[CHUNK];
    T m[CHUNK], e[I * CHUNK], total[CHUNK], lg[CHUNK], dx[CHUNK], dy[CHUNK], raw[CHUNK];
    int pick[CHUNK];
    S(chosen_terms)(Q, c, alpha, r0, n, I, cos_d, sin_d, inv_rho2, k, z, m, e, total, lg, dx, dy,
                    raw, pick);
    S(bessel_chunk)(k, n, i0, NULL);
#if MERGE_LOGS
    /* log total + log i0e(k) as the log of the product (total in [1, I], i0e in (0, 1]: no
     * overflow or underflow), one libmvec log per row fewer; float32 only, as it rounds
     * differently (float64 keeps the two logs, its results as before) */
    for (long r = 0; r < n; ++r) lg[r] -= m[r];
    for (long r = 0; r < n; ++r)
        lp[r0 + r] = lg[r] + k[r] * (cos_d[r] - 1) - M(log)(total[r] * i0[r]) - log_two_pi;
#else
    for (long r = 0; r < n; ++r) lg[r] -= m[r] + M(log)(total[r]);
    for (long r = 0; r < n; ++r) lp[r0 + r] = lg[r] + k[r] * (cos_d[r] - 1) - M(log)(i0[r]) - log_two_pi;
#endif
}

void S(local_log_prob)(const T *Q, const long *c, const T *alpha, T *lp, long R, long I) {
#pragma omp parallel for schedule(static)
    for (long r0 = 0; r0 < R; r0 += CHUNK) {
        const long n = R - r0 < CHUNK ? R - r0 : CHUNK;
#define LOG_PROB_CHUNK(i, n) S(log_prob_chunk)(Q, c, alpha, lp, r0, n, i)
        BY_SHAPE(LOG_PROB_CHUNK);
#undef LOG_PROB_CHUNK
    }
}

/* gQ's rows of the chunk, all I * OUT entries of each: d/d logit_i = g ([i == c] - softmax_i),
 * with softmax_i = e_i / total; the chosen component's direction and raw concentration as
 * below; every other entry, and every entry of rows with g = 0, an exact zero. */
CHUNK_BODY S(log_prob_backward_chunk)(const T *Q, const long *c, const T *alpha, const T *g, T *gQ,
                                      long r0, long n, long I) {
    T cos_d[CHUNK], sin_d[CHUNK], inv_rho2[CHUNK], k[CHUNK], z[CHUNK], i0[CHUNK], i1[CHUNK];
    T m[CHUNK], e[I * CHUNK], total[CHUNK], lg[CHUNK], dx[CHUNK], dy[CHUNK], raw[CHUNK];
    T g_dx[CHUNK], g_dy[CHUNK], g_raw[CHUNK], g_soft[CHUNK];
    int pick[CHUNK];
    S(chosen_terms)(Q, c, alpha, r0, n, I, cos_d, sin_d, inv_rho2, k, z, m, e, total, lg, dx, dy,
                    raw, pick);
    S(bessel_chunk)(k, n, i0, i1);
    for (long r = 0; r < n; ++r) {
        const T gr = g[r0 + r];
        /* d cos(alpha - loc) / d loc = sin(alpha - loc); d loc / d d = (-dy, dx) / |d|^2 */
        const T g_dir = gr * k[r] * sin_d[r] * inv_rho2[r];
        g_dx[r] = -g_dir * dy[r];
        g_dy[r] = g_dir * dx[r];
        /* d/dk [k (cos - 1) - log i0e(k)] = cos - i1e(k) / i0e(k) */
        g_raw[r] = gr * (cos_d[r] - i1[r] / i0[r]) * S(softplus_grad_from)(raw[r], z[r]);
        g_soft[r] = -gr / total[r];
    }
    /* zeroed by one memset, then only the I logits and the chosen component's three fields
     * of rows with g != 0 are stored (a select per entry was 16 scalar stores per row) */
    for (long i = 0; i < I; ++i) /* the logits' gradients, in place of e */
        for (long r = 0; r < n; ++r)
            e[i * CHUNK + r] = g_soft[r] * e[i * CHUNK + r] + (pick[r] == i ? g[r0 + r] : 0);
    T *gq = gQ + r0 * I * OUT;
    memset(gq, 0, sizeof(T) * n * I * OUT);
    for (long r = 0; r < n; ++r) {
        if (g[r0 + r] == 0) continue;
        T *row = gq + r * I * OUT;
        for (long i = 0; i < I; ++i) row[i * OUT] = e[i * CHUNK + r];
        T *chosen = row + pick[r] * OUT;
        chosen[1] = g_dx[r];
        chosen[2] = g_dy[r];
        chosen[3] = g_raw[r];
    }
}

void S(local_log_prob_backward)(const T *Q, const long *c, const T *alpha, const T *g, T *gQ,
                                long R, long I) {
#pragma omp parallel for schedule(static)
    for (long r0 = 0; r0 < R; r0 += CHUNK) {
        const long n = R - r0 < CHUNK ? R - r0 : CHUNK;
        int any = 0;
        for (long r = 0; r < n; ++r) any |= g[r0 + r] != 0;
        if (!any) { /* particles whose weight was flushed to 0 */
            memset(gQ + r0 * I * OUT, 0, sizeof(T) * n * I * OUT);
            continue;
        }
#define BACKWARD_CHUNK(i, n) S(log_prob_backward_chunk)(Q, c, alpha, g, gQ, r0, n, i)
        BY_SHAPE(BACKWARD_CHUNK);
#undef BACKWARD_CHUNK
    }
}

/* Best & Fisher rounds for the chunk's m elements, element numbers el[0 .. m), from round
 * `first` until every one has accepted a candidate or `rounds` is reached: each round draws
 * `candidates` candidates per element (Philox draw r * candidates + j, so an element's draws
 * do not depend on which chunk or pass runs it) and keeps its first accepted one. Every
 * element of the chunk runs every round (branch-free vector loops); those already done
 * ignore the result. Writes alpha and accepted for the chunk's elements. */
CHUNK_BODY S(von_mises_chunk)(const long *el, long m, const T *loc, const T *conc, uint64_t key,
                              long candidates, long first, long rounds, T *alpha, unsigned char *accepted) {
    const T two_pi = (T)6.283185307179586, half_pi = (T)1.5707963267948966;
    T rm1[CHUNK], scale[CHUNK], draw[CHUNK], theta[CHUNK];
    unsigned char ok[CHUNK], done[CHUNK];
    for (long e = 0; e < m; ++e) {
        const T k = conc[el[e]] > (T)1e-6 ? conc[el[e]] : (T)1e-6;
        const T s = M(hypot)(1, 2 * k); /* sqrt(1 + 4 k^2) without overflow */
        const T tau = 1 + s, root = M(sqrt)(2 * tau);
        const T rho = 2 * k / (tau + root);
        const T one_minus_rho = (1 + 1 / (s + 2 * k) + root) / (tau + root);
        rm1[e] = one_minus_rho * one_minus_rho / (2 * rho);
        scale[e] = k * rm1[e] * (rm1[e] + 2);
        done[e] = 0;
        theta[e] = 0;
    }
    for (long r = first; r < rounds; ++r) {
        for (long j = 0; j < candidates; ++j) {
            T u0[CHUNK], u1[CHUNK], half[CHUNK], ch[CHUNK], sh[CHUNK];
            UNIFORMS(key, el, (uint32_t)(r * candidates + j), m, u0, u1);
            for (long e = 0; e < m; ++e) half[e] = half_pi * (u0[e] < (T)0.5 ? 2 * u0[e] : 2 * u0[e] - 1);
            /* separate loops: cos and sin of one value would be fused into a scalar sincos call */
            for (long e = 0; e < m; ++e) ch[e] = M(cos)(half[e]);
            for (long e = 0; e < m; ++e) sh[e] = M(sin)(half[e]);
            for (long e = 0; e < m; ++e) {
                const T r_plus_z = rm1[e] + 2 * ch[e] * ch[e];
                const T cc = scale[e] / r_plus_z;
                ok[e] = (cc * (2 - cc) > u1[e]) | (M(log)(cc / u1[e]) + 1 >= cc);
                T gap = (T)0.5 * rm1[e] * (2 * sh[e] * sh[e]) / r_plus_z;
                gap = gap < 0 ? 0 : (gap > 1 ? 1 : gap);
                const T magnitude = 2 * M(asin)(M(sqrt)(gap));
                draw[e] = u0[e] < (T)0.5 ? -magnitude : magnitude;
            }
            for (long e = 0; e < m; ++e) {
                theta[e] = (ok[e] && !done[e]) ? draw[e] : theta[e];
                done[e] |= ok[e];
            }
        }
        int left = 0;
        for (long e = 0; e < m; ++e) left |= !done[e];
        if (!left) break;
    }
    /* (theta + loc) mod 2 pi as torch.remainder (fmod, then + 2 pi if negative). For
     * -2 pi < a < 4 pi, fmod(a, 2 pi) is a or a - 2 pi, both exact; fmod itself compiles to
     * a slow x87 loop, so only the rare others (|loc| > pi) take it. Elements not done get
     * their alpha at a later pass. */
    T out[CHUNK], lc[CHUNK];
    int wild = 0;
    for (long e = 0; e < m; ++e) lc[e] = loc[el[e]];
    for (long e = 0; e < m; ++e) {
        T a = theta[e] + lc[e];
        wild |= !(a > -two_pi && a < 2 * two_pi);
        a = a >= two_pi ? a - two_pi : a;
        a = a < 0 ? a + two_pi : a;
        out[e] = a >= two_pi ? 0 : a;
    }
    if (wild)
        for (long e = 0; e < m; ++e) {
            T a = theta[e] + lc[e];
            if (a > -two_pi && a < 2 * two_pi) continue;
            a = M(fmod)(a, two_pi);
            a = a < 0 ? a + two_pi : a;
            out[e] = a >= two_pi ? 0 : a;
        }
    for (long e = 0; e < m; ++e) {
        alpha[el[e]] = out[e];
        accepted[el[e]] = done[e];
    }
}

void S(von_mises)(const T *loc, const T *conc, long key, T *alpha, unsigned char *accepted, long *todo,
                  long n, long candidates) {
    /* Pass 1: one round for every element, in chunks of consecutive elements. */
#pragma omp parallel for schedule(static)
    for (long e0 = 0; e0 < n; e0 += CHUNK) {
        const long m = n - e0 < CHUNK ? n - e0 : CHUNK;
        long el[CHUNK];
        for (long e = 0; e < m; ++e) el[e] = e0 + e;
        S(von_mises_chunk)(el, m, loc, conc, (uint64_t)key, candidates, 0, 1, alpha, accepted);
    }
    /* Pass 2: the few left (each candidate is accepted with probability >= 0.65) gathered
     * into dense chunks, so that their further rounds stay vector loops over full chunks
     * rather than over a chunk of mostly finished elements. The cap on rounds only guards
     * against a bug: reaching it (probability < 0.35^(1000 candidates)) leaves accepted = 0. */
    long left = 0;
    for (long e = 0; e < n; ++e)
        if (!accepted[e]) todo[left++] = e;
#pragma omp parallel for schedule(static)
    for (long k0 = 0; k0 < left; k0 += CHUNK) {
        const long m = left - k0 < CHUNK ? left - k0 : CHUNK;
        S(von_mises_chunk)(todo + k0, m, loc, conc, (uint64_t)key, candidates, 1, 1000, alpha, accepted);
    }
}

void S(centre_pool)(const T *Q, const T *X, const long *c, T *Sums, long L, long B, long N, long I) {
#pragma omp parallel for schedule(static)
    for (long lb = 0; lb < L * B; ++lb) {
        const T *x = X + (lb % B) * N * 2;
        T *s = Sums + lb * I * 4;
        for (long n = 0; n < N; ++n) {
            const T *q = Q + (lb * N + n) * 4;
            T *si = s + c[lb * N + n] * 4;
            for (long d = 0; d < 2; ++d) {
                const T lam = M(exp)(q[2 + d]);
                si[d] += lam;
                si[2 + d] += lam * (x[n * 2 + d] - q[d]);
            }
        }
    }
}

void S(centre_pool_backward)(const T *Q, const T *X, const long *c, const T *gS, T *gQ, long L, long B,
                             long N, long I) {
#pragma omp parallel for schedule(static)
    for (long lb = 0; lb < L * B; ++lb) {
        const T *x = X + (lb % B) * N * 2;
        for (long n = 0; n < N; ++n) {
            const T *q = Q + (lb * N + n) * 4;
            const T *g = gS + (lb * I + c[lb * N + n]) * 4;
            T *gq = gQ + (lb * N + n) * 4;
            for (long d = 0; d < 2; ++d) {
                const T lam = M(exp)(q[2 + d]);
                gq[d] = -g[2 + d] * lam;
                gq[2 + d] = (g[d] + g[2 + d] * (x[n * 2 + d] - q[d])) * lam;
            }
        }
    }
}

/* ring_residuals: out[l,b] = sum_n |x_n - mu[l,b,c_n] - shape[l,b,n]|^2, the likelihood's
 * squared residuals (x (B, N, 2), mu (L, B, I, 2), c (L, B, N), shape (L, B, N, 2));
 * ring_residuals_backward: gshape[l,b,n] = -2 g[l,b] (x_n - mu[l,b,c_n] - shape[l,b,n]). */
void S(ring_residuals)(const T *X, const T *MU, const long *c, const T *shape, T *out, long L, long B,
                       long N, long I) {
#pragma omp parallel for schedule(static)
    for (long lb = 0; lb < L * B; ++lb) {
        const T *x = X + (lb % B) * N * 2, *mu = MU + lb * I * 2, *s = shape + lb * N * 2;
        const long *cn = c + lb * N;
        T total = 0;
        for (long n = 0; n < N; ++n) {
            const T *m = mu + cn[n] * 2;
            const T e0 = x[2 * n] - m[0] - s[2 * n], e1 = x[2 * n + 1] - m[1] - s[2 * n + 1];
            total += e0 * e0 + e1 * e1;
        }
        out[lb] = total;
    }
}

void S(ring_residuals_backward)(const T *X, const T *MU, const long *c, const T *shape, const T *g,
                                T *gshape, long L, long B, long N, long I) {
#pragma omp parallel for schedule(static)
    for (long lb = 0; lb < L * B; ++lb) {
        const T *x = X + (lb % B) * N * 2, *mu = MU + lb * I * 2, *s = shape + lb * N * 2;
        const long *cn = c + lb * N;
        const T scale = -2 * g[lb];
        T *gs = gshape + lb * N * 2;
        for (long n = 0; n < N; ++n) {
            const T *m = mu + cn[n] * 2;
            gs[2 * n] = scale * (x[2 * n] - m[0] - s[2 * n]);
            gs[2 * n + 1] = scale * (x[2 * n + 1] - m[1] - s[2 * n + 1]);
        }
    }
}

#endif
