/* Philox4x32-10 (Salmon, Moraes, Dror & Shaw, "Parallel random numbers: as easy as 1, 2, 3",
 * SC 2011), the counter-based generator of cuRAND and of PyTorch's CUDA backend.
 *
 * A draw is a pure function of (key, counter): kernels take one 64-bit key per call, drawn
 * from torch's default generator (apg/random.py), and give every element its own counters,
 * so draws are reproducible under torch.manual_seed, independent of the thread count, and
 * cost a few vector multiplies instead of a serial Mersenne Twister (torch.rand on CPU:
 * ~5 ns per number here). apg/random.py has the PyTorch twin; tests check both against the
 * published known-answer vectors.
 *
 * Counters used by the package: (element index, low and high words; draw number; 0).
 */
#ifndef APG_PHILOX_H
#define APG_PHILOX_H

#include <stdint.h>

/* The four output words of counter (c0, c1, c2, c3) under key (k0, k1), in place. */
static inline void philox4x32_10(uint32_t *c0, uint32_t *c1, uint32_t *c2, uint32_t *c3, uint32_t k0,
                                 uint32_t k1) {
    uint32_t x0 = *c0, x1 = *c1, x2 = *c2, x3 = *c3;
#pragma GCC unroll 10
    for (int r = 0; r < 10; ++r) {
        const uint64_t p0 = (uint64_t)0xD2511F53u * x0, p1 = (uint64_t)0xCD9E8D57u * x2;
        const uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ k0, y2 = (uint32_t)(p0 >> 32) ^ x3 ^ k1;
        x1 = (uint32_t)p1;
        x3 = (uint32_t)p0;
        x0 = y0;
        x2 = y2;
        k0 += 0x9E3779B9u; /* the Weyl sequence bumping the key between rounds */
        k1 += 0xBB67AE85u;
    }
    *c0 = x0, *c1 = x1, *c2 = x2, *c3 = x3;
}

/* Two uniforms on [0, 1) from one block: float32 takes 24 bits of a word each (torch.rand's
 * grid), float64 53 bits of two words each. */
static inline void philox_uniform2f(uint64_t key, uint64_t element, uint32_t draw, float *u0, float *u1) {
    uint32_t a = (uint32_t)element, b = (uint32_t)(element >> 32), c = draw, d = 0;
    philox4x32_10(&a, &b, &c, &d, (uint32_t)key, (uint32_t)(key >> 32));
    *u0 = (float)(a >> 8) * 0x1p-24f;
    *u1 = (float)(b >> 8) * 0x1p-24f;
}

static inline void philox_uniform2d(uint64_t key, uint64_t element, uint32_t draw, double *u0, double *u1) {
    uint32_t a = (uint32_t)element, b = (uint32_t)(element >> 32), c = draw, d = 0;
    philox4x32_10(&a, &b, &c, &d, (uint32_t)key, (uint32_t)(key >> 32));
    *u0 = ((double)(a >> 5) * 67108864.0 + (double)(b >> 6)) * 0x1p-53;
    *u1 = ((double)(c >> 5) * 67108864.0 + (double)(d >> 6)) * 0x1p-53;
}

/* philox_uniform2f / 2d for the elements el[0 .. m). Left to GCC, AVX-512 builds would
 * vectorize the rounds with 64-bit multiplies (vpmullq: 3 uops); for float32 the intrinsics
 * below run them on 16 lanes with the 32 x 32 -> 64-bit multiply of even and odd lanes
 * (vpmuludq). */
#if defined(__AVX512F__)
#include <immintrin.h>

static inline void philox_mulhilo16(__m512i x, __m512i m, __m512i *hi, __m512i *lo) {
    const __m512i even = _mm512_mul_epu32(x, m), odd = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), m);
    *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
    *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

static inline void philox_uniform2f_many(uint64_t key, const long *el, uint32_t draw, long m, float *u0,
                                         float *u1) {
    const __m512i m0 = _mm512_set1_epi32((int)0xD2511F53u), m1 = _mm512_set1_epi32((int)0xCD9E8D57u);
    const __m512 scale = _mm512_set1_ps(0x1p-24f);
    for (long e0 = 0; e0 < m; e0 += 16) {
        uint32_t lo_words[16], hi_words[16];
        for (long e = 0; e < 16; ++e) {
            const uint64_t v = (uint64_t)el[e0 + e < m ? e0 + e : 0];
            lo_words[e] = (uint32_t)v;
            hi_words[e] = (uint32_t)(v >> 32);
        }
        __m512i x0 = _mm512_loadu_si512(lo_words), x1 = _mm512_loadu_si512(hi_words);
        __m512i x2 = _mm512_set1_epi32((int)draw), x3 = _mm512_setzero_si512();
        uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
        for (int r = 0; r < 10; ++r) {
            __m512i hi0, lo0, hi1, lo1;
            philox_mulhilo16(x0, m0, &hi0, &lo0);
            philox_mulhilo16(x2, m1, &hi1, &lo1);
            x0 = _mm512_xor_si512(_mm512_xor_si512(hi1, x1), _mm512_set1_epi32((int)k0));
            x2 = _mm512_xor_si512(_mm512_xor_si512(hi0, x3), _mm512_set1_epi32((int)k1));
            x1 = lo1;
            x3 = lo0;
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        float a[16], b[16];
        _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x0, 8)), scale));
        _mm512_storeu_ps(b, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x1, 8)), scale));
        for (long e = 0; e < 16 && e0 + e < m; ++e) {
            u0[e0 + e] = a[e];
            u1[e0 + e] = b[e];
        }
    }
}
#else
static inline void philox_uniform2f_many(uint64_t key, const long *el, uint32_t draw, long m, float *u0,
                                         float *u1) {
    for (long e = 0; e < m; ++e) philox_uniform2f(key, (uint64_t)el[e], draw, &u0[e], &u1[e]);
}
#endif

static inline void philox_uniform2d_many(uint64_t key, const long *el, uint32_t draw, long m, double *u0,
                                         double *u1) {
    for (long e = 0; e < m; ++e) philox_uniform2d(key, (uint64_t)el[e], draw, &u0[e], &u1[e]);
}

#endif
