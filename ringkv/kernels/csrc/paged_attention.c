/* Paged attention on the CPU, reading the cache in place (ringkv/kernels/paged_cpu.py builds
 * and loads this file; it needs no torch headers).
 *
 * q      (N, Q, H, D)   float32, contiguous: Q query rows of each of N sequences
 * k      (NB, BS, HKV, D), v (NB, BS, HKV, DV) float32, contiguous: the paged cache of one layer
 *                       (DV, V's head size, may differ from D: MLA's)
 * table  (N, W)         int32: sequence n's key j lives in block table[n, j / BS], slot j % BS
 * limits (N, Q)         int64: query i of sequence n sees keys before limits[n, i] ...
 * starts (N, Q)         int64 or NULL (0): ... from key starts[n, i] on (a sliding window); the
 *                       blocks wholly before every query's start are not read (they may be freed)
 * out    (N, Q, H, DV)  float32; lse (N, H, Q) float32 or NULL
 * scale, softcap        score = scale q.k, or softcap > 0: softcap * tanh(scale q.k / softcap)
 *                       (soft-capping, before the softmax; 0: none, and the capping loop is skipped)
 *
 * Query head h reads K/V head h / (H / HKV). A work item is a whole sequence when there are at
 * least 2 per thread (a block is then read as one contiguous run), else one (sequence, K/V head);
 * the G * Q query rows of a K/V head share each K/V row read. Scores are kept (rows x keys), so K
 * and V are each read once and the softmax needs no rescaling; it runs 8 scores at a time (vexp.h's exp),
 * and the V sums keep their row in registers (weighted_sum). A row that sees no key gets out 0,
 * lse -inf. Each row is computed by one thread in the same order whatever the items, so the
 * result does not depend on the number of threads.
 * Returns 0; 1 when scratch memory could not be allocated; 2 when a block the queries read lies
 * outside [0, nb) (checked before anything is read). out is incomplete unless 0. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

/* How many 8-float sums of a row weighted_sum keeps in registers in one pass over the keys, per
 * target: 16 (128 floats) in AVX-512's 32 registers, 8 (64) in AVX2's 16 ymm (a 128-float row
 * takes two passes, each row of V read from L1 the second time), 4 on a generic target (a v8 is
 * two 128-bit registers). Each float's sum runs in key order either way. The scores of 8 keys at
 * a time use AVX2/FMA where the target has them (AVX-512 included), plain C otherwise. */
#if defined(__AVX512F__)
#define WSV 16
#define TILES "avx512: scores 8 keys at a time (AVX2/FMA), V sums of 128 floats in registers"
#elif defined(__AVX2__) && defined(__FMA__)
#define WSV 8
#define TILES "avx2: scores 8 keys at a time (AVX2/FMA), V sums of 64 floats in registers"
#else
#define WSV 4
#define TILES "generic: scores one key at a time (plain C), V sums of 32 floats in registers"
#endif

const char *ringkv_paged_attention_tiles(void) { return TILES; }

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
 * the hardware prefetcher follows the stride inside a block but not the jump to the next one.
 * A whole block (every head: d == slot) is one contiguous run, so its first and last lines are
 * enough to start the hardware's stream; a prefetch per line cost more than it saved (measured
 * 10% faster over 30 layers of a 16-sequence decode step from memory, one thread). */
static inline void prefetch_block(const float *base, int64_t rows, int64_t slot, int64_t d) {
    if (d == slot) {
        __builtin_prefetch(base);
        __builtin_prefetch(base + rows * slot - 1);
        return;
    }
    for (int64_t t = 0; t < rows; t++)
        for (int64_t e = 0; e < d; e += 64 / sizeof(float)) __builtin_prefetch(base + t * slot + e);
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32)));

#define VEXP_T v8
#define VEXP_I i8
#include "vexp.h"

