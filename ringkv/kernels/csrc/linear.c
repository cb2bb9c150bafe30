/* y = x W^T on the CPU, weights packed once: a decode step's few rows and a prefill's many
 * (ringkv/kernels/linear_cpu.py builds and loads this file; it needs no torch headers).
 *
 * w   (N, K)  float32, contiguous: an nn.Linear weight
 * wp  (P, K, NR) float32: w packed once, P = ceil(N / NR) panels of NR output columns, each
 *             stored k-major so a panel streams as one contiguous run (columns past N are 0)
 * x   (M, K)  float32, contiguous;  y (M, N) float32, contiguous
 *
 * Panels (and a prefill's groups of rows) are split over the threads; a panel's MR-row tiles keep their MR x NR sums in
 * registers (2 MR vectors) over a chunk of KC k steps, and every tile runs a chunk before the next one starts,
 * so a chunk of the panel is read from memory once and then from L1 (measured 3-5% faster at
 * 16-32 rows than each tile over all of K). While a panel computes, the next one is prefetched,
 * spread over its k loops, so memory streams while the FMAs run (the win over oneDNN's packed GEMM for a few
 * rows, where the weights' bytes, not the FLOPs, bound the time). Each output is summed in k
 * order by one thread: the result does not depend on the number of threads.
 *
 * The tile is chosen when the file is compiled, from the target's vector registers (NR is the
 * build's: linear_cpu.py asks ringkv_linear_nr, and a packed weight is for the build that packed
 * it). A panel's row is two vectors of VL floats; a tile keeps 2 MR accumulators, plus the
 * panel row's two vectors and one broadcast x. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16 /* 32 zmm registers: 16 accumulators (8 rows x 32 columns) */
#define MR 8
#define TILES "avx512: panels of 32 columns, tiles of 8 rows (16 zmm accumulators)"
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8 /* 16 ymm registers: 12 accumulators + 2 + 1 (the classic 6 x 16 micro-kernel) */
#define MR 6
#define TILES "avx2: panels of 16 columns, tiles of 6 rows (12 ymm accumulators)"
#else
#define VL 4 /* 128-bit vectors (SSE2's 16 xmm, NEON's 32 q; plain C elsewhere): 12 accumulators */
#define MR 6
#define TILES "generic: panels of 8 columns, tiles of 6 rows (12 128-bit accumulators)"
#endif
#define NR (2 * VL) /* output columns per panel: two vectors */

typedef float vec __attribute__((vector_size(4 * VL)));
typedef float vecu __attribute__((vector_size(4 * VL), aligned(4)));

int64_t ringkv_linear_nr(void) { return NR; }
const char *ringkv_linear_tiles(void) { return TILES; }
int64_t ringkv_linear_packed_floats(int64_t n, int64_t k) { return (n + NR - 1) / NR * k * NR; }

void ringkv_linear_pack_f32(const float *w, float *wp, int64_t n, int64_t k) {
    int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < NR; j++) {
                int64_t col = p * NR + j;
                wp[(p * k + kk) * NR + j] = col < n ? w[col * k + kk] : 0.f;
            }
}

/* rows ids[0..t) of the (n, k) w, read back from its packed copy (a tied embedding's lookup):
 * out (t, k). Returns 0, or 1 (nothing written) when an id is outside [0, n). */
int ringkv_linear_rows_f32(const float *wp, const int64_t *ids, float *out, int64_t t, int64_t n, int64_t k) {
    for (int64_t i = 0; i < t; i++)
        if (ids[i] < 0 || ids[i] >= n) return 1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < t; i++) {
        const float *col = wp + ids[i] / NR * k * NR + ids[i] % NR;
        for (int64_t kk = 0; kk < k; kk++) out[i * k + kk] = col[kk * NR];
    }
    return 0;
}

/* The next panel's prefetch while a panel computes. A decode step's single row group, when a line
 * per k step would be too fast (`spread`: AVX2's 6-row tiles, or more than two tiles), asks for the
 * lines evenly over the panel's k steps: a line each time `credit` reaches `line`, each k step of a
 * tile adding `rate` (measured at 16 rows of SmolLM2's shapes on an Intel Xeon, 2 threads, AVX2:
 * 29-31 -> 24.5-27 ms; a line every k step asked for the panel in its first third, and the FMAs
 * then waited on memory). Otherwise a line (two when a step reads 128 bytes) every k step from the
 * start: a prefill's groups are compute-bound, and the per-step count cost them 4-10%. */
struct pf {
    const char *at, *end; /* the next line to ask for, the next panel's end (at == end: done) */
    int64_t credit, rate, line;
    int two;
};

