/* The elementwise work on one float32 [n, v] logits tile of negatives, on the CPU, in one pass.
 *
 * Every element's loss is cw softplus(z) and its gradient g cw sigmoid(z), both from one
 * e = exp(-|z|) in (0, 1]:
 *     softplus(z) = max(z, 0) + log1p(e),   sigmoid(z) = (z >= 0 ? 1 : e) / (1 + e),
 * exact to rounding for any z (no cancellation). A positive taken out of the tile (z = -inf) adds 0
 * and gets gradient 0 (even for an infinite g cw); NaN gives NaN; z = +inf gives loss inf and
 * gradient g cw.
 *
 * Why a hand-written kernel (benchmarks/results/cpu_speed.md, 'The tile kernel'): one read of the tile gives the rows
 * and the gradient, and the gradient may be written over the logits (dz == z), so the tile's
 * matmuls that follow read the buffer the logits matmul just wrote, as the matmul floor does.
 * torch.compile's C++ makes two passes for that aliasing, XLA:CPU several.
 *
 * Why vector types, not a plain loop: gcc 12 auto-vectorizes a plain loop of this math only with
 * AVX-512's masked instructions; for AVX2 it gives up ("control flow in loop") and runs it scalar,
 * 10x slower. GCC/Clang vector extensions say the vector code outright, so every ISA gets it:
 * CUTBCE_LANES floats per vector from the target's widest float unit (16 with AVX-512, 8 with AVX,
 * 4 for SSE, NEON and anything else; a target without SIMD gets the same code lowered to scalars).
 * tests/test_neutral_cpu_tile_isa.py checks the built code for x86-64-v3 and x86-64-v4.
 *
 * Row sums: each lane adds CUTBCE_CHUNK elements in float32, then the lanes go into a double, so a
 * row of any width is within about CUTBCE_CHUNK float32 roundings of its exact sum (a float32
 * running sum over V = 2^22 equal terms drifts by 1e-2).
 *
 * Built at run time by cpu_tile_build.py with the machine's own vector width (-march=native) and
 * OpenMP over rows; torch calls it through ctypes, JAX through cpu_tile_ffi.cc. C99 with GNU vector
 * extensions (gcc, clang), also valid C++ (the FFI wrapper includes this file).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define CUTBCE_LANES 16
#elif defined(__AVX__)
#define CUTBCE_LANES 8
#else
#define CUTBCE_LANES 4
#endif
#define CUTBCE_CHUNK 16

typedef float cutbce_vf __attribute__((vector_size(4 * CUTBCE_LANES)));
typedef int32_t cutbce_vi __attribute__((vector_size(4 * CUTBCE_LANES)));
typedef uint32_t cutbce_vu __attribute__((vector_size(4 * CUTBCE_LANES)));

#define CUTBCE_INLINE static inline __attribute__((always_inline))

CUTBCE_INLINE cutbce_vf cutbce_splat(float x) {
    cutbce_vf zero = {0};
    return zero + x;
}

/* mask ? a : b, lane by lane (mask lanes are all ones or all zeros, as comparisons give). */
CUTBCE_INLINE cutbce_vf cutbce_select(cutbce_vi mask, cutbce_vf a, cutbce_vf b) {
    return (cutbce_vf)(((cutbce_vi)a & mask) | ((cutbce_vi)b & ~mask));
}

CUTBCE_INLINE cutbce_vf cutbce_load(const float *p) {
    cutbce_vf x;
    memcpy(&x, p, sizeof x);  /* unaligned load */
    return x;
}

/* exp(-a) for a >= 0, within about 1 ulp, subnormal results included (exp(-104) and below give 0);
 * NaN gives NaN. Cody-Waite reduction x = -a = k ln2 + r, r in [-ln2/2, ln2/2], then
 * exp(r) = 1 + r + r^2 q(r) with q a degree-4 fit (3.6e-9 relative, float64 least squares in
 * the error of exp). k is read from the bits of the rounding sum: adding 1.5 * 2^23 + 191 to a
 * float below 2^22 in size leaves k + 191 in its low mantissa bits, which shifted into the exponent
 * field make 2^(k + 64); times 2^-64 gives 2^k for k down to -150 without a special case. */
CUTBCE_INLINE cutbce_vf cutbce_exp_neg(cutbce_vf a) {
    /* select(a > 104, ...) keeps NaN: a NaN compare is false, so x = -a = NaN */
    cutbce_vf x = cutbce_select(a > 104.0f, cutbce_splat(-104.0f), -a);
    const float round_magic = 12583103.0f; /* 1.5 * 2^23 + 64 + 127 */
    cutbce_vf shifted = x * 1.44269504088896341f + round_magic;
    cutbce_vf k = shifted - round_magic;   /* round(x / ln 2), exactly */
    cutbce_vf r = x - k * 0.693359375f;    /* ln 2, high part (exact product for |k| < 2^12) */
    r = r - k * -2.12194440e-4f;           /* ln 2, low part */
    cutbce_vf q = cutbce_splat(0.0013751760196052667f);
    q = q * r + 0.008368915309963405f;
    q = q * r + 0.04166952684758173f;
    q = q * r + 0.1666651847185333f;
    q = q * r + 0.4999998862080611f;
    cutbce_vf y = q * (r * r) + r + 1.0f;
    /* (k + 191) mod 2^9 into the exponent: 2^(k + 64) */
    cutbce_vf scale = (cutbce_vf)((cutbce_vu)shifted << 23);
    return y * scale * 5.42101086242752217e-20f; /* 2^-64 */
}

