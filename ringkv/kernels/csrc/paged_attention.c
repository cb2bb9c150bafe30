/* Paged attention on the CPU, reading the cache in place (ringkv/kernels/paged_cpu.py builds
 * and loads this file; it needs no torch headers).
 *
 * q      (N, Q, H, D)   float32, contiguous: Q query rows of each of N sequences
 * k, v   (NB, BS, HKV, D) float32, contiguous: the paged cache of one layer
 * table  (N, W)         int32: sequence n's key j lives in block table[n, j / BS], slot j % BS
 * limits (N, Q)         int64: query i of sequence n sees its first limits[n, i] keys
 * out    (N, Q, H, D)   float32; lse (N, H, Q) float32 or NULL
 *
 * Query head h reads K/V head h / (H / HKV). One work item is (sequence, K/V head): its
 * G * Q query rows share each K/V row read. Scores are kept (rows x keys), so K and V are each
 * read once and the softmax needs no rescaling. A row that sees no key gets out 0, lse -inf.
 * Each item runs on one thread, so the result does not depend on the number of threads.
 * Returns 0; 1 when scratch memory could not be allocated; 2 when a block the queries read lies
 * outside [0, nb) (checked before anything is read). out is incomplete unless 0. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

static inline float dot(const float *a, const float *b, int64_t d) {
    float acc[LANES] = {0};
    int64_t e = 0;
    for (; e + LANES <= d; e += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[e + l] * b[e + l];
    float s = 0.f;
    for (; e < d; e++) s += a[e] * b[e];
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

/* Ask for the rows of head kh in a block (bs rows of d floats, slot floats apart) ahead of use:
 * the hardware prefetcher follows the stride inside a block but not the jump to the next one. */
static inline void prefetch_block(const float *base, int64_t rows, int64_t slot, int64_t d) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t e = 0; e < d; e += 64 / sizeof(float)) __builtin_prefetch(base + t * slot + e);
}

static inline void axpy(float *y, float a, const float *x, int64_t d) {
    for (int64_t e = 0; e < d; e++) y[e] += a * x[e];
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* The 8 sums of a[0..7]'s lanes as one vector. */
static inline __m256 hsum8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

/* Scores of query row qr against keys j0 .. j0 + nk - 1 (rows of kr, slot floats apart). */
static inline void scores(const float *qr, const float *kr, int64_t nk, int64_t slot, int64_t d, float *dst) {
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0)
        for (; t + 8 <= nk; t += 8) {
            __m256 acc[8];
            for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
            for (int64_t e = 0; e < d; e += 8) {
                const __m256 qv = _mm256_loadu_ps(qr + e);
                for (int u = 0; u < 8; u++)
                    acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + (t + u) * slot + e), acc[u]);
            }
            _mm256_storeu_ps(dst + t, hsum8(acc));
        }
#endif
    for (; t < nk; t++) dst[t] = dot(qr, kr + t * slot, d);
}

