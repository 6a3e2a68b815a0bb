/* The exp-product tanh's per-dtype glue (fast_tanh.h), shared by the pairwise layer
 * (tanh_layers.c) and the rings' local layer (rings.c).
 *
 * Included inside a file's per-dtype body, where T, S(), TANH, BLOCK and EXP_PAIRS (1 for
 * float32, 0 for float64, which keeps TANH throughout) are defined; so, unlike the other
 * headers, it has no include guard and redefines its macros at every inclusion.
 *
 * EXP_ROWS: rows of a block's ea array (1 where unused); EXP_BLOCK(pt, H, ea) and
 * EXP_ROW(c, H, eb): the exps of a loaded block of points and of a (particle, cluster) row,
 * 0 where the exp path cannot be taken; S(pair_tanh_row): one hidden unit's tanh over the
 * block, by whichever path the block and row have; S(pair_tanh_accumulate): a
 * (particle, cluster) row's output layer over the block, from those tanh values.
 */
#undef EXP_ROWS
#undef EXP_BLOCK
#undef EXP_ROW
#if EXP_PAIRS
#define EXP_ROWS H
#define EXP_BLOCK(pt, H, ea) exp2_checked(&(pt)[0][0], (H) * BLOCK, &(ea)[0][0]) /* 0: use TANH */
#define EXP_ROW(c, H, eb) exp2_checked(c, H, eb)
#else
#define EXP_ROWS 1
#define EXP_BLOCK(pt, H, ea) 0
#define EXP_ROW(c, H, eb) 0
#endif

/* t[n] = tanh(pt[h][n] + c[h]): by the exp product where the block and row have one (ea
 * not NULL), else by TANH. */
static inline __attribute__((always_inline)) void S(pair_tanh_row)(const T (*pt)[BLOCK],
                                                                   const T (*ea)[BLOCK], const T *c,
                                                                   const T *eb, long h, T *t) {
#if EXP_PAIRS
    if (ea) {
        exp_pair_tanh(ea[h], eb[h], t, BLOCK);
        return;
    }
#endif
    const T ch = c[h];
    for (long n = 0; n < BLOCK; ++n) t[n] = TANH(pt[h][n] + ch);
}

/* acc[o][n] += sum_h Wt[o, h] tanh(pt[h][n] + c[h]) for o < O over a block, each hidden unit's
 * tanh by pair_tanh_row. Callers inline it twice, with ea NULL and not, so the path is chosen
 * once per row rather than per hidden unit. */
static inline __attribute__((always_inline)) void S(pair_tanh_accumulate)(const T (*pt)[BLOCK],
                                                                          const T (*ea)[BLOCK], const T *c,
                                                                          const T *eb, const T *Wt,
                                                                          T (*acc)[BLOCK], long H, long O) {
    for (long h = 0; h < H; ++h) {
        T t[BLOCK];
        S(pair_tanh_row)(pt, ea, c, eb, h, t);
        for (long o = 0; o < O; ++o) {
            const T w = Wt[o * H + h];
            for (long n = 0; n < BLOCK; ++n) acc[o][n] += w * t[n];
        }
    }
}
