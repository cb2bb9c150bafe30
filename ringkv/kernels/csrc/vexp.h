/* exp(x) on a vector of floats, for the C kernels that include this file (paged_attention.c,
 * pointwise.c). The includer defines VEXP_T (a float vector type) and VEXP_I (the int32 vector of
 * the same width) first. x is clamped to [-87.3, 88] (the normal range of the result; below, the
 * result is exp(-87.3) ~ 1e-38), x = n ln2 + f with |f| <= ln2 / 2, exp(f) by Cephes' degree-7
 * polynomial (relative error ~1e-7, as expf), times 2^n built in the exponent bits. native.py's
 * build key hashes this file with the kernel's source. */
#ifndef RINGKV_VEXP_H
#define RINGKV_VEXP_H

/* mask ? a : b, lane by lane */
static inline VEXP_T vpick(VEXP_I mask, VEXP_T a, VEXP_T b) {
    return (VEXP_T)(((VEXP_I)a & mask) | ((VEXP_I)b & ~mask));
}

static inline VEXP_T vexp(VEXP_T x) {
    const VEXP_T lo = (VEXP_T){0} - 87.33654f, hi = (VEXP_T){0} + 88.f;
    x = vpick(x < lo, lo, x);
    x = vpick(x > hi, hi, x);
    const VEXP_T t = x * 1.44269504088896341f + 0.5f;
    VEXP_I n = __builtin_convertvector(t, VEXP_I);         /* truncates toward 0 */
    n += (VEXP_I)(__builtin_convertvector(n, VEXP_T) > t); /* to floor(t): -1 where it rounded up */
    const VEXP_T fn = __builtin_convertvector(n, VEXP_T);
    const VEXP_T f = x - fn * 0.693359375f - fn * -2.12194440e-4f;
    VEXP_T y = f * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * f + 8.3334519073e-3f;
    y = y * f + 4.1665795894e-2f;
    y = y * f + 1.6666665459e-1f;
    y = y * f + 5.0000001201e-1f;
    y = y * f * f + f + 1.f;
    return y * (VEXP_T)((n + 127) << 23);
}

#endif