/* log1p(e) for e in [0, 1]: 2 atanh(t) = 2 t P(t^2), t = e / (2 + e) in [0, 1/3], relative error
 * 4e-9: the same fit, coefficient for coefficient, as the two sister modules that hold every
 * element's branch math, torch_cutbce/branch_math.py and jax_kernels/branch_math.py (this kernel is
 * their plain-BCE third; tests/test_branch_math.py pins the three against float64 and checks the
 * coefficients match). */
CUTBCE_INLINE cutbce_vf cutbce_log1p_unit(cutbce_vf e) {
    cutbce_vf t = e / (2.0f + e);
    cutbce_vf s = t * t;
    cutbce_vf p = 0.33333160203203005f + s * (0.20012325666897016f + s * (0.13982172352698377f + s * 0.1408072687843689f));
    return 2.0f * t * (1.0000000038619887f + s * p);
}

/* One vector of a row: its loss terms (returned) and, with want_grad, its gradient into dz. */
CUTBCE_INLINE cutbce_vf cutbce_vector(cutbce_vf z, cutbce_vf w, float g, float *dz, const int want_rows,
                                      const int want_grad) {
    cutbce_vi negative = z < 0.0f;
    /* NaN propagates through e (and the selects below keep it), so no test for it. */
    cutbce_vf e = cutbce_exp_neg(cutbce_select(negative, -z, z));
    if (want_grad) {
        cutbce_vf dzv = (g * w) * (cutbce_select(negative, e, cutbce_splat(1.0f)) / (1.0f + e));
        /* a positive taken out (z = -inf) gets exactly 0, also where g w is infinite (inf * 0) */
        dzv = cutbce_select(z == -__builtin_inff(), cutbce_splat(0.0f), dzv);
        memcpy(dz, &dzv, sizeof dzv);  /* unaligned store; z is read already, so dz may be z */
    }
    if (!want_rows) return cutbce_splat(0.0f);
    return (cutbce_select(negative, cutbce_splat(0.0f), z) + cutbce_log1p_unit(e)) * w;
}

CUTBCE_INLINE double cutbce_lanes_sum(cutbce_vf acc) {
    double total = 0.0;
    for (int lane = 0; lane < CUTBCE_LANES; ++lane) total += acc[lane];
    return total;
}

/* One row. The flags are compile-time constants at every call site, so each combination is its own
 * loop; the row goes in chunks of CUTBCE_CHUNK vectors, each chunk's lanes then added into a double.
 * The last v % CUTBCE_LANES elements go through a padded vector (z = -inf, w = 0: loss 0). */
CUTBCE_INLINE void cutbce_row(const float *z, const float *cw, float g, float *dz, float *row, long v,
                              const int want_rows, const int want_grad, const int has_cw) {
    const long step = CUTBCE_LANES, chunk = CUTBCE_CHUNK * CUTBCE_LANES;
    const long chunked = v - v % chunk, body = v - v % step;
    double total = 0.0;
    cutbce_vf acc = cutbce_splat(0.0f);
    for (long start = 0; start < chunked; start += chunk) {
        for (long j = start; j < start + chunk; j += step) {
            cutbce_vf w = has_cw ? cutbce_load(cw + j) : cutbce_splat(1.0f);
            acc += cutbce_vector(cutbce_load(z + j), w, g, want_grad ? dz + j : 0, want_rows, want_grad);
        }
        if (want_rows) {
            total += cutbce_lanes_sum(acc);
            acc = cutbce_splat(0.0f);
        }
    }
    for (long j = chunked; j < body; j += step) {
        cutbce_vf w = has_cw ? cutbce_load(cw + j) : cutbce_splat(1.0f);
        acc += cutbce_vector(cutbce_load(z + j), w, g, want_grad ? dz + j : 0, want_rows, want_grad);
    }
    if (body < v) {
        float zt[CUTBCE_LANES], wt[CUTBCE_LANES], dzt[CUTBCE_LANES];
        const long rest = v - body;
        for (long k = 0; k < CUTBCE_LANES; ++k) {
            zt[k] = k < rest ? z[body + k] : -__builtin_inff();
            wt[k] = k < rest ? (has_cw ? cw[body + k] : 1.0f) : 0.0f;
        }
        acc += cutbce_vector(cutbce_load(zt), cutbce_load(wt), g, dzt, want_rows, want_grad);
        if (want_grad) memcpy(dz + body, dzt, rest * sizeof(float));
    }
    if (want_rows) *row = (float)(total + cutbce_lanes_sum(acc));
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

/* The vector width this library was built with (checked by the tests: what -march gave). */
#ifdef __cplusplus
extern "C"
#endif
int cutbce_lanes(void) {
    return CUTBCE_LANES;
}
