/* Exact attention on the CPU, forward and backward, FlashAttention-style: the scores are made and
 * used block by block and never stored whole (ringkv/kernels/cpu_flash.py builds and loads this
 * file; it needs no torch headers). float32.
 *
 * q, dq (B, Sq, H, D), k, dk (B, Sk, HKV, D), v, dv (B, Sk, HKV, DV), out, dout (B, Sq, H, DV): any
 *        strides, given in floats as (batch, seq, head) triples; the last dimension is contiguous;
 *        D and DV (V's own head size, MLA's) multiples of 16, <= 256
 * lse, dlse (B, H, Sq) float32, contiguous, natural log
 * mask   query i sees key j iff i + lo <= j <= i + hi (+-2^40: unbounded); query head h reads
 *        K/V head h / (H / HKV) (GQA) without copying K/V
 * softcap > 0: the score is softcap * tanh(scale q.k / softcap) (then the mask and the softmax:
 *        lse is over the capped scores); the backward multiplies dS by the tanh's derivative
 *        1 - (s / softcap)^2. 0: no cap (the loops that cap are not entered).
 *
 * Scores are kept in base-2 units (scale * log2(e) folded in), so the softmax is one exp2 per
 * score (exp2v: a vector at a time, Cephes' polynomial, relative error ~1e-7 as expf). The
 * products run on register tiles: score tiles of MRS rows x PW keys against K (or V) packed
 * key-minor, and product tiles of MRO rows x up to NZ * VL columns that broadcast one operand and
 * stream the other's rows. A row's keys outside its mask range are skipped whole PW-key panels at a time and
 * given probability 0 inside a panel, so a causal diagonal costs at most one panel per row group.
 * The tile shapes are chosen when the file is compiled, from the target's vector registers (the
 * #if below): 24 accumulators of 16 floats with AVX-512's 32 registers, 12 of 8 with AVX2's 16,
 * 12 of 4 on a generic target (SSE2, NEON, or plain C where the compiler has no vectors).
 *
 * Forward: one work item per (batch, head, BM query rows); the online softmax rescales the
 * item's output rows once per BN-key block. Backward: one item per (batch, K/V head); per BNB-key
 * block it recomputes P = exp2(S - lse), adds P^T dO to dV, dS = P (dP - delta) with
 * dP = dO V^T and delta = rowsum(dO * out) - dlse, dS K to dq and dS^T q to dK. With a softcap the
 * scores are recomputed raw (scale q.k / softcap), capped and differentiated in the same pass. Each output is
 * summed in the same order by one thread: results do not depend on the number of threads.
 * Rows that see no key get out 0 and lse -inf. Returns 0, or 1 when scratch memory could not be
 * allocated (outputs incomplete). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* Register tiles per target: VL floats a vector (the softmax's step too). A score tile holds MRS
 * rows x PW keys (PW / VL vectors a row); a product tile MRO rows x NZ vectors. */
#if defined(__AVX512F__)
#define VL 16  /* 32 zmm registers */
#define PW 32  /* keys per packed panel: 2 vectors */
#define MRS 12 /* rows per score tile: 24 accumulators */
#define MRO 6  /* rows per product tile ... */
#define NZ 4   /* ... x 4 vectors (64 columns): 24 accumulators */
#define TILES "avx512: panels of 32 keys, score tiles 12 x 32, product tiles 6 x 64 (24 zmm accumulators)"
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8   /* 16 ymm registers */
#define PW 16  /* 2 vectors */
#define MRS 6  /* 12 accumulators + 2 (the panel's row) + 1 (the broadcast) */
#define MRO 6  /* x 2 vectors (16 columns): 12 accumulators + 2 + 1 */
#define NZ 2
#define TILES "avx2: panels of 16 keys, score tiles 6 x 16, product tiles 6 x 16 (12 ymm accumulators)"
#else
#define VL 4   /* 128-bit vectors: SSE2's 16 xmm, NEON's 32 q (plain C where the compiler has none) */
#define PW 8   /* 2 vectors */
#define MRS 6  /* 12 accumulators */
#define MRO 6  /* x 2 vectors (8 columns): 12 accumulators */
#define NZ 2
#define TILES "generic: panels of 8 keys, score tiles 6 x 8, product tiles 6 x 8 (12 128-bit accumulators)"
#endif
#define NS (PW / VL) /* vectors per score-tile row */

