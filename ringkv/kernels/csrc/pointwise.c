/* The elementwise parts of a decoder layer on the CPU, one call each where eager torch makes
 * several (ringkv/kernels/pointwise.py builds and loads this file; it needs no torch headers).
 * All float32, contiguous, rows of T tokens:
 *
 * rms_norm   x (T, D), w (D,) -> out (T, D): w * (x * 1/sqrt(mean(x^2) + eps)), or with plus_one
 *            (Gemma) (x * 1/sqrt(...)) * (1 + w)
 * rope       q (T, HQ, D), k (T, HK, D), cos/sin (T, RD) -> qo, ko: the first RD channels of each
 *            head rotated (HF's rotate_half: x * cos + [-x2, x1] * sin), the rest copied
 * silu_mul   g, u (N,) -> out (N,): g / (1 + exp(-g)) * u (the gated MLP's SiLU)
 *
 * Each product and sum is rounded as torch's separate ops round it (no contraction into FMAs:
 * fp-contract off), so rope's result is torch's to the bit; rms_norm's mean of squares is summed
 * in another order than torch's reduction (last bits), and silu's exp is a polynomial (relative
 * error ~1e-7, as torch's vectorized exp). A row is computed by one thread in the same order
 * whatever the thread count. */
#include <math.h>
#include <stdint.h>

#pragma GCC optimize("fp-contract=off")

#if defined(__AVX512F__)
#define VL 16
#define TILES "avx512: 16 floats a vector"
#elif defined(__AVX2__)
#define VL 8
#define TILES "avx2: 8 floats a vector"
#else
#define VL 4
#define TILES "generic: 4 floats a vector"
#endif
#define PAR_MIN 65536 /* elements below which one thread does it all (a decode step's rows) */

typedef float vec __attribute__((vector_size(4 * VL)));
typedef float vecu __attribute__((vector_size(4 * VL), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(4 * VL)));

const char *ringkv_pointwise_tiles(void) { return TILES; }

void ringkv_rms_norm_f32(const float *x, const float *w, float *out, int64_t t, int64_t d, float eps,
                         int plus_one) {
#pragma omp parallel for schedule(static) if (t * d >= PAR_MIN)
    for (int64_t i = 0; i < t; i++) {
        const float *xr = x + i * d;
        float *o = out + i * d;
        vec acc = {0};
        int64_t j = 0;
        for (; j + VL <= d; j += VL) {
            const vec v = *(const vecu *)(xr + j);
            acc += v * v;
        }
        float s = 0.f;
        for (int l = 0; l < VL; l++) s += acc[l];
        for (; j < d; j++) s += xr[j] * xr[j];
        const float r = 1.f / sqrtf(s / (float)d + eps);
        if (plus_one)
            for (j = 0; j < d; j++) o[j] = (xr[j] * r) * (1.f + w[j]);
        else
            for (j = 0; j < d; j++) o[j] = w[j] * (xr[j] * r);
    }
}

/* One head's channels: the first rd rotated by row c/s of cos/sin, the rest copied. */
static inline void rotate(const float *x, const float *c, const float *s, float *o, int64_t d, int64_t rd) {
    const int64_t half = rd / 2;
    for (int64_t j = 0; j < half; j++) o[j] = x[j] * c[j] + -x[j + half] * s[j];
    for (int64_t j = half; j < rd; j++) o[j] = x[j] * c[j] + x[j - half] * s[j];
    for (int64_t j = rd; j < d; j++) o[j] = x[j];
}

void ringkv_rope_f32(const float *q, const float *k, const float *cos, const float *sin, float *qo, float *ko,
                     int64_t t, int64_t hq, int64_t hk, int64_t d, int64_t rd) {
#pragma omp parallel for schedule(static) if (t * (hq + hk) * d >= PAR_MIN)
    for (int64_t i = 0; i < t; i++) {
        const float *c = cos + i * rd, *s = sin + i * rd;
        for (int64_t h = 0; h < hq; h++) rotate(q + (i * hq + h) * d, c, s, qo + (i * hq + h) * d, d, rd);
        for (int64_t h = 0; h < hk; h++) rotate(k + (i * hk + h) * d, c, s, ko + (i * hk + h) * d, d, rd);
    }
}

#define VEXP_T vec
#define VEXP_I ivec
#include "vexp.h"

void ringkv_silu_mul_f32(const float *g, const float *u, float *out, int64_t n) {
    const int64_t nv = n / VL;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
    for (int64_t b = 0; b < nv; b++) {
        const vec x = *(const vecu *)(g + b * VL);
        *(vecu *)(out + b * VL) = x / (1.f + vexp(-x)) * *(const vecu *)(u + b * VL);
    }
    if (nv * VL < n) { /* the tail through a padded vector */
        vec x = {0}, y = {0};
        for (int64_t j = nv * VL; j < n; j++) {
            x[j - nv * VL] = g[j];
            y[j - nv * VL] = u[j];
        }
        const vec r = x / (1.f + vexp(-x)) * y;
        for (int64_t j = nv * VL; j < n; j++) out[j] = r[j - nv * VL];
    }
}
