/* Fused one-hidden-layer tanh networks for the mixture tasks' hottest loops.
 *
 * Their hidden tensors ((L, B, N, I, H) per (point, cluster) pair, (M, H) per point) are
 * the largest in a training step. Here they never exist: each row of H hidden units
 * lives in a stack buffer, the forward keeps nothing, and the backward recomputes the
 * row's tanh (one vectorized pass) instead of reading a saved tensor. Compiled with -O3
 * -ffast-math so the h loops vectorize (glibc's libmvec tanh), and with OpenMP: loaded
 * after torch, the library binds to torch's own libgomp (same soname), so its parallel
 * loops share torch's threads and follow torch.set_num_threads. All arrays contiguous;
 * backward functions accumulate into zeroed gradient arrays. Gradients of shared inputs
 * go to per-thread buffers first, added under a critical section.
 *
 * pairwise: out[l,b,n,i,:] = Wt tanh(P[l,b,n,:] + C[l,b,i,:]) with P (Lp, B, N, H),
 *   Lp = 1 (shared by every particle) or L; C (L, B, I, H); Wt (O, H) the output weight
 *   transposed; G and out (L, B, N, I, O). Threads split the datasets b, so gP and gC
 *   rows are never shared.
 * pointwise: out[m,:] = W2t tanh(W1 u[m,:] + b1) with u (M, D), W1t (D, H) the first
 *   weight transposed, b1 (H), W2t (O, H); G and out (M, O). Threads split the rows m.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

/* The output layer both networks share, on one row of hidden units t = tanh(pre):
 * forward out = Wt t; backward gWt += g t^T and, returned in a, the gradient with respect
 * to the pre-activation, (Wt^T g) * (1 - t^2). */
#define DEFINE_OUTPUT_LAYER(T, SUFFIX)                                                         \
static inline void output_forward_##SUFFIX(const T *t, const T *Wt, T *out, long H, long O) {  \
    for (long o = 0; o < O; ++o) {                                                             \
        const T *w = Wt + o * H;                                                               \
        T s = 0;                                                                               \
        for (long h = 0; h < H; ++h) s += w[h] * t[h];                                         \
        out[o] = s;                                                                            \
    }                                                                                          \
}                                                                                              \
                                                                                               \
static inline void output_backward_##SUFFIX(const T *t, const T *Wt, const T *g, T *a,         \
                                            T *gWt, long H, long O) {                          \
    for (long h = 0; h < H; ++h) a[h] = 0;                                                     \
    for (long o = 0; o < O; ++o) {                                                             \
        const T go = g[o];                                                                     \
        const T *w = Wt + o * H;                                                               \
        T *gw = gWt + o * H;                                                                   \
        for (long h = 0; h < H; ++h) {                                                         \
            a[h] += w[h] * go;                                                                 \
            gw[h] += t[h] * go;                                                                \
        }                                                                                      \
    }                                                                                          \
    for (long h = 0; h < H; ++h) a[h] *= 1 - t[h] * t[h];                                      \
}

#define DEFINE_PAIRWISE(T, TANH, SUFFIX)                                                       \
void pairwise_forward_##SUFFIX(const T *P, const T *C, const T *Wt, T *out, long L, long Lp,   \
                               long B, long N, long I, long H, long O) {                       \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (long b = 0; b < B; ++b) {                                                             \
        T t[H];                                                                                \
        for (long l = 0; l < L; ++l)                                                           \
            for (long n = 0; n < N; ++n) {                                                     \
                const T *p = P + (((Lp == 1 ? 0 : l) * B + b) * N + n) * H;                    \
                for (long i = 0; i < I; ++i) {                                                 \
                    const T *c = C + ((l * B + b) * I + i) * H;                                \
                    for (long h = 0; h < H; ++h) t[h] = TANH(p[h] + c[h]);                     \
                    output_forward_##SUFFIX(t, Wt, out + (((l * B + b) * N + n) * I + i) * O,  \
                                            H, O);                                             \
                }                                                                              \
            }                                                                                  \
    }                                                                                          \
}                                                                                              \
                                                                                               \