typedef float vec __attribute__((vector_size(4 * VL)));
typedef float vecu __attribute__((vector_size(4 * VL), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(4 * VL)));
#define BM 96 /* query rows per forward block */
#define BN 512 /* keys per forward block */
#define BMB 48 /* query rows per backward block */
#define BNB 512 /* keys per backward block */
#define LOG2E 1.44269504088896341f
#define LN2 0.693147180559945309f
#define AI __attribute__((always_inline))

static inline int64_t clamp(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline vec pick(ivec m, vec a, vec b) { return (vec)(((ivec)a & m) | ((ivec)b & ~m)); } /* m ? a : b */

static inline vec vmax(vec a, vec b) {
#ifdef __AVX512F__
    return (vec)_mm512_max_ps((__m512)a, (__m512)b);
#else
    return pick(a > b, a, b);
#endif
}

/* 2^x, a vector at a time, for x <= ~0: x = n + f with |f| <= 1/2 (n rounded by the 1.5 * 2^23
 * trick), 2^f = exp(f ln2) by Cephes' expf polynomial with ln2's powers folded into its
 * coefficients, times 2^n built in the exponent bits; below -126 it gives 2^-126 (callers zero the
 * entries that must be exactly 0). */
static inline vec exp2v(vec x) {
    const float magic = 12582912.f; /* 1.5 * 2^23: adding it rounds to an integer in the low bits */
    x = vmax(x, (vec){0} - 126.f);
    const vec t = x + magic;
    const ivec n = (ivec)t - (ivec)((vec){0} + magic);
    const vec f = x - (t - magic);
    vec y = f * 1.5279195034e-05f + 1.5506795114e-04f;
    y = y * f + 1.3333747868e-03f;
    y = y * f + 9.6179281027e-03f;
    y = y * f + 5.5504104643e-02f;
    y = y * f + 2.4022651273e-01f;
    y = y * (f * f) + (f * LN2 + 1.f);
    return (vec)((ivec)y + (n << 23));
}

/* tanh, a vector at a time (Cephes' tanhf, relative error ~1e-7): x + x^3 P(x^2) for |x| < 0.625,
 * else sign(x) (1 - 2e / (1 + e)) with e = exp(-2|x|) (exp2v: >= 2^-126, so it saturates to +-1). */
static inline vec tanhv(vec x) {
    const ivec sign = (ivec)x & (int32_t)0x80000000;
    const vec ax = (vec)((ivec)x & (int32_t)0x7fffffff), z = x * x;
    vec p = z * -5.70498872745e-3f + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const vec e = exp2v(ax * (-2.f * LOG2E));
    const vec big = (vec)((ivec)(1.f - 2.f * e / (1.f + e)) | sign);
    return pick(ax < 0.625f, p * z * x + x, big);
}

static inline ivec lanes(int64_t j, int64_t a, int64_t b) { /* lanes j..j+VL-1 inside [a, b) */
    static const int32_t iota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    ivec idx;
    memcpy(&idx, iota, sizeof idx);
    const ivec off = idx + (int32_t)(j - a);
    return (off >= 0) & (off < (int32_t)(b - a));
}

static inline float hmax(vec x, float m) {
    for (int z = 0; z < VL; z++) m = x[z] > m ? x[z] : m;
    return m;
}

static inline float hsum(vec x) {
    float s = 0.f;
    for (int z = 0; z < VL; z++) s += x[z];
    return s;
}

/* Row i of a block (query m0 + i against keys n0 ..) sees the block's keys [ja[i], jb[i]):
 * dm = m0 - n0, nb keys in the block. */
static void row_keys(int64_t *ja, int64_t *jb, int64_t dm, int64_t mr, int64_t lo, int64_t hi, int64_t nb) {
    for (int64_t i = 0; i < mr; i++) {
        ja[i] = clamp(dm + i + lo, 0, nb);
        jb[i] = clamp(dm + i + hi + 1, 0, nb);
    }
}

/* The keys rows r0 .. g1 - 1 see between them: [*ga, *gb), empty (ga >= gb) when none */
static void group_keys(const int64_t *ja, const int64_t *jb, int64_t r0, int64_t g1, int64_t nb, int64_t *ga,
                       int64_t *gb) {
    *ga = nb;
    *gb = 0;
    for (int64_t i = r0; i < g1; i++)
        if (ja[i] < jb[i]) {
            *ga = min64(*ga, ja[i]);
            *gb = max64(*gb, jb[i]);
        }
}

/* ---- packing: rows j0 .. j0 + n of x (rows ldx apart, d floats) as panels (d, PW), zero padded */
static void pack_panels(const float *x, int64_t ldx, int64_t n, int64_t d, float *dst) {
    for (int64_t p = 0; p * PW < n; p++) {
        float *o = dst + p * d * PW;
        const int64_t cols = min64(PW, n - p * PW);
        for (int64_t c = 0; c < cols; c++) {
            const float *row = x + (p * PW + c) * ldx;
            for (int64_t e = 0; e < d; e++) o[e * PW + c] = row[e];
        }
        for (int64_t c = cols; c < PW; c++)
            for (int64_t e = 0; e < d; e++) o[e * PW + c] = 0.f;
    }
}

/* ---- score tile: s[i][0..PW) = c * (row i of a) . (each key of panel bt), i < mr */
static inline AI void score_tile(const float *a, int64_t lda, const float *bt, int64_t d, float c, float *s,
                                 int64_t lds, const int mr) {
    vec acc[MRS][NS];
#pragma GCC unroll 12
    for (int i = 0; i < MRS; i++)
#pragma GCC unroll 4
        for (int z = 0; z < NS; z++) acc[i][z] = (vec){0};
    for (int64_t e = 0; e < d; e++) {
        vec bz[NS];
#pragma GCC unroll 4
        for (int z = 0; z < NS; z++) bz[z] = *(const vec *)(bt + e * PW + z * VL);
#pragma GCC unroll 12
        for (int i = 0; i < MRS; i++)
            if (i < mr) {
                const float x = a[i * lda + e];
#pragma GCC unroll 4
                for (int z = 0; z < NS; z++) acc[i][z] += x * bz[z];
            }
    }
#pragma GCC unroll 12
    for (int i = 0; i < MRS; i++)
#pragma GCC unroll 4
        for (int z = 0; z < NS; z++)
            if (i < mr) *(vecu *)(s + i * lds + z * VL) = acc[i][z] * c;
}

/* a tile per row count up to the build's MRS (larger counts are dead code); cap != 0: then each
 * score x of the tile becomes cap * tanh(x) while the tile is in L1 (soft-capping) */
#define ST(MR) case MR: if (MR <= MRS) score_tile(a, lda, bt, d, c, s, lds, MR); break;
static void score_rows(const float *a, int64_t lda, const float *bt, int64_t d, float c, float *s, int64_t lds,
                       int64_t mr, float cap) {
    switch (mr) { ST(12) ST(11) ST(10) ST(9) ST(8) ST(7) ST(6) ST(5) ST(4) ST(3) ST(2) default: ST(1) }
    if (cap != 0.f)
        for (int64_t i = 0; i < mr; i++)
            for (int z = 0; z < NS; z++) {
                vecu *x = (vecu *)(s + i * lds + z * VL);
                *x = tanhv(*x) * cap;
            }
}

/* ---- product tile: acc[r][0..VL nz) = sum over t < kn of A(r, t) * b[t][..], A(r, t) =
 * a[r * ars + t * aks], summed from zero (a large running total would take a rounding error at
 * every term); then c = acc (mode 0), c += acc (1) or c = c * alpha[r] + acc (2) */
static inline AI void prod_tile(const float *a, int64_t ars, int64_t aks, const float *b, int64_t ldb, int64_t kn,
                                float *c, int64_t ldc, const float *alpha, int mode, const int mr, const int nz) {
    vec acc[MRO][NZ];
#pragma GCC unroll 6
    for (int r = 0; r < MRO; r++)
#pragma GCC unroll 4
        for (int z = 0; z < NZ; z++) acc[r][z] = (vec){0};
    for (int64_t t = 0; t < kn; t++) {
        vec bz[NZ];
#pragma GCC unroll 4
        for (int z = 0; z < NZ; z++)
            if (z < nz) bz[z] = *(const vecu *)(b + t * ldb + VL * z);
#pragma GCC unroll 6
        for (int r = 0; r < MRO; r++)
            if (r < mr) {
                const float x = a[r * ars + t * aks];
#pragma GCC unroll 4
                for (int z = 0; z < NZ; z++)
                    if (z < nz) acc[r][z] += x * bz[z];
            }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MRO; r++)
#pragma GCC unroll 4
        for (int z = 0; z < NZ; z++)
            if (r < mr && z < nz) {
                vecu *dst = (vecu *)(c + r * ldc + VL * z);
                *dst = mode == 0 ? acc[r][z] : mode == 1 ? *dst + acc[r][z] : *dst * alpha[r] + acc[r][z];
            }
}

/* a tile per row and vector count up to the build's MRO and NZ (larger ones are dead code) */
#define PT(R, Z) \
    case R * 8 + Z: \
        if (R <= MRO && Z <= NZ) prod_tile(a, ars, aks, b, ldb, kn, c, ldc, alpha, mode, R, Z); \
        break;
static void prod_one(const float *a, int64_t ars, int64_t aks, const float *b, int64_t ldb, int64_t kn, float *c,
                     int64_t ldc, const float *alpha, int mode, int64_t mr, int64_t nz) {
    switch (mr * 8 + nz) {
        PT(6, 4) PT(6, 3) PT(6, 2) PT(6, 1) PT(5, 4) PT(5, 3) PT(5, 2) PT(5, 1) PT(4, 4) PT(4, 3) PT(4, 2) PT(4, 1)
        PT(3, 4) PT(3, 3) PT(3, 2) PT(3, 1) PT(2, 4) PT(2, 3) PT(2, 2) PT(2, 1) PT(1, 4) PT(1, 3) PT(1, 2)
        default: PT(1, 1)
    }
}

/* MRO rows of c (d columns, a multiple of 16) from a product over t in [t0, t1), NZ * VL columns
 * at a time */
static void prod_rows(const float *a, int64_t ars, int64_t aks, const float *b, int64_t ldb, int64_t t0, int64_t t1,
                      int64_t d, float *c, int64_t ldc, const float *alpha, int mode, int64_t mr) {
    for (int64_t z0 = 0; z0 < d; z0 += NZ * VL)
        prod_one(a + t0 * aks, ars, aks, b + t0 * ldb + z0, ldb, t1 - t0, c + z0, ldc, alpha, mode, mr,
                 min64(NZ, (d - z0) / VL));
}

/* This build's tile shapes, for ringkv.kernels.describe() */
const char *ringkv_flash_attention_tiles(void) { return TILES; }

/* ---- forward ---------------------------------------------------------------------------- */

int ringkv_flash_fwd_f32(const float *q, const float *k, const float *v, float *out, float *lse, int64_t nbatch,
                         int64_t sq, int64_t sk, int64_t h, int64_t hkv, int64_t d, int64_t vd, const int64_t *qst,
                         const int64_t *kst, const int64_t *vst, const int64_t *ost, int64_t lo, int64_t hi,
                         float scale, float softcap, int nthreads) {
    const int64_t g = h / hkv, npan = (sk + PW - 1) / PW, qblocks = (sq + BM - 1) / BM;
    /* scores in base 2: c q.k, or capped: cap * tanh(c q.k) */
    const float c = softcap > 0.f ? scale / softcap : scale * LOG2E, cap = softcap > 0.f ? softcap * LOG2E : 0.f;
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(nbatch * hkv * npan * d * PW + 16));
    if (!kt) return 1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t it = 0; it < nbatch * hkv; it++) {
        const int64_t b = it / hkv, hk = it % hkv;
        pack_panels(k + b * kst[0] + hk * kst[2], kst[1], sk, d, kt + it * npan * d * PW);
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *s = aligned_alloc(64, sizeof(float) * (size_t)(BM * BN + BM * vd + 2 * BM + 16));
        int64_t ja[BM], jb[BM];
        if (!s) failed = 1;
        float *o = s + BM * BN, *m2 = o + BM * vd, *l = m2 + BM;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nbatch * h * qblocks; it++) {
            if (!s) continue;
            const int64_t b = it / (h * qblocks), hh = it / qblocks % h, m0 = it % qblocks * BM;
            const int64_t mr = min64(BM, sq - m0), hk = hh / g;
            const float *qb = q + b * qst[0] + m0 * qst[1] + hh * qst[2];
            const float *vb = v + b * vst[0] + hk * vst[2];
            const float *ktb = kt + (b * hkv + hk) * npan * d * PW;
            int64_t kstart, kend; /* the keys the item's rows see, of all sk */
            row_keys(ja, jb, m0, mr, lo, hi, sk);
            group_keys(ja, jb, 0, mr, sk, &kstart, &kend);
            for (int64_t i = 0; i < mr; i++) {
                m2[i] = -INFINITY;
                l[i] = 0.f;
            }
            memset(o, 0, sizeof(float) * (size_t)(mr * vd));
            for (int64_t n0 = kstart / PW * PW; n0 < kend; n0 += BN) {
                const int64_t nb = min64(BN, kend - n0);
                row_keys(ja, jb, m0 - n0, mr, lo, hi, nb);
                for (int64_t r0 = 0; r0 < mr; r0 += MRS) { /* scores of the panels a row group sees */
                    const int64_t g1 = min64(mr, r0 + MRS);
                    int64_t ga, gb;
                    group_keys(ja, jb, r0, g1, nb, &ga, &gb);
                    for (int64_t p = ga / PW; p * PW < gb; p++)
                        score_rows(qb + r0 * qst[1], qst[1], ktb + ((n0 / PW) + p) * d * PW, d, c,
                                   s + r0 * BN + p * PW, BN, g1 - r0, cap);
                }
                float alpha[BM];
                for (int64_t i = 0; i < mr; i++) { /* online softmax, P in place of S */
                    float *row = s + i * BN;
                    alpha[i] = 1.f;
                    if (ja[i] >= jb[i]) continue;
                    vec mv = (vec){0} - INFINITY;
                    for (int64_t j = ja[i] / VL * VL; j < jb[i]; j += VL) {
                        vec x = *(vec *)(row + j);
                        if (j < ja[i] || j + VL > jb[i]) x = pick(lanes(j, ja[i], jb[i]), x, (vec){0} - INFINITY);
                        mv = vmax(mv, x);
                    }
                    const float mx = hmax(mv, m2[i]);
                    vec sv = {0};
                    for (int64_t j = ja[i] / VL * VL; j < jb[i]; j += VL) {
                        vec p = exp2v(*(vec *)(row + j) - mx);
                        if (j < ja[i] || j + VL > jb[i]) p = pick(lanes(j, ja[i], jb[i]), p, (vec){0});
                        *(vec *)(row + j) = p;
                        sv += p;
                    }
                    const float sum = hsum(sv);
                    alpha[i] = m2[i] == -INFINITY ? 0.f : exp2f(m2[i] - mx);
                    l[i] = l[i] * alpha[i] + sum;
                    m2[i] = mx;
                }
                for (int64_t r0 = 0; r0 < mr; r0 += MRO) { /* o = o * alpha + P V over the group's keys */
                    const int64_t g1 = min64(mr, r0 + MRO);
                    int64_t ga, gb;
                    group_keys(ja, jb, r0, g1, nb, &ga, &gb);
                    if (ga >= gb) continue;
                    for (int64_t i = r0; i < g1; i++) { /* zeros where a row's own range ends */
                        float *row = s + i * BN;
                        if (ja[i] >= jb[i]) { memset(row + ga, 0, sizeof(float) * (size_t)(gb - ga)); continue; }
                        for (int64_t j = ga; j < ja[i] / VL * VL; j++) row[j] = 0.f;
                        for (int64_t j = (jb[i] + VL - 1) / VL * VL; j < gb; j++) row[j] = 0.f;
                    }
                    prod_rows(s + r0 * BN, BN, 1, vb + n0 * vst[1], vst[1], ga, gb, vd, o + r0 * vd, vd, alpha + r0,
                              2, g1 - r0);
                }
            }
            for (int64_t i = 0; i < mr; i++) {
                float *dst = out + b * ost[0] + (m0 + i) * ost[1] + hh * ost[2];
                const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
                for (int64_t e = 0; e < vd; e++) dst[e] = o[i * vd + e] * inv;
                lse[(b * h + hh) * sq + m0 + i] = l[i] > 0.f ? m2[i] * LN2 + logf(l[i]) : -INFINITY;
            }
        }
        free(s);
    }
    free(kt);
    return failed;
}

