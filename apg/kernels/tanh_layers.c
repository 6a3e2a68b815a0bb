/* Fused one-hidden-layer tanh networks for the mixture tasks' hottest loops.
 *
 * Their hidden tensors ((L, B, N, I, H) per (point, cluster) pair, (M, H) per point) are
 * the largest in a training step. Here they never exist: the forward keeps nothing and the
 * backward recomputes the tanh instead of reading a saved tensor. Compiled with -O3
 * -ffast-math so the loops vectorize (glibc's libmvec tanh), and with OpenMP: loaded
 * after torch, the library binds to torch's own libgomp (same soname), so its parallel
 * loops share torch's threads and follow torch.set_num_threads. All arrays contiguous;
 * backward functions accumulate into zeroed gradient arrays. Gradients of shared inputs
 * go to per-thread buffers first, added into the output in thread order after the parallel
 * region (thread_order.h): runs at one thread count give the same bits.
 *
 * pairwise: out[l,b,n,i,:] = Wt tanh(P[l,b,n,:] + C[l,b,i,:]) with P (Lp, B, N, H),
 *   Lp = 1 (shared by every particle) or L; C (L, B, I, H); Wt (O, H) the output weight
 *   transposed; G and out (L, B, N, I, O). The point axis is innermost: a block of up to
 *   BLOCK points is transposed once to (H, BLOCK) on the stack and reused for every
 *   (particle, cluster) row, and the loops run over h outside, the block's points inside.
 *   So every vector op is vertical (the output, O = 1 in the GMM, is a dot over h, which
 *   vectorized over h would end in a horizontal sum per pair), and the cluster's row
 *   c[h] is one broadcast scalar. Threads split (dataset, block) in the forward and the
 *   datasets b in the backward, so gP and gC rows are never shared.
 *   In float32 the pair's tanh uses that its argument is a sum (fast_tanh.h's exp_pair_tanh):
 *   ea = exp(2 a) is taken once per point and hidden unit when a block is loaded, eb =
 *   exp(2 b) once per (particle, cluster) row, and tanh(a + b) = 1 - 2 / (1 + ea eb): the
 *   forward is ~2x, the backward ~1.6x faster at the GMM's sizes. A block with some |a|, or
 *   a row with some |b|, beyond EXP_TANH_MAX takes TANH instead; so do calls whose blocks
 *   serve fewer than EXP_MIN_ROWS rows (per-particle P with few clusters), where the
 *   block's exps would cost more than they save.
 * scaled_pairwise: out[l,b,n,i] = sum_h w[h] tanh(sum_d A[l,b,i,d,h] X[b,n,d] + C[l,b,i,h]) with
 *   X (B, N, D), A (L, B, I, D, H), C (L, B, I, H), w (H); G and out (L, B, N, I). The GMM's
 *   assignment network on standardized offsets (x_n - mu_i) sqrt(tau_i): the first layer's
 *   weight is scaled per cluster (A = W sqrt(tau_i)), so the pre-activation is no sum of a
 *   point part and a cluster part and pairwise's exp products do not apply; the layout is
 *   pairwise's (a block of points transposed to (D, BLOCK), rows broadcast). Threads split
 *   (dataset, block) in the forward and the (particle, dataset) rows in the backward, whose
 *   gA and gC rows are then never shared; gw goes through per-thread rows (thread_order.h).
 * pointwise: out[m,:] = W2t tanh(W1 u[m,:] + b1) + b2 with u (M, D), W1t (D, H) the first
 *   weight transposed, b1 (H), W2t (O, H), b2 (O); G and out (M, O). With `angles`, u is
 *   (M,) angles and the rows' features are (cos u, sin u), D = 2, formed in the kernel. Likewise row axis innermost:
 *   a block of BLOCK rows is transposed to (D, BLOCK), each hidden unit is computed for the
 *   whole block at once; the backward keeps the weight gradients in vector lanes until the
 *   end, skips blocks whose output gradient is all zero, and computes gU only when want_gU
 *   (the rings' networks read sampled angles, which take none). Threads split the blocks.
 *
 * This file includes itself once per dtype (T float, then double).
 */