/* rows m0..m0+mr of one panel, k steps k0..k1; sums start from sav (or 0 when first) and go back
 * to sav (or to y when last), prefetching the next panel on the way (pf) */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *y, int64_t k,
                                                       int64_t k0, int64_t k1, vec *sav, int first, int last,
                                                       int64_t n, int64_t ncols, const int mr, struct pf *pf,
                                                       const int spread) {
    vec a0[MR], a1[MR];
    const char *at = pf->at, *const end = pf->end; /* kept in registers over the k loop */
    int64_t credit = pf->credit;
    const int64_t rate = pf->rate, line = pf->line;
    const int two = pf->two, ask = at < end; /* a prefill's tile asks from its first step while lines remain */
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        if (first) a0[i] = a1[i] = (vec){0};
        else if (i < mr) { a0[i] = sav[2 * i]; a1[i] = sav[2 * i + 1]; }
    }
    for (int64_t kk = k0; kk < k1; kk++) {
        const vec w0 = *(const vec *)(w + kk * NR), w1 = *(const vec *)(w + kk * NR + VL);
        if (spread) {
            credit += rate;
            while (credit >= line && at < end) {
                __builtin_prefetch(at, 0, 2);
                at += 64;
                credit -= line;
            }
        } else if (ask) {
            __builtin_prefetch(at, 0, 2);
            if (two) __builtin_prefetch(at + 64, 0, 2);
            at += two ? 128 : 64;
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
            if (i < mr) {
                const float xv = x[i * k + kk];
                a0[i] += xv * w0;
                a1[i] += xv * w1;
            }
    }
    pf->at = at;
    pf->credit = credit;
    if (!last) {
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
            if (i < mr) { sav[2 * i] = a0[i]; sav[2 * i + 1] = a1[i]; }
        return;
    }
    for (int i = 0; i < mr; i++) {
        if (ncols == NR) {
            *(vecu *)(y + i * n) = a0[i];
            *(vecu *)(y + i * n + VL) = a1[i];
        } else {
            float buf[NR];
            memcpy(buf, &a0[i], sizeof(vec));
            memcpy(buf + VL, &a1[i], sizeof(vec));
            memcpy(y + i * n, buf, ncols * sizeof(float));
        }
    }
}

#define KC 128 /* k steps per chunk: every tile of a group runs a chunk (then in L1) before the next */
#define MAX_TILES ((128 + MR - 1) / MR) /* tiles per row group: their sums are kept between chunks */

#define TILE(R) \
    case R: \
        if (R <= MR && spread) tile(xm, w, ym, k, k0, k1, sv, first, last, n, ncols, R, &pf, 1); \
        else if (R <= MR) tile(xm, w, ym, k, k0, k1, sv, first, last, n, ncols, R, &pf, 0); \
        break;

/* The work is (panel, row group) pairs. A decode step's few rows are one group, so the threads
 * split the panels. A prefill's many rows are many groups, group-major: a thread runs its group of
 * rows (kept in L2) over every panel before the next group, so the weight, not x, is what streams
 * again (measured 228-266 -> 308-341 GFLOP/s at 2048 rows of SmolLM2's shapes on an Intel Xeon,
 * 2 threads, where panel-major re-read x once per panel). Each job prefetches the next panel. */
void ringkv_linear_f32(const float *x, const float *wp, float *y, int64_t m, int64_t n, int64_t k) {
    const int64_t panels = (n + NR - 1) / NR, tiles = (m + MR - 1) / MR, bytes = k * NR * (int64_t)sizeof(float);
    const int64_t groups = (tiles + MAX_TILES - 1) / MAX_TILES, chunks = (k + KC - 1) / KC;
#pragma omp parallel for schedule(static)
    for (int64_t job = 0; job < panels * groups; job++) {
        const int64_t p = job % panels, g = job / panels;
        const int64_t t0 = g * MAX_TILES, t1 = t0 + MAX_TILES < tiles ? t0 + MAX_TILES : tiles;
        const float *w = wp + p * k * NR;
        const int64_t ncols = n - p * NR < NR ? n - p * NR : NR;
        const char *next = p + 1 < panels ? (const char *)(w + k * NR) : 0;
        const int64_t steps = (t1 - t0) * k; /* this job's k steps, all tiles */
        const int spread = groups == 1 && bytes < 64 * steps;
        struct pf pf = {next, next ? next + bytes : 0, 0, bytes, 64 * steps, bytes > 64 * steps};
        vec sav[2 * MR * MAX_TILES]; /* each tile's sums between chunks */
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t k0 = c * KC, k1 = k0 + KC < k ? k0 + KC : k;
            const int first = c == 0, last = c == chunks - 1;
            for (int64_t t = t0; t < t1; t++) {
                const int64_t m0 = t * MR, mr = m - m0 < MR ? m - m0 : MR;
                const float *xm = x + m0 * k;
                float *ym = y + m0 * n + p * NR;
                vec *sv = sav + 2 * MR * (t - t0);
                switch (mr) { /* a register tile per row count (up to the build's MR) */
                    TILE(8) TILE(7) TILE(6) TILE(5) TILE(4) TILE(3) TILE(2) default: TILE(1)
                }
            }
        }
    }
}