/* ---- backward --------------------------------------------------------------------------- */


/* Row i of a backward block in place: P = exp2(S - l2) over the row's keys [a, b) (0 elsewhere, up
 * to BNB), dS = scale P (dP - dl); CAPPED: the row holds raw scores x = scale q.k / softcap, the
 * score is s = softcap tanh(x) (cap = softcap log2(e) in base 2) and dS takes 1 - tanh(x)^2. */
static inline AI void p_and_ds(float *pr, float *dr, int64_t a, int64_t b, float l2, float dl, float scale, float cap,
                               const int capped) {
    int64_t j = 0;
    if (a < b) {
        for (; j < a / VL * VL; j += VL) *(vec *)(pr + j) = *(vec *)(dr + j) = (vec){0};
        for (; j < b; j += VL) {
            vec x = *(vec *)(pr + j), f = (vec){0} + scale;
            if (capped) {
                const vec t = tanhv(x);
                x = t * cap;
                f = f * (1.f - t * t);
            }
            vec pv = exp2v(x - l2), dsv = pv * (*(vec *)(dr + j) - dl) * f;
            if (j < a || j + VL > b) {
                const ivec in = lanes(j, a, b);
                pv = pick(in, pv, (vec){0});
                dsv = pick(in, dsv, (vec){0});
            }
            *(vec *)(pr + j) = pv;
            *(vec *)(dr + j) = dsv;
        }
    }
    for (; j < BNB; j += VL) *(vec *)(pr + j) = *(vec *)(dr + j) = (vec){0};
}