#ifndef TANH_LAYERS_BODY
#define TANH_LAYERS_BODY

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "thread_order.h"

#define TL_CAT_(a, b) a##b
#define TL_CAT(a, b) TL_CAT_(a, b)
#define S(name) TL_CAT(name, SUFFIX)
#define BLOCK 64 /* points (rows) per block */
#define INLINE static inline __attribute__((always_inline))

/* float32 tanh: fast_tanh.h's rational fit; float64: libm's tanh. */
#include "fast_tanh.h"

/* The float32 exp-product tanh (fast_tanh.h): a block's exps (one per point and hidden unit)
 * pay off from about four rows on (measured), so 8 leaves a margin. */
#define EXP_MIN_ROWS 8

#define T float
#define SUFFIX _f32
#define M(fn) fn##f
#define TANH fast_tanhf
#define EXP_PAIRS 1
#include __FILE__
#undef T
#undef SUFFIX
#undef M
#undef TANH
#undef EXP_PAIRS

#define T double
#define SUFFIX _f64
#define M(fn) fn
#define TANH tanh
#define EXP_PAIRS 0
#include __FILE__

#else /* the body, once per dtype */

/* One vector register of T: lanes of the per-thread weight-gradient accumulators, which
 * stay vertical until the end of the call. */
#define LANES (64 / (long)sizeof(T))

#include "exp_pairs.h" /* EXP_ROWS, EXP_BLOCK, EXP_ROW, pair_tanh_row */

/* The points n0 .. n0 + nb of one P (or gP) slab, transposed: pt[h][n] = p[n * H + h],
 * and 0 past nb, so the whole block can be computed (and ignored) without branches. */
INLINE void S(load_block)(const T *p, long nb, long H, T (*pt)[BLOCK]) {
    for (long h = 0; h < H; ++h) {
        for (long n = 0; n < nb; ++n) pt[h][n] = p[n * H + h];
        for (long n = nb; n < BLOCK; ++n) pt[h][n] = 0;
    }
}

/* out[n * stride + o] = sum_h Wt[o, h] tanh(pt[h][n] + c[h]) for the block's nb points. */
INLINE void S(pairwise_rows)(const T (*pt)[BLOCK], const T (*ea)[BLOCK], const T *c,
                              const T *eb, const T *Wt, T *out, long nb, long stride, long H,
                              long O) {
    T acc[O][BLOCK];
    for (long o = 0; o < O; ++o)
        for (long n = 0; n < BLOCK; ++n) acc[o][n] = 0;
    S(pair_tanh_accumulate)(pt, ea, c, eb, Wt, acc, H, O);
    for (long n = 0; n < nb; ++n)
        for (long o = 0; o < O; ++o) out[n * stride + o] = acc[o][n];
}

/* pairwise_rows with its tanh path chosen once per row, outside the loop over h (a NULL ea
 * is a constant in the inlined copy; the other copy knows ea is not NULL). */
INLINE void S(pairwise_block)(const T (*pt)[BLOCK], const T (*ea)[BLOCK], const T *c,
                              const T *eb, const T *Wt, T *out, long nb, long stride, long H,
                              long O) {
    if (ea)
        S(pairwise_rows)(pt, ea, c, eb, Wt, out, nb, stride, H, O);
    else
        S(pairwise_rows)(pt, NULL, c, eb, Wt, out, nb, stride, H, O);
}