/* tanh, 8 at a time (Cephes' tanhf, relative error ~1e-7): x + x^3 P(x^2) for |x| < 0.625, else
 * sign(x) (1 - 2e / (1 + e)) with e = exp(-2|x|) (vexp.h: >= ~1e-38, so it saturates to +-1). */
static inline v8 tanh8(v8 x) {
    const i8 sign = (i8)x & (int32_t)0x80000000;
    const v8 ax = (v8)((i8)x & (int32_t)0x7fffffff), z = x * x;
    v8 p = z * -5.70498872745e-3f + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const v8 e = vexp(ax * -2.f);
    const v8 big = (v8)((i8)(1.f - 2.f * e / (1.f + e)) | sign);
    return vpick(ax < 0.625f, p * z * x + x, big);
}

/* In place over one row of n scores x: cap * tanh(x) (soft-capping; the last partial group of 8
 * through a padded copy). */
static inline void cap_row(float *p, int64_t n, float cap) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) *(v8u *)(p + j) = tanh8(*(const v8u *)(p + j)) * cap;
    if (j < n) {
        v8 t = {0};
        for (int64_t l = j; l < n; l++) t[l - j] = p[l];
        t = tanh8(t) * cap;
        for (int64_t l = j; l < n; l++) p[l] = t[l - j];
    }
}

/* In place over one row of n scores: p = exp(p - max), returning the max; *total gets the sum. */
static inline float softmax_row(float *p, int64_t n, float *total) {
    int64_t j = 0;
    float m = -INFINITY;
    if (n >= 8) {
        v8 mv = *(const v8u *)p;
        for (j = 8; j + 8 <= n; j += 8) {
            const v8 t = *(const v8u *)(p + j);
            mv = vpick(t > mv, t, mv);
        }
        for (int l = 0; l < 8; l++) m = mv[l] > m ? mv[l] : m;
    }
    for (; j < n; j++) m = p[j] > m ? p[j] : m;
    v8 sv = {0};
    for (j = 0; j + 8 <= n; j += 8) {
        const v8 e = vexp(*(const v8u *)(p + j) - m);
        *(v8u *)(p + j) = e;
        sv += e;
    }
    float s = 0.f;
    if (j < n) {  /* the last partial group, through a padded copy */
        v8 t = (v8){0} + m;
        for (int64_t l = j; l < n; l++) t[l - j] = p[l];
        t = vexp(t - m);
        for (int64_t l = j; l < n; l++) {
            p[l] = t[l - j];
            s += t[l - j];
        }
    }
    for (int l = 0; l < 8; l++) s += sv[l];
    *total = s;
    return m;
}

/* acc (d floats) += sum over keys j < n of p[j] * (row j of vb, rows slot floats apart); d a
 * multiple of 8 up to 128 keeps acc in registers over the keys, 8 * WSV floats a pass. */