/* AOTInductor's direct call: the op ringkv::packed_linear(x, packed, n) as a function of torch's C
 * ABI (torch/csrc/inductor/aoti_torch/c/shim.h), so a compiled graph (ringkv/parallel/compiled.py)
 * calls this kernel without going through Python: a 16-row SmolLM2 decode step spent ~20 ms of ~60
 * on the host, and the 211 linears' trips into Python and back were ~4 ms of it (what going
 * without them saved, measured). torch's C
 * functions are handed in once by linear_cpu.aoti_shim (this file needs no torch headers). */
typedef struct AtenTensorOpaque *AtenTensorHandle;
typedef int32_t AOTITorchError;
static struct {
    AOTITorchError (*data_ptr)(AtenTensorHandle, void **);
    AOTITorchError (*dim)(AtenTensorHandle, int64_t *);
    AOTITorchError (*sizes)(AtenTensorHandle, int64_t **);
    AOTITorchError (*strides)(AtenTensorHandle, int64_t **);
    AOTITorchError (*dtype)(AtenTensorHandle, int32_t *);
    AOTITorchError (*numel)(AtenTensorHandle, int64_t *);
    AOTITorchError (*empty)(int64_t, const int64_t *, const int64_t *, int32_t, int32_t, int32_t, AtenTensorHandle *);
    int32_t f32, cpu;
} aoti;

void ringkv_linear_aoti_init(void *data_ptr, void *dim, void *sizes, void *strides, void *dtype, void *numel,
                             void *empty, int32_t f32, int32_t cpu) {
    aoti.data_ptr = data_ptr;
    aoti.dim = dim;
    aoti.sizes = sizes;
    aoti.strides = strides;
    aoti.dtype = dtype;
    aoti.numel = numel;
    aoti.empty = empty;
    aoti.f32 = f32;
    aoti.cpu = cpu;
}

#define MAX_DIMS 8
/* x (..., K) float32, any strides (a view the graph hands over is gathered into a contiguous copy
 * first), packed by this build for an (n, K) weight -> *out (..., n) float32, new. 0, or 1 with
 * nothing allocated: not initialised, not float32, more than MAX_DIMS dimensions, a packed size
 * that is not an (n, K) weight's, or no memory. */
AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle packed, int64_t n,
                                            AtenTensorHandle *out) {
    int64_t d, *size, *stride, m = 1, shape[MAX_DIMS], contiguous[MAX_DIMS];
    int32_t xt, wt;
    void *xp, *wp, *yp;
    if (!aoti.empty || aoti.dim(x, &d) || d < 1 || d > MAX_DIMS || aoti.sizes(x, &size) ||
        aoti.strides(x, &stride) || aoti.dtype(x, &xt) || aoti.dtype(packed, &wt) || xt != aoti.f32 ||
        wt != aoti.f32 || aoti.data_ptr(x, &xp) || aoti.data_ptr(packed, &wp))
        return 1;
    const int64_t k = size[d - 1];
    int64_t floats;
    if (aoti.numel(packed, &floats) || floats != ringkv_linear_packed_floats(n, k)) return 1;
    int dense = 1; /* x's strides are those of a contiguous tensor (size-1 dimensions aside) */
    for (int64_t i = d - 1, want = 1; i >= 0; want *= size[i--]) {
        dense &= size[i] == 1 || stride[i] == want;
        shape[i] = i == d - 1 ? n : size[i];
        if (i < d - 1) m *= size[i];
    }
    for (int64_t i = d - 1, s = 1; i >= 0; s *= shape[i--]) contiguous[i] = s;
    float *xc = 0;
    if (!dense && m && k) { /* gather x's elements in row-major order */
        if (!(xc = malloc(m * k * sizeof(float)))) return 1;
        for (int64_t e = 0; e < m * k; e++) {
            int64_t off = 0, r = e;
            for (int64_t i = d - 1; i >= 0; i--) {
                off += r % size[i] * stride[i];
                r /= size[i];
            }
            xc[e] = ((const float *)xp)[off];
        }
    }
    if (aoti.empty(d, shape, contiguous, aoti.f32, aoti.cpu, 0, out) || aoti.data_ptr(*out, &yp)) {
        free(xc);
        return 1;
    }
    if (m && n && !k) memset(yp, 0, m * n * sizeof(float)); /* a sum over nothing */
    else if (m && n) ringkv_linear_f32(xc ? xc : xp, wp, yp, m, n, k);
    free(xc);
    return 0;
}