void pairwise_backward_##SUFFIX(const T *P, const T *C, const T *Wt, const T *G, T *gP, T *gC, \
                                T *gWt, long L, long Lp, long B, long N, long I, long H,       \
                                long O) {                                                      \
    _Pragma("omp parallel")                                                                    \
    {                                                                                          \
        T t[H], a[H], gw_local[O * H];                                                         \
        memset(gw_local, 0, sizeof(gw_local));                                                 \
        _Pragma("omp for schedule(static)")                                                    \
        for (long b = 0; b < B; ++b)                                                           \
            for (long l = 0; l < L; ++l)                                                       \
                for (long n = 0; n < N; ++n) {                                                 \
                    const long prow = (((Lp == 1 ? 0 : l) * B + b) * N + n) * H;               \
                    const T *p = P + prow;                                                     \
                    T *gp = gP + prow;                                                         \
                    for (long i = 0; i < I; ++i) {                                             \
                        const long crow = ((l * B + b) * I + i) * H;                           \
                        const T *c = C + crow;                                                 \
                        T *gc = gC + crow;                                                     \
                        const T *g = G + (((l * B + b) * N + n) * I + i) * O;                  \
                        for (long h = 0; h < H; ++h) t[h] = TANH(p[h] + c[h]);                 \
                        output_backward_##SUFFIX(t, Wt, g, a, gw_local, H, O);                 \
                        for (long h = 0; h < H; ++h) {                                         \
                            gp[h] += a[h];                                                     \
                            gc[h] += a[h];                                                     \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
        _Pragma("omp critical")                                                                \
        for (long k = 0; k < O * H; ++k) gWt[k] += gw_local[k];                                \
    }                                                                                          \
}

#define DEFINE_POINTWISE(T, TANH, SUFFIX)                                                      \
static inline void pointwise_hidden_##SUFFIX(const T *u, const T *W1t, const T *b1, T *t,      \
                                             long D, long H) {                                 \
    for (long h = 0; h < H; ++h) t[h] = b1[h];                                                 \
    for (long d = 0; d < D; ++d) {                                                             \
        const T ud = u[d];                                                                     \
        for (long h = 0; h < H; ++h) t[h] += W1t[d * H + h] * ud;                              \
    }                                                                                          \
    for (long h = 0; h < H; ++h) t[h] = TANH(t[h]);                                            \
}                                                                                              \
                                                                                               \
void pointwise_forward_##SUFFIX(const T *U, const T *W1t, const T *b1, const T *W2t, T *out,   \
                                long M, long D, long H, long O) {                              \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (long m = 0; m < M; ++m) {                                                             \
        T t[H];                                                                                \
        pointwise_hidden_##SUFFIX(U + m * D, W1t, b1, t, D, H);                                \
        output_forward_##SUFFIX(t, W2t, out + m * O, H, O);                                    \
    }                                                                                          \
}                                                                                              \
                                                                                               \
void pointwise_backward_##SUFFIX(const T *U, const T *W1t, const T *b1, const T *W2t,          \
                                 const T *G, T *gU, T *gW1t, T *gb1, T *gW2t, long M, long D,  \
                                 long H, long O) {                                             \
    _Pragma("omp parallel")                                                                    \
    {                                                                                          \
        T t[H], a[H], gw1[D * H], gb[H], gw2[O * H];                                           \
        memset(gw1, 0, sizeof(gw1));                                                           \
        memset(gb, 0, sizeof(gb));                                                             \
        memset(gw2, 0, sizeof(gw2));                                                           \
        _Pragma("omp for schedule(static)")                                                    \
        for (long m = 0; m < M; ++m) {                                                         \
            const T *u = U + m * D;                                                            \
            pointwise_hidden_##SUFFIX(u, W1t, b1, t, D, H);                                    \
            output_backward_##SUFFIX(t, W2t, G + m * O, a, gw2, H, O);                         \
            for (long h = 0; h < H; ++h) gb[h] += a[h];                                        \
            for (long d = 0; d < D; ++d) {                                                     \
                const T ud = u[d];                                                             \
                T s = 0;                                                                       \
                for (long h = 0; h < H; ++h) {                                                 \
                    gw1[d * H + h] += a[h] * ud;                                               \
                    s += W1t[d * H + h] * a[h];                                                \
                }                                                                              \
                gU[m * D + d] = s;                                                             \
            }                                                                                  \
        }                                                                                      \
        _Pragma("omp critical")                                                                \
        {                                                                                      \
            for (long k = 0; k < D * H; ++k) gW1t[k] += gw1[k];                                \
            for (long k = 0; k < H; ++k) gb1[k] += gb[k];                                      \
            for (long k = 0; k < O * H; ++k) gW2t[k] += gw2[k];                                \
        }                                                                                      \
    }                                                                                          \
}

DEFINE_OUTPUT_LAYER(float, f32)
DEFINE_OUTPUT_LAYER(double, f64)
DEFINE_PAIRWISE(float, tanhf, f32)
DEFINE_PAIRWISE(double, tanh, f64)
DEFINE_POINTWISE(float, tanhf, f32)
DEFINE_POINTWISE(double, tanh, f64)