void S(pairwise_forward)(const T *P, const T *C, const T *Wt, T *out, long L, long Lp, long B,
                         long N, long I, long H, long O) {
    const long blocks = (N + BLOCK - 1) / BLOCK;
    const int use_exp = (Lp == 1 ? L : 1) * I >= EXP_MIN_ROWS;
#pragma omp parallel for schedule(static)
    for (long task = 0; task < B * blocks; ++task) {
        const long b = task / blocks, n0 = task % blocks * BLOCK;
        const long nb = N - n0 < BLOCK ? N - n0 : BLOCK;
        T pt[H][BLOCK], ea[EXP_ROWS][BLOCK], eb[EXP_ROWS];
        int block_exp = 0;
        for (long l = 0; l < L; ++l) {
            if (l == 0 || Lp != 1) {
                S(load_block)(P + (((Lp == 1 ? 0 : l) * B + b) * N + n0) * H, nb, H, pt);
                block_exp = use_exp && EXP_BLOCK(pt, H, ea);
            }
            for (long i = 0; i < I; ++i) {
                const T *c = C + ((l * B + b) * I + i) * H;
                T *o = out + (((l * B + b) * N + n0) * I + i) * O;
                const T(*e)[BLOCK] = block_exp && EXP_ROW(c, H, eb) ? (const T(*)[BLOCK])ea : NULL;
                if (O == 1) /* the GMM's case, with the output loop unrolled */
                    S(pairwise_block)((const T(*)[BLOCK])pt, e, c, eb, Wt, o, nb, I, H, 1);
                else
                    S(pairwise_block)((const T(*)[BLOCK])pt, e, c, eb, Wt, o, nb, I * O, H, O);
            }
        }
    }
}

/* Through the output layer for hidden unit h over a block: a[n] += sum_o Wt[o, h] gg[o][n]
 * (the gradient at the unit's output) and the lanes of gw[o * H + h] += t gg[o]. */
INLINE void S(output_backward)(const T *t, const T (*gg)[BLOCK], const T *Wt, long h, long H, long O,
                               T *a, T (*gw)[LANES]) {
    for (long o = 0; o < O; ++o) {
        const T w = Wt[o * H + h];
        T *lane = gw[o * H + h];
        for (long n = 0; n < BLOCK; ++n) a[n] += w * gg[o][n];
        for (long k = 0; k < BLOCK; k += LANES)
            for (long j = 0; j < LANES; ++j) lane[j] += t[k + j] * gg[o][k + j];
    }
}

/* One (particle, cluster) row over a block of points, with the output gradients
 * g[n * stride + o]: gpt[h][n] and gc[h] += a = (Wt^T g) * (1 - t^2), and the lanes of
 * gw[o * H + h] += t g. Returns at once where the block's g is all zero (particles whose
 * weight was flushed to 0). */
INLINE void S(pairwise_rows_backward)(const T (*pt)[BLOCK], const T (*ea)[BLOCK], const T *c,
                                       const T *eb, const T *Wt, const T *g, long nb, long stride,
                                       T (*gpt)[BLOCK], T *gc, T (*gw)[LANES], long H, long O) {
    T gg[O][BLOCK];
    int any = 0;
    for (long o = 0; o < O; ++o) {
        for (long n = 0; n < nb; ++n) {
            gg[o][n] = g[n * stride + o];
            any |= gg[o][n] != 0;
        }
        for (long n = nb; n < BLOCK; ++n) gg[o][n] = 0;
    }
    if (!any) return;
    for (long h = 0; h < H; ++h) {
        T t[BLOCK], a[BLOCK];
        for (long n = 0; n < BLOCK; ++n) a[n] = 0;
        S(pair_tanh_row)(pt, ea, c, eb, h, t);
        S(output_backward)(t, (const T(*)[BLOCK])gg, Wt, h, H, O, a, gw);
        T s = 0;
        for (long n = 0; n < BLOCK; ++n) {
            a[n] *= 1 - t[n] * t[n];
            gpt[h][n] += a[n];
            s += a[n];
        }
        gc[h] += s;
    }
}

/* pairwise_rows_backward with its tanh path chosen once per row, as pairwise_block. */
INLINE void S(pairwise_block_backward)(const T (*pt)[BLOCK], const T (*ea)[BLOCK], const T *c,
                                       const T *eb, const T *Wt, const T *g, long nb, long stride,
                                       T (*gpt)[BLOCK], T *gc, T (*gw)[LANES], long H, long O) {
    if (ea)
        S(pairwise_rows_backward)(pt, ea, c, eb, Wt, g, nb, stride, gpt, gc, gw, H, O);
    else
        S(pairwise_rows_backward)(pt, NULL, c, eb, Wt, g, nb, stride, gpt, gc, gw, H, O);
}

