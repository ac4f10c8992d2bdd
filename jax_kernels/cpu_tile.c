/* The elementwise work on one float32 [n, v] logits tile of negatives, on the CPU, in one pass.
 *
 * Every element's loss is cw softplus(z) and its gradient g cw sigmoid(z), both from one
 * e = exp(-|z|) in (0, 1]:
 *     softplus(z) = max(z, 0) + log1p(e),   sigmoid(z) = (z >= 0 ? 1 : e) / (1 + e),
 * exact to rounding for any z (no cancellation). A positive taken out of the tile (z = -inf) adds 0
 * and gets gradient 0; NaN gives NaN; z = +inf gives loss inf and gradient g cw.
 *
 * Why a hand-written kernel (benchmarks/NOTES.md section 7): one read of the tile gives the rows
 * and the gradient, and the gradient may be written over the logits (dz == z), so the tile's
 * matmuls that follow read the buffer the logits matmul just wrote, as the matmul floor does.
 * torch.compile's C++ makes two passes for that aliasing, XLA:CPU several.
 *
 * Built at run time by cpu_tile_build.py with the machine's own vector width (-march=native) and
 * OpenMP over rows; torch calls it through ctypes, JAX through cpu_tile_ffi.cc. Plain C99 that is
 * also valid C++ (the FFI wrapper includes this file).
 */
#include <stdint.h>
#include <string.h>

#define CUTBCE_INLINE static inline __attribute__((always_inline))

/* exp(-a) for a >= 0, within about 1 ulp, subnormal results included (exp(-104) and below give 0);
 * NaN gives NaN. Cody-Waite reduction x = -a = k ln2 + r, r in [-ln2/2, ln2/2], then
 * exp(r) = 1 + r + r^2 q(r) with q a degree-4 fit (3.6e-9 relative, float64 least squares in
 * the error of exp). k is read from the bits of the rounding sum: adding 1.5 * 2^23 + 191 to a
 * float below 2^22 in size leaves k + 191 in its low mantissa bits, which shifted into the exponent
 * field make 2^(k + 64); times 2^-64 gives 2^k for k down to -150 without a special case. */
CUTBCE_INLINE float cutbce_exp_neg(float a) {
    float x = a > 104.0f ? -104.0f : -a;  /* written so that NaN stays NaN (a NaN compare is false) */
    const float round_magic = 12583103.0f; /* 1.5 * 2^23 + 64 + 127 */
    float shifted = x * 1.44269504088896341f + round_magic;
    float k = shifted - round_magic;       /* round(x / ln 2), exactly */
    float r = x - k * 0.693359375f;        /* ln 2, high part (exact product for |k| < 2^12) */
    r = r - k * -2.12194440e-4f;           /* ln 2, low part */
    float q = 0.0013751760196052667f;
    q = q * r + 0.008368915309963405f;
    q = q * r + 0.04166952684758173f;
    q = q * r + 0.1666651847185333f;
    q = q * r + 0.4999998862080611f;
    float y = q * (r * r) + r + 1.0f;
    uint32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    bits <<= 23;                           /* (k + 191) mod 2^9 into the exponent: 2^(k + 64) */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale * 5.42101086242752217e-20f; /* 2^-64 */
}

/* log1p(e) for e in [0, 1]: 2 atanh(t) = 2 t P(t^2), t = e / (2 + e) in [0, 1/3], relative error
 * 4e-9 (the same fit as torch_cutbce/fused_tile.py and jax_kernels/positives.py). */
CUTBCE_INLINE float cutbce_log1p_unit(float e) {
    float t = e / (2.0f + e);
    float s = t * t;
    float p = 0.33333160203203005f + s * (0.20012325666897016f + s * (0.13982172352698377f + s * 0.1408072687843689f));
    return 2.0f * t * (1.0000000038619887f + s * p);
}

/* One row. The flags are compile-time constants at every call site, so each combination is its own
 * vectorized loop (a test inside the loop would keep gcc from vectorizing it). */
CUTBCE_INLINE void cutbce_row(const float *z, const float *cw, float g, float *dz, float *row, long v,
                              const int want_rows, const int want_grad, const int has_cw) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (long j = 0; j < v; ++j) {
        /* NaN propagates through e (and max(z, 0) is written to keep it), so no test for it. */
        float zj = z[j];
        float e = cutbce_exp_neg(zj < 0.0f ? -zj : zj);
        float w = has_cw ? cw[j] : 1.0f;
        if (want_rows) acc += ((zj < 0.0f ? 0.0f : zj) + cutbce_log1p_unit(e)) * w;
        if (want_grad) dz[j] = g * w * ((zj >= 0.0f ? 1.0f : e) / (1.0f + e));
    }
    if (want_rows) *row = acc;
}

#define CUTBCE_ROWS(ROWS, GRAD, CW)                                                                   \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                               \
    for (long i = 0; i < n; ++i)                                                                     \
        cutbce_row(z + i * v, cw, (GRAD) ? g[i] : 0.0f, (GRAD) ? dz + i * v : 0, (ROWS) ? rows + i : 0, v, \
                   ROWS, GRAD, CW);

/* z, dz [n, v] row-major (dz may be z: each element is read before it is written); cw [v] or
 * NULL (weight 1); g [n]; rows [n]. rows NULL: no loss; dz NULL: no gradient (g unused). */
#ifdef __cplusplus
extern "C"
#endif
void cutbce_tile(const float *z, const float *cw, const float *g, float *dz, float *rows, long n, long v,
                 int threads) {
    if (rows && dz && cw) { CUTBCE_ROWS(1, 1, 1) }
    else if (rows && dz) { CUTBCE_ROWS(1, 1, 0) }
    else if (rows && cw) { CUTBCE_ROWS(1, 0, 1) }
    else if (rows) { CUTBCE_ROWS(1, 0, 0) }
    else if (dz && cw) { CUTBCE_ROWS(0, 1, 1) }
    else if (dz) { CUTBCE_ROWS(0, 1, 0) }
}

/* counts[i] = #{j : z[i, j] > 0}, as float32 (the metrics' predicted positives among negatives). */
#ifdef __cplusplus
extern "C"
#endif
void cutbce_counts(const float *z, float *counts, long n, long v, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < n; ++i) {
        const float *zi = z + i * v;
        int32_t c = 0;
#pragma omp simd reduction(+ : c)
        for (long j = 0; j < v; ++j) c += zi[j] > 0.0f;
        counts[i] = (float)c;
    }
}