static inline __attribute__((always_inline)) void weighted_sum(float *acc, const float *p, const float *vb, int64_t n,
                                                               int64_t slot, int64_t d) {
    if (d % 8 == 0 && d <= 128) {
        for (int64_t e0 = 0; e0 < d; e0 += 8 * WSV) {
            v8 a[WSV];
            const int64_t nv = (d - e0) / 8 < WSV ? (d - e0) / 8 : WSV;
            for (int64_t e = 0; e < nv; e++) a[e] = *(const v8u *)(acc + e0 + 8 * e);
            for (int64_t j = 0; j < n; j++) {
                const float *row = vb + j * slot + e0;
                for (int64_t e = 0; e < nv; e++) a[e] += p[j] * *(const v8u *)(row + 8 * e);
            }
            for (int64_t e = 0; e < nv; e++) *(v8u *)(acc + e0 + 8 * e) = a[e];
        }
        return;
    }
    for (int64_t j = 0; j < n; j++)
        for (int64_t e = 0; e < d; e++) acc[e] += p[j] * vb[j * slot + e];
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

/* One item: sequence s, K/V heads kh0 .. kh1 - 1 (all of them where there are enough sequences:
 * a block's rows are then read whole, one contiguous run); d and vd are constants where the caller
 * can make them ones. Row r sees keys [st[r], lim[r]); the item reads from the block of the
 * smallest start that a row with keys has. */
static inline __attribute__((always_inline)) int item(
        const float *q, const float *k, const float *v, const int32_t *blocks, const int64_t *limits,
        const int64_t *starts, float *out, float *lse, int64_t s, int64_t kh0, int64_t kh1, int64_t nq, int64_t h,
        int64_t hkv, int64_t d, int64_t vd, int64_t bs, int64_t w, float scale, float softcap, int64_t nb) {
    const int64_t g = h / hkv, per = g * nq, rows = (kh1 - kh0) * per, slot = hkv * d, span = (kh1 - kh0) * d;
    const int64_t vslot = hkv * vd, vspan = (kh1 - kh0) * vd;
    int64_t lmax = 0, smin = INT64_MAX;
    for (int64_t i = 0; i < nq; i++) {
        const int64_t li = limits[s * nq + i] < w * bs ? limits[s * nq + i] : w * bs;
        const int64_t si = starts ? (starts[s * nq + i] > 0 ? starts[s * nq + i] : 0) : 0;
        if (si < li) {  /* the query sees a key */
            lmax = li > lmax ? li : lmax;
            smin = si < smin ? si : smin;
        }
    }
    if (smin > lmax) smin = lmax;  /* no query sees a key: nothing is read */
    const int64_t j00 = smin / bs * bs;  /* the first block read */
    for (int64_t b = j00 / bs; b * bs < lmax; b++)
        if (blocks[b] < 0 || blocks[b] >= nb) return 2;
    const int64_t width = (lmax - j00 + 7) / 8 * 8;  /* a row of scores from key j00, whole groups of 8 */
    /* rows r = (kh - kh0) * per + gi * nq + i: query i of head kh * g + gi */
    float *qs = malloc(sizeof(float) * (size_t)(rows * d + rows * vd + rows * width + 2 * rows));
    int64_t *lim = malloc(sizeof(int64_t) * (size_t)(2 * rows)), *st = lim + rows;
    if (!qs || !lim) {
        free(qs);
        free(lim);
        return 1;
    }
    float *acc = qs + rows * d, *p = acc + rows * vd, *m = p + rows * width, *sum = m + rows;
    const float qscale = softcap > 0.f ? scale / softcap : scale;  /* capped: the tanh's argument */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t gi = r % per / nq, i = r % nq, head = (kh0 + r / per) * g + gi;
        const float *src = q + ((s * nq + i) * h + head) * d;
        for (int64_t e = 0; e < d; e++) qs[r * d + e] = src[e] * qscale;
        lim[r] = limits[s * nq + i] < lmax ? limits[s * nq + i] : lmax;
        st[r] = starts ? starts[s * nq + i] : 0;
        st[r] = st[r] < smin ? smin : st[r] > lim[r] ? lim[r] : st[r];  /* in [smin, lim]: empty when none */
        if (lim[r] < st[r]) lim[r] = st[r];
    }
    memset(acc, 0, sizeof(float) * (size_t)(rows * vd));
    for (int64_t j0 = j00; j0 < lmax; j0 += bs) {  /* scores */
        const float *kb = k + (int64_t)blocks[j0 / bs] * bs * slot + kh0 * d;
        const int64_t end = j0 + bs < lmax ? j0 + bs : lmax;
        if (end < lmax) prefetch_block(k + (int64_t)blocks[end / bs] * bs * slot + kh0 * d, bs, slot, span);
        else prefetch_block(v + (int64_t)blocks[j00 / bs] * bs * vslot + kh0 * vd, bs, vslot, vspan);
        for (int64_t r = 0; r < rows; r++)
            scores(qs + r * d, kb + r / per * d, end - j0, slot, d, p + r * width + j0 - j00);
    }
    for (int64_t r = 0; r < rows; r++) {  /* softmax over each row's visible keys */
        float *row = p + r * width + st[r] - j00;
        if (softcap > 0.f) cap_row(row, lim[r] - st[r], softcap);
        m[r] = softmax_row(row, lim[r] - st[r], sum + r);
    }
    for (int64_t j0 = j00; j0 < lmax; j0 += bs) {  /* weighted sum of V */
        const float *vb = v + (int64_t)blocks[j0 / bs] * bs * vslot + kh0 * vd;
        const int64_t end = j0 + bs < lmax ? j0 + bs : lmax;
        if (end < lmax) prefetch_block(v + (int64_t)blocks[end / bs] * bs * vslot + kh0 * vd, bs, vslot, vspan);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t a = j0 > st[r] ? j0 : st[r], stop = end < lim[r] ? end : lim[r];
            if (stop > a)
                weighted_sum(acc + r * vd, p + r * width + a - j00, vb + (a - j0) * vslot + r / per * vd, stop - a,
                             vslot, vd);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t gi = r % per / nq, i = r % nq, head = (kh0 + r / per) * g + gi;
        const int sees = lim[r] > st[r];
        float *dst = out + ((s * nq + i) * h + head) * vd;
        for (int64_t e = 0; e < vd; e++) dst[e] = sees ? acc[r * vd + e] / sum[r] : 0.f;
        if (lse) lse[(s * h + head) * nq + i] = sees ? m[r] + logf(sum[r]) : -INFINITY;
    }
    free(lim);
    free(qs);
    return 0;
}