void S(pairwise_backward)(const T *P, const T *C, const T *Wt, const T *G, T *gP, T *gC, T *gWt,
                          long L, long Lp, long B, long N, long I, long H, long O) {
    const int use_exp = (Lp == 1 ? L : 1) * I >= EXP_MIN_ROWS;
    T *parts = THREAD_PARTS(T, O * H); /* each thread's gWt */
    T fallback[parts ? 1 : O * H];
    if (!parts) memset(fallback, 0, sizeof(fallback));
    int team = 1;
#pragma omp parallel if (parts != NULL)
    {
        T pt[H][BLOCK], gpt[H][BLOCK], gw[O * H][LANES], ea[EXP_ROWS][BLOCK], eb[EXP_ROWS];
        int block_exp = 0;
        memset(gw, 0, sizeof(gw));
#pragma omp for schedule(static)
        for (long b = 0; b < B; ++b)
            for (long n0 = 0; n0 < N; n0 += BLOCK) {
                const long nb = N - n0 < BLOCK ? N - n0 : BLOCK;
                for (long l = 0; l < L; ++l) {
                    const long prow = (((Lp == 1 ? 0 : l) * B + b) * N + n0) * H;
                    if (l == 0 || Lp != 1) {
                        S(load_block)(P + prow, nb, H, pt);
                        block_exp = use_exp && EXP_BLOCK(pt, H, ea);
                        memset(gpt, 0, sizeof(gpt));
                    }
                    for (long i = 0; i < I; ++i) {
                        const long crow = ((l * B + b) * I + i) * H;
                        const T *g = G + (((l * B + b) * N + n0) * I + i) * O;
                        const T(*e)[BLOCK] =
                            block_exp && EXP_ROW(C + crow, H, eb) ? (const T(*)[BLOCK])ea : NULL;
                        if (O == 1)
                            S(pairwise_block_backward)((const T(*)[BLOCK])pt, e, C + crow, eb, Wt, g,
                                                       nb, I, gpt, gC + crow, gw, H, 1);
                        else
                            S(pairwise_block_backward)((const T(*)[BLOCK])pt, e, C + crow, eb, Wt, g,
                                                       nb, I * O, gpt, gC + crow, gw, H, O);
                    }
                    if (l == L - 1 || Lp != 1)
                        for (long n = 0; n < nb; ++n)
                            for (long h = 0; h < H; ++h) gP[prow + n * H + h] += gpt[h][n];
                }
            }
        T *mine = MY_ROW(parts, fallback, O * H);
        for (long k = 0; k < O * H; ++k) {
            T s = 0;
            for (long j = 0; j < LANES; ++j) s += gw[k][j];
            mine[k] += s;
        }
        TEAM_SIZE(team);
    }
    for (int t = 0; t < team; ++t) {
        const T *row = ROW(parts, fallback, O * H, t);
        for (long k = 0; k < O * H; ++k) gWt[k] += row[k];
    }
    free(parts);
}

/* The rows m0 .. m0 + nb of u, transposed: ut[d][j] = u[(m0 + j) * D + d], 0 past nb. */
INLINE void S(load_rows)(const T *u, long nb, long D, T (*ut)[BLOCK]) {
    for (long d = 0; d < D; ++d) {
        for (long j = 0; j < nb; ++j) ut[d][j] = u[j * D + d];
        for (long j = nb; j < BLOCK; ++j) ut[d][j] = 0;
    }
}

/* t[n] = tanh(c[h] + sum_d a[d * H + h] xt[d][n]): hidden unit h of one (particle, cluster)
 * row over a block of points. */
INLINE void S(scaled_unit)(const T (*xt)[BLOCK], const T *a, const T *c, long h, long D, long H, T *t) {
    for (long n = 0; n < BLOCK; ++n) t[n] = c[h];
    for (long d = 0; d < D; ++d) {
        const T w = a[d * H + h];
        for (long n = 0; n < BLOCK; ++n) t[n] += w * xt[d][n];
    }
    for (long n = 0; n < BLOCK; ++n) t[n] = TANH(t[n]);
}