int ringkv_flash_bwd_f32(const float *dout, const float *q, const float *k, const float *v, const float *out,
                         const float *lse, const float *dlse, float *dq, float *dk, float *dv, int64_t nbatch,
                         int64_t sq, int64_t sk, int64_t h, int64_t hkv, int64_t d, int64_t vd, const int64_t *dost,
                         const int64_t *qst, const int64_t *kst, const int64_t *vst, const int64_t *ost,
                         const int64_t *dqst, const int64_t *dkst, const int64_t *dvst, int64_t lo, int64_t hi,
                         float scale, float softcap, int accumulate, int nthreads) {
    const int64_t g = h / hkv;
    /* S in base 2 (c q.k), or raw for the cap (scale q.k / softcap; p_and_ds caps it) */
    const float c = softcap > 0.f ? scale / softcap : scale * LOG2E, cap = softcap > 0.f ? softcap * LOG2E : 0.f;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        /* P and dS (BMB x BNB), K^T and V^T panels, dK and dV of a block, then delta and lse2 */
        const size_t floats = (size_t)(2 * BMB * BNB + 2 * BNB * (d + vd) + 2 * g * sq + 16);
        float *p = aligned_alloc(64, sizeof(float) * ((floats + 15) / 16 * 16));
        if (!p) failed = 1;
        float *ds = p + BMB * BNB, *kt = ds + BMB * BNB, *vt = kt + BNB * d, *dkb = vt + BNB * vd, *dvb = dkb + BNB * d;
        float *delta = dvb + BNB * vd, *lse2 = delta + g * sq;
        int64_t ja[BMB], jb[BMB];
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nbatch * hkv; it++) {
            if (!p) continue;
            const int64_t b = it / hkv, hk = it % hkv;
            for (int64_t gi = 0; gi < g; gi++) { /* per row: delta = dO . out - dlse, lse in base 2 */
                const int64_t hh = hk * g + gi;
                for (int64_t i = 0; i < sq; i++) {
                    const float *x = dout + b * dost[0] + i * dost[1] + hh * dost[2];
                    const float *y = out + b * ost[0] + i * ost[1] + hh * ost[2];
                    float acc = 0.f;
                    for (int64_t e = 0; e < vd; e++) acc = fmaf(x[e], y[e], acc); /* as dP = dO . v is summed */
                    const float dl = dlse ? dlse[(b * h + hh) * sq + i] : 0.f;
                    delta[gi * sq + i] = acc - dl;
                    lse2[gi * sq + i] = lse[(b * h + hh) * sq + i] * LOG2E;
                }
            }
            const float *kb = k + b * kst[0] + hk * kst[2], *vb = v + b * vst[0] + hk * vst[2];
            for (int64_t n0 = 0; n0 < sk; n0 += BNB) {
                const int64_t nb = min64(BNB, sk - n0);
                /* the rows that see a key of this block: i + hi >= n0 and i + lo < n0 + nb */
                const int64_t i0 = clamp(n0 - hi, 0, sq), i1 = clamp(n0 + nb - lo, 0, sq);
                if (i0 >= i1) {
                    if (!accumulate)
                        for (int64_t j = 0; j < nb; j++) {
                            memset(dk + b * dkst[0] + (n0 + j) * dkst[1] + hk * dkst[2], 0, sizeof(float) * (size_t)d);
                            memset(dv + b * dvst[0] + (n0 + j) * dvst[1] + hk * dvst[2], 0, sizeof(float) * (size_t)vd);
                        }
                    continue;
                }
                pack_panels(kb + n0 * kst[1], kst[1], nb, d, kt);
                pack_panels(vb + n0 * vst[1], vst[1], nb, vd, vt);
                memset(dkb, 0, sizeof(float) * (size_t)(BNB * (d + vd))); /* dkb and dvb */
                for (int64_t gi = 0; gi < g; gi++) {
                    const int64_t hh = hk * g + gi;
                    for (int64_t m0 = i0; m0 < i1; m0 += BMB) {
                        const int64_t mr = min64(BMB, i1 - m0);
                        const float *qb = q + b * qst[0] + m0 * qst[1] + hh * qst[2];
                        const float *dob = dout + b * dost[0] + m0 * dost[1] + hh * dost[2];
                        float *dqb = dq + b * dqst[0] + m0 * dqst[1] + hh * dqst[2];
                        row_keys(ja, jb, m0 - n0, mr, lo, hi, nb);
                        for (int64_t r0 = 0; r0 < mr; r0 += MRS) { /* S and dP on the panels each group sees */
                            const int64_t g1 = min64(mr, r0 + MRS);
                            int64_t ga, gb;
                            group_keys(ja, jb, r0, g1, nb, &ga, &gb);
                            for (int64_t pp = ga / PW; pp * PW < gb; pp++) {
                                score_rows(qb + r0 * qst[1], qst[1], kt + pp * d * PW, d, c, p + r0 * BNB + pp * PW,
                                           BNB, g1 - r0, 0.f);
                                score_rows(dob + r0 * dost[1], dost[1], vt + pp * vd * PW, vd, 1.f,
                                           ds + r0 * BNB + pp * PW, BNB, g1 - r0, 0.f);
                            }
                        }
                        for (int64_t i = 0; i < mr; i++) { /* P = exp2(S - lse2), dS = scale P (dP - delta) */
                            const float l2 = lse2[gi * sq + m0 + i], dl = delta[gi * sq + m0 + i];
                            if (cap != 0.f)
                                p_and_ds(p + i * BNB, ds + i * BNB, ja[i], jb[i], l2, dl, scale, cap, 1);
                            else
                                p_and_ds(p + i * BNB, ds + i * BNB, ja[i], jb[i], l2, dl, scale, cap, 0);
                        }
                        for (int64_t j0 = 0; j0 < nb; j0 += MRO) { /* dV += P^T dO, dK += dS^T q */
                            const int64_t kr = min64(MRO, nb - j0);
                            prod_rows(p + j0, 1, BNB, dob, dost[1], 0, mr, vd, dvb + j0 * vd, vd, 0, 1, kr);
                            prod_rows(ds + j0, 1, BNB, qb, qst[1], 0, mr, d, dkb + j0 * d, d, 0, 1, kr);
                        }
                        for (int64_t r0 = 0; r0 < mr; r0 += MRO) { /* dq += dS K over the group's keys */
                            const int64_t g1 = min64(mr, r0 + MRO);
                            int64_t ga, gb;
                            group_keys(ja, jb, r0, g1, nb, &ga, &gb);
                            if (ga < gb)
                                prod_rows(ds + r0 * BNB, BNB, 1, kb + n0 * kst[1], kst[1], ga, gb, d,
                                          dqb + r0 * dqst[1], dqst[1], 0, 1, g1 - r0);
                        }
                    }
                }
                for (int64_t j = 0; j < nb; j++) {
                    float *dkr = dk + b * dkst[0] + (n0 + j) * dkst[1] + hk * dkst[2];
                    float *dvr = dv + b * dvst[0] + (n0 + j) * dvst[1] + hk * dvst[2];
                    for (int64_t e = 0; e < d; e++) dkr[e] = (accumulate ? dkr[e] : 0.f) + dkb[j * d + e];
                    for (int64_t e = 0; e < vd; e++) dvr[e] = (accumulate ? dvr[e] : 0.f) + dvb[j * vd + e];
                }
            }
        }
        free(p);
    }
    return failed;
}
