/* Fused pairwise tanh layer: out[l,b,n,i,:] = W^T tanh(P[l,b,n,:] + C[l,b,i,:]).
 *
 * The (L, B, N, I, H) hidden tensor of a mixture model's per-(point, cluster) proposal
 * is the largest in its training step. Here it never exists: each (point, cluster) row of
 * H hidden units lives in a stack buffer, the forward keeps nothing, and the backward
 * recomputes the row's tanh (one vectorized pass) instead of reading a saved tensor.
 *
 * Layouts (all contiguous): P (Lp, B, N, H) with Lp = 1 (shared by every particle) or L;
 * C (L, B, I, H); Wt (O, H) the output weight transposed; G and out (L, B, N, I, O).
 * The backward accumulates into zeroed gP (Lp, B, N, H), gC (L, B, I, H), gWt (O, H).
 * Compiled with -O3 -ffast-math so the h loops vectorize (glibc's libmvec tanh).
 */
#include <math.h>
#include <stddef.h>

#define DEFINE_KERNELS(T, TANH, SUFFIX)                                                        \
void pairwise_forward_##SUFFIX(const T *P, const T *C, const T *Wt, T *out, long L, long Lp,  \
                               long B, long N, long I, long H, long O) {                      \
    T t[H];                                                                                    \
    for (long l = 0; l < L; ++l)                                                               \
        for (long b = 0; b < B; ++b)                                                           \
            for (long n = 0; n < N; ++n) {                                                     \
                const T *p = P + (((Lp == 1 ? 0 : l) * B + b) * N + n) * H;                    \
                for (long i = 0; i < I; ++i) {                                                 \
                    const T *c = C + ((l * B + b) * I + i) * H;                                \
                    T *o_ = out + (((l * B + b) * N + n) * I + i) * O;                         \
                    for (long h = 0; h < H; ++h) t[h] = TANH(p[h] + c[h]);                     \
                    for (long o = 0; o < O; ++o) {                                             \
                        const T *w = Wt + o * H;                                               \
                        T s = 0;                                                               \
                        for (long h = 0; h < H; ++h) s += w[h] * t[h];                         \
                        o_[o] = s;                                                             \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
}                                                                                              \
                                                                                               \
void pairwise_backward_##SUFFIX(const T *P, const T *C, const T *Wt, const T *G, T *gP, T *gC, \
                                T *gWt, long L, long Lp, long B, long N, long I, long H,       \
                                long O) {                                                      \
    T t[H], a[H];                                                                              \
    for (long l = 0; l < L; ++l)                                                               \
        for (long b = 0; b < B; ++b)                                                           \
            for (long n = 0; n < N; ++n) {                                                     \
                const long prow = (((Lp == 1 ? 0 : l) * B + b) * N + n) * H;                   \
                const T *p = P + prow;                                                         \
                T *gp = gP + prow;                                                             \
                for (long i = 0; i < I; ++i) {                                                 \
                    const long crow = ((l * B + b) * I + i) * H;                               \
                    const T *c = C + crow;                                                     \
                    T *gc = gC + crow;                                                         \
                    const T *g = G + (((l * B + b) * N + n) * I + i) * O;                      \
                    for (long h = 0; h < H; ++h) {                                             \
                        t[h] = TANH(p[h] + c[h]);                                              \
                        a[h] = 0;                                                              \
                    }                                                                          \
                    for (long o = 0; o < O; ++o) {                                             \
                        const T go = g[o];                                                     \
                        const T *w = Wt + o * H;                                               \
                        T *gw = gWt + o * H;                                                   \
                        for (long h = 0; h < H; ++h) {                                         \
                            a[h] += w[h] * go;                                                 \
                            gw[h] += t[h] * go;                                                \
                        }                                                                      \
                    }                                                                          \
                    for (long h = 0; h < H; ++h) {                                             \
                        const T d = a[h] * (1 - t[h] * t[h]);                                  \
                        gp[h] += d;                                                            \
                        gc[h] += d;                                                            \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
}

DEFINE_KERNELS(float, tanhf, f32)
DEFINE_KERNELS(double, tanh, f64)