void S(scaled_pairwise_forward)(const T *X, const T *A, const T *C, const T *w, T *out, long L, long B,
                                long N, long I, long D, long H) {
    const long blocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
    for (long task = 0; task < B * blocks; ++task) {
        const long b = task / blocks, n0 = task % blocks * BLOCK;
        const long nb = N - n0 < BLOCK ? N - n0 : BLOCK;
        T xt[D][BLOCK], acc[BLOCK], t[BLOCK];
        S(load_rows)(X + (b * N + n0) * D, nb, D, xt);
        for (long l = 0; l < L; ++l)
            for (long i = 0; i < I; ++i) {
                const long row = (l * B + b) * I + i;
                for (long n = 0; n < BLOCK; ++n) acc[n] = 0;
                for (long h = 0; h < H; ++h) {
                    S(scaled_unit)((const T(*)[BLOCK])xt, A + row * D * H, C + row * H, h, D, H, t);
                    for (long n = 0; n < BLOCK; ++n) acc[n] += w[h] * t[n];
                }
                T *o = out + ((l * B + b) * N + n0) * I + i;
                for (long n = 0; n < nb; ++n) o[n * I] = acc[n];
            }
    }
}

/* Its backward from G (L, B, N, I), accumulated into zeroed gA, gC and gw. */
void S(scaled_pairwise_backward)(const T *X, const T *A, const T *C, const T *w, const T *G, T *gA, T *gC,
                                 T *gw, long L, long B, long N, long I, long D, long H) {
    T *parts = THREAD_PARTS(T, H); /* each thread's gw */
    T fallback[parts ? 1 : H];
    if (!parts) memset(fallback, 0, sizeof(fallback));
    int team = 1;
#pragma omp parallel if (parts != NULL)
    {
        T gwl[H][LANES];
        memset(gwl, 0, sizeof(gwl));
#pragma omp for schedule(static)
        for (long lb = 0; lb < L * B; ++lb) {
            const long b = lb % B;
            for (long n0 = 0; n0 < N; n0 += BLOCK) {
                const long nb = N - n0 < BLOCK ? N - n0 : BLOCK;
                T xt[D][BLOCK], g[BLOCK], t[BLOCK];
                S(load_rows)(X + (b * N + n0) * D, nb, D, xt);
                for (long i = 0; i < I; ++i) {
                    const long row = lb * I + i;
                    int any = 0;
                    for (long n = 0; n < nb; ++n) {
                        g[n] = G[(lb * N + n0 + n) * I + i];
                        any |= g[n] != 0;
                    }
                    if (!any) continue; /* particles whose weight was flushed to 0 */
                    for (long n = nb; n < BLOCK; ++n) g[n] = 0;
                    for (long h = 0; h < H; ++h) {
                        S(scaled_unit)((const T(*)[BLOCK])xt, A + row * D * H, C + row * H, h, D, H, t);
                        T da[BLOCK], s = 0;
                        for (long k = 0; k < BLOCK; k += LANES)
                            for (long j = 0; j < LANES; ++j) gwl[h][j] += g[k + j] * t[k + j];
                        for (long n = 0; n < BLOCK; ++n) {
                            da[n] = g[n] * w[h] * (1 - t[n] * t[n]);
                            s += da[n];
                        }
                        gC[row * H + h] += s;
                        for (long d = 0; d < D; ++d) {
                            T sd = 0;
                            for (long n = 0; n < BLOCK; ++n) sd += da[n] * xt[d][n];
                            gA[(row * D + d) * H + h] += sd;
                        }
                    }
                }
            }
        }
        T *mine = MY_ROW(parts, fallback, H);
        for (long h = 0; h < H; ++h) {
            T s = 0;
            for (long j = 0; j < LANES; ++j) s += gwl[h][j];
            mine[h] += s;
        }
        TEAM_SIZE(team);
    }
    for (int t = 0; t < team; ++t) {
        const T *row = ROW(parts, fallback, H, t);
        for (long h = 0; h < H; ++h) gw[h] += row[h];
    }
    free(parts);
}