/* One (sequence, K/V head) item; d is a constant where the caller can make it one. */
static inline __attribute__((always_inline)) int item(
        const float *q, const float *k, const float *v, const int32_t *blocks, const int64_t *limits, float *out,
        float *lse, int64_t s, int64_t kh, int64_t nq, int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t w,
        float scale, int64_t nb) {
    const int64_t g = h / hkv, rows = g * nq, slot = hkv * d;
    int64_t lmax = 0;
    for (int64_t i = 0; i < nq; i++)
        if (limits[s * nq + i] > lmax) lmax = limits[s * nq + i];
    if (lmax > w * bs) lmax = w * bs;
    for (int64_t b = 0; b * bs < lmax; b++)
        if (blocks[b] < 0 || blocks[b] >= nb) return 2;
    const int64_t width = (lmax + 7) / 8 * 8;  /* a row of scores, room for whole groups of 8 */
    /* rows r = gi * nq + i: query i of head kh * g + gi */
    float *qs = malloc(sizeof(float) * (size_t)(2 * rows * d + rows * width + 2 * rows));
    int64_t *lim = malloc(sizeof(int64_t) * (size_t)rows);
    if (!qs || !lim) {
        free(qs);
        free(lim);
        return 1;
    }
    float *acc = qs + rows * d, *p = acc + rows * d, *m = p + rows * width, *sum = m + rows;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t gi = r / nq, i = r % nq;
        const float *src = q + ((s * nq + i) * h + kh * g + gi) * d;
        for (int64_t e = 0; e < d; e++) qs[r * d + e] = src[e] * scale;
        lim[r] = limits[s * nq + i] < lmax ? limits[s * nq + i] : lmax;
        if (lim[r] < 0) lim[r] = 0;
    }
    memset(acc, 0, sizeof(float) * (size_t)(rows * d));
    for (int64_t j0 = 0; j0 < lmax; j0 += bs) {  /* scores */
        const float *kb = k + (int64_t)blocks[j0 / bs] * bs * slot + kh * d;
        const int64_t end = j0 + bs < lmax ? j0 + bs : lmax;
        if (end < lmax) prefetch_block(k + (int64_t)blocks[end / bs] * bs * slot + kh * d, bs, slot, d);
        else prefetch_block(v + (int64_t)blocks[0] * bs * slot + kh * d, bs, slot, d);
        for (int64_t r = 0; r < rows; r++) scores(qs + r * d, kb, end - j0, slot, d, p + r * width + j0);
    }
    for (int64_t r = 0; r < rows; r++) {  /* softmax over each row's visible keys */
        float *pr = p + r * width, mr = -INFINITY, total = 0.f;
        for (int64_t j = 0; j < lim[r]; j++) mr = pr[j] > mr ? pr[j] : mr;
        for (int64_t j = 0; j < lim[r]; j++) {
            pr[j] = expf(pr[j] - mr);
            total += pr[j];
        }
        m[r] = mr;
        sum[r] = total;
    }
    for (int64_t j0 = 0; j0 < lmax; j0 += bs) {  /* weighted sum of V */
        const float *vb = v + (int64_t)blocks[j0 / bs] * bs * slot + kh * d;
        const int64_t end = j0 + bs < lmax ? j0 + bs : lmax;
        if (end < lmax) prefetch_block(v + (int64_t)blocks[end / bs] * bs * slot + kh * d, bs, slot, d);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t stop = end < lim[r] ? end : lim[r];
            float *ar = acc + r * d;
            for (int64_t j = j0; j < stop; j++) axpy(ar, p[r * width + j], vb + (j - j0) * slot, d);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t gi = r / nq, i = r % nq, head = kh * g + gi;
        float *dst = out + ((s * nq + i) * h + head) * d;
        for (int64_t e = 0; e < d; e++) dst[e] = lim[r] > 0 ? acc[r * d + e] / sum[r] : 0.f;
        if (lse) lse[(s * h + head) * nq + i] = lim[r] > 0 ? m[r] + logf(sum[r]) : -INFINITY;
    }
    free(lim);
    free(qs);
    return 0;
}

int ringkv_paged_attention_f32(const float *q, const float *k, const float *v, const int32_t *table,
                               const int64_t *limits, float *out, float *lse, int64_t n, int64_t nq, int64_t h,
                               int64_t hkv, int64_t d, int64_t nb, int64_t bs, int64_t w, float scale,
                               int nthreads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(| : failed)
    for (int64_t it = 0; it < n * hkv; it++) {
        const int64_t s = it / hkv, kh = it % hkv;
        const int32_t *blocks = table + s * w;
        if (d == 64)
            failed |= item(q, k, v, blocks, limits, out, lse, s, kh, nq, h, hkv, 64, bs, w, scale, nb);
        else if (d == 128)
            failed |= item(q, k, v, blocks, limits, out, lse, s, kh, nq, h, hkv, 128, bs, w, scale, nb);
        else
            failed |= item(q, k, v, blocks, limits, out, lse, s, kh, nq, h, hkv, d, bs, w, scale, nb);
    }
    return failed;
}