int ringkv_paged_attention_f32(const float *q, const float *k, const float *v, const int32_t *table,
                               const int64_t *limits, const int64_t *starts, float *out, float *lse, int64_t n,
                               int64_t nq, int64_t h, int64_t hkv, int64_t d, int64_t vd, int64_t nb, int64_t bs,
                               int64_t w, float scale, float softcap, int nthreads) {
    /* whole sequences when there are enough to share out, else one item per (sequence, K/V head);
     * each row's arithmetic is the same either way */
    const int64_t heads = n >= 2 * (int64_t)nthreads ? hkv : 1, per_seq = hkv / heads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) reduction(| : failed)
    for (int64_t it = 0; it < n * per_seq; it++) {
        const int64_t s = it / per_seq, kh0 = it % per_seq * heads, kh1 = kh0 + heads;
        const int32_t *blocks = table + s * w;
        if (d == 64 && vd == 64)
            failed |= item(q, k, v, blocks, limits, starts, out, lse, s, kh0, kh1, nq, h, hkv, 64, 64, bs, w, scale,
                           softcap, nb);
        else if (d == 128 && vd == 128)
            failed |= item(q, k, v, blocks, limits, starts, out, lse, s, kh0, kh1, nq, h, hkv, 128, 128, bs, w, scale,
                           softcap, nb);
        else
            failed |= item(q, k, v, blocks, limits, starts, out, lse, s, kh0, kh1, nq, h, hkv, d, vd, bs, w, scale,
                           softcap, nb);
    }
    return failed;
}

/* A step's new K/V rows into the paged cache: row i of k (t, width) and of v (t, vwidth) into slot
 * slots[i] of kc (nslots, width) and vc (nslots, vwidth), where width and vwidth are HKV * D and
 * HKV * DV floats. One call where torch makes two index_copy_s and their views. Returns 0, or 2
 * (nothing written) when a slot lies outside [0, nslots). */
int ringkv_paged_write_f32(const float *k, const float *v, const int64_t *slots, float *kc, float *vc, int64_t t,
                           int64_t width, int64_t vwidth, int64_t nslots) {
    for (int64_t i = 0; i < t; i++)
        if (slots[i] < 0 || slots[i] >= nslots) return 2;
    for (int64_t i = 0; i < t; i++) {
        memcpy(kc + slots[i] * width, k + i * width, sizeof(float) * (size_t)width);
        memcpy(vc + slots[i] * vwidth, v + i * vwidth, sizeof(float) * (size_t)vwidth);
    }
    return 0;
}