/* The angles m0 .. m0 + nb as the rows' features: ut[0][j] = cos u[j], ut[1][j] = sin u[j],
 * 0 past nb (separate loops: cos and sin of one value would be fused into a scalar sincos). */
INLINE void S(load_angles)(const T *u, long nb, T (*ut)[BLOCK]) {
    for (long j = 0; j < nb; ++j) ut[0][j] = M(cos)(u[j]);
    for (long j = 0; j < nb; ++j) ut[1][j] = M(sin)(u[j]);
    for (long d = 0; d < 2; ++d)
        for (long j = nb; j < BLOCK; ++j) ut[d][j] = 0;
}

/* t[j] = tanh(b1[h] + sum_d W1t[d, h] ut[d][j]): hidden unit h over a block of rows. */
INLINE void S(hidden_unit)(const T (*ut)[BLOCK], const T *W1t, const T *b1, long h, long D, long H,
                           T *t) {
    for (long j = 0; j < BLOCK; ++j) t[j] = b1[h];
    for (long d = 0; d < D; ++d) {
        const T w = W1t[d * H + h];
        for (long j = 0; j < BLOCK; ++j) t[j] += w * ut[d][j];
    }
    for (long j = 0; j < BLOCK; ++j) t[j] = TANH(t[j]);
}

void S(pointwise_forward)(const T *U, const T *W1t, const T *b1, const T *W2t, const T *b2, T *out,
                          long M, long D, long H, long O, long angles) {
#pragma omp parallel for schedule(static)
    for (long m0 = 0; m0 < M; m0 += BLOCK) {
        const long nb = M - m0 < BLOCK ? M - m0 : BLOCK;
        T ut[D][BLOCK], acc[O][BLOCK], t[BLOCK];
        if (angles)
            S(load_angles)(U + m0, nb, ut);
        else
            S(load_rows)(U + m0 * D, nb, D, ut);
        for (long o = 0; o < O; ++o)
            for (long j = 0; j < BLOCK; ++j) acc[o][j] = b2[o];
        for (long h = 0; h < H; ++h) {
            S(hidden_unit)((const T(*)[BLOCK])ut, W1t, b1, h, D, H, t);
            for (long o = 0; o < O; ++o) {
                const T w = W2t[o * H + h];
                for (long j = 0; j < BLOCK; ++j) acc[o][j] += w * t[j];
            }
        }
        for (long j = 0; j < nb; ++j)
            for (long o = 0; o < O; ++o) out[(m0 + j) * O + o] = acc[o][j];
    }
}

void S(pointwise_backward)(const T *U, const T *W1t, const T *b1, const T *W2t, const T *G, T *gU,
                           T *gW1t, T *gb1, T *gW2t, T *gb2, long M, long D, long H, long O, long want_gU,
                           long angles) {
    /* each thread's gW1t, gb1, gW2t and gb2, in one row */
    const long part = D * H + H + O * H + O;
    T *parts = THREAD_PARTS(T, part);
    T fallback[parts ? 1 : part];
    if (!parts) memset(fallback, 0, sizeof(fallback));
    int team = 1;
#pragma omp parallel if (parts != NULL)
    {
        /* Weight gradients in vertical lanes until the end of the call, as the pairwise
         * backward's: on 40,000 rows without gU, 1.31-1.35 ms per call against 1.49 with a
         * horizontal sum per (block, hidden unit, weight), at 1 thread. */
        T gw1[D * H][LANES], gb[H][LANES], gw2[O * H][LANES], go[O][LANES];
        memset(go, 0, sizeof(go));
        memset(gw1, 0, sizeof(gw1));
        memset(gb, 0, sizeof(gb));
        memset(gw2, 0, sizeof(gw2));
#pragma omp for schedule(static)
        for (long m0 = 0; m0 < M; m0 += BLOCK) {
            const long nb = M - m0 < BLOCK ? M - m0 : BLOCK;
            T ut[D][BLOCK], gg[O][BLOCK], gut[D][BLOCK], t[BLOCK], a[BLOCK];
            int any = 0;
            for (long o = 0; o < O; ++o) { /* rows past nb get gradient 0: they add nothing */
                for (long j = 0; j < nb; ++j) {
                    gg[o][j] = G[(m0 + j) * O + o];
                    any |= gg[o][j] != 0;
                }
                for (long j = nb; j < BLOCK; ++j) gg[o][j] = 0;
            }
            const long width = angles ? 1 : D; /* gU's row width */
            if (!any) { /* rows of particles whose weights were all flushed to 0 */
                if (want_gU) memset(gU + m0 * width, 0, sizeof(T) * nb * width);
                continue;
            }
            for (long o = 0; o < O; ++o)
                for (long k = 0; k < BLOCK; k += LANES)
                    for (long j = 0; j < LANES; ++j) go[o][j] += gg[o][k + j];
            if (angles)
                S(load_angles)(U + m0, nb, ut);
            else
                S(load_rows)(U + m0 * D, nb, D, ut);
            for (long d = 0; d < D; ++d)
                for (long j = 0; j < BLOCK; ++j) gut[d][j] = 0;
            for (long h = 0; h < H; ++h) {
                S(hidden_unit)((const T(*)[BLOCK])ut, W1t, b1, h, D, H, t);
                for (long j = 0; j < BLOCK; ++j) a[j] = 0;
                S(output_backward)(t, (const T(*)[BLOCK])gg, W2t, h, H, O, a, gw2);
                for (long j = 0; j < BLOCK; ++j) a[j] *= 1 - t[j] * t[j]; /* d tanh = 1 - t^2 */
                for (long k = 0; k < BLOCK; k += LANES)
                    for (long j = 0; j < LANES; ++j) gb[h][j] += a[k + j];
                for (long d = 0; d < D; ++d) {
                    T *lane = gw1[d * H + h];
                    for (long k = 0; k < BLOCK; k += LANES)
                        for (long j = 0; j < LANES; ++j) lane[j] += a[k + j] * ut[d][k + j];
                    if (want_gU) {
                        const T w = W1t[d * H + h];
                        for (long j = 0; j < BLOCK; ++j) gut[d][j] += w * a[j];
                    }
                }
            }
            if (want_gU && angles) /* d (cos u, sin u) / du = (-sin u, cos u) */
                for (long j = 0; j < nb; ++j) gU[m0 + j] = ut[0][j] * gut[1][j] - ut[1][j] * gut[0][j];
            else if (want_gU)
                for (long j = 0; j < nb; ++j)
                    for (long d = 0; d < D; ++d) gU[(m0 + j) * D + d] = gut[d][j];
        }
        {
            T *mW1 = MY_ROW(parts, fallback, part), *mb1 = mW1 + D * H, *mW2 = mb1 + H, *mb2 = mW2 + O * H;
            for (long k = 0; k < D * H; ++k)
                for (long j = 0; j < LANES; ++j) mW1[k] += gw1[k][j];
            for (long k = 0; k < H; ++k)
                for (long j = 0; j < LANES; ++j) mb1[k] += gb[k][j];
            for (long k = 0; k < O * H; ++k)
                for (long j = 0; j < LANES; ++j) mW2[k] += gw2[k][j];
            for (long o = 0; o < O; ++o)
                for (long j = 0; j < LANES; ++j) mb2[o] += go[o][j];
        }
        TEAM_SIZE(team);
    }
    for (int t = 0; t < team; ++t) {
        const T *row = ROW(parts, fallback, part, t);
        for (long k = 0; k < D * H; ++k) gW1t[k] += row[k];
        for (long k = 0; k < H; ++k) gb1[k] += row[D * H + k];
        for (long k = 0; k < O * H; ++k) gW2t[k] += row[D * H + H + k];
        for (long o = 0; o < O; ++o) gb2[o] += row[D * H + H + O * H + o];
    }
    free(parts);
}

#undef LANES
#endif
