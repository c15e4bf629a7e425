// specchat's CPU kernels: products y[n, O] = x[n, I] @ W^T for weights kept compact (bitsandbytes'
// NF4 in nf4.c, bf16 in bf16.c, GGUF's Q8_0 in q8_0.c), the attention of a few query rows over
// the KV cache (attention.c) and Gemma's RMSNorm (norms.c). Compiled together into one library
// by specchat/kernels/__init__.py on first use; called through ctypes with torch tensors' pointers.
//
// Each output y[j, o] is computed by the same instructions in the same order whatever n is:
// W's row o is decoded to float32 (exactly the value bitsandbytes' dequantize gives), then
// dotted with x's row j in one 8-wide accumulator over the row in order (NF4: over each block,
// then scaled once per block), then summed in a fixed order. So a row's result is the same bits
// alone or among any number of rows, which is what keeps greedy speculative decoding identical
// to plain greedy decoding.
//
// Two builds of the same files:
// - the SIMD build (x86 with AVX2 + FMA + F16C: -mavx2 -mfma -mf16c) has the SIMD kernels
//   (`nf4_matmul`, ...) and, beside each, its plain-C reference (`nf4_matmul_ref`, ...);
// - the portable build (no ISA flags; any CPU with a C compiler) has only the references.
// A reference emulates its kernel's SIMD lanes with small float arrays: the same fused
// multiply-adds (`fmaf`), lane by lane, in the same order, then the same horizontal sum
// (`sum_lanes8`, `sum_lanes16`). It gives the same bits as the kernel for every input, and it is
// the plain statement of the kernel's arithmetic. Both builds use -ffp-contract=off, so that the
// compiler fuses no a * b + c on its own (the SIMD kernels' machine code is the same with it).
#ifndef SPECCHAT_KERNELS_COMMON_H
#define SPECCHAT_KERNELS_COMMON_H

#include <math.h>
#include <stdint.h>

#include "specchat.h"  // the exported functions and shared structs, declared once
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECCHAT_SIMD 1
#include <immintrin.h>
#else
#define SPECCHAT_SIMD 0
#endif

#define MAX_IN 16384  // floats of one decoded weight row (on the stack, OUT_TILE of them)
#define OUT_TILE 4     // weight rows decoded and used together
#define X_TILE 2       // rows of x per pass over them

// ---- plain C, both builds -------------------------------------------------------------------

// Every exported product checks its sizes before anything else: with no rows or no outputs
// there is nothing to do, and it returns; with input rows it cannot take (`in` not a positive
// multiple of `multiple`, or over `max_in` when the kernel keeps a decoded row on the stack; 0:
// no such limit) it fills y [n, out] with NaN, which a caller's own check cannot miss, rather
// than read or write past a buffer. Returns whether to go on.
static inline int sizes_ok(int64_t n, int64_t in, int64_t out, int64_t multiple,
                           int64_t max_in, float *y) {
    if (n <= 0 || out <= 0) return 0;
    if (in <= 0 || multiple <= 0 || in % multiple || (max_in && in > max_in)) {
        for (int64_t i = 0; i < n * out; i++) y[i] = __builtin_nanf("");
        return 0;
    }
    return 1;
}

// The same for the kernels that map n rows of `dim` values to rows of `dim` (attention,
// norms): `dim` must be a positive multiple of 8 and `valid` true (the kernel's other sizes);
// NaN rows otherwise (bf16 NaN for bf16 out).
static inline int rows_ok(int64_t n, int64_t dim, int valid, int bf16, void *y) {
    if (n <= 0) return 0;
    if (!valid || dim <= 0 || dim % 8) {
        for (int64_t i = 0; i < n * (dim > 0 ? dim : 0); i++) {
            if (bf16)
                ((uint16_t *)y)[i] = 0x7fc0;
            else
                ((float *)y)[i] = __builtin_nanf("");
        }
        return 0;
    }
    return 1;
}

// The sum of an 8-wide accumulator's lanes in `hsum`'s order: the high half onto the low half,
// then lanes 2, 3 onto 0, 1, then lane 1 onto lane 0.
static inline float sum_lanes8(const float v[8]) {
    const float s0 = v[0] + v[4], s1 = v[1] + v[5], s2 = v[2] + v[6], s3 = v[3] + v[7];
    return (s0 + s2) + (s1 + s3);
}

// `hsum16`'s order (q8_0.c): the high 8 lanes onto the low 8, then `sum_lanes8`.
static inline float sum_lanes16(const float v[16]) {
    float h[8];
    for (int l = 0; l < 8; l++) h[l] = v[l] + v[l + 8];
    return sum_lanes8(h);
}

static inline float bf16_to_float(uint16_t h) {  // exact
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// fp16 -> float32, exactly, as F16C's vcvtph2ps does (subnormals kept, NaNs made quiet)
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
    uint32_t u;
    if (e == 31)
        u = sign | 0x7f800000u | (m ? 0x400000u | m << 13 : 0);  // infinity, NaN
    else if (e)
        u = sign | (e + 112) << 23 | m << 13;
    else {  // zero or subnormal: m * 2^-24, exact in float32
        const float f = (float)m * 0x1p-24f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// e^z, specchat's own, for every CPU: z - n ln 2 (n = rint(z / ln 2), ln 2 in two parts) into
// Cephes' degree-6 polynomial, scaled by 2^n; within 2 ulp of glibc's expf. `exp_core8` takes 8
// lanes by the same operations in the same order: the same bits. z must lie in [EXP_MIN, 88];
// `exp_or_zero` takes any z <= 88, giving 0 below EXP_MIN (e^-87 is 1.6e-38: a softmax's sum,
// at least 1, cannot tell).
#define EXP_MIN -87.0f
static const float exp_poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_core(float z) {
    const float n = rintf(z * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, z);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = exp_poly[0];
    for (int i = 1; i < 6; i++) p = fmaf(p, r, exp_poly[i]);
    p = fmaf(p, r * r, r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline float exp_or_zero(float z) { return z >= EXP_MIN ? exp_core(z) : 0.0f; }

// tanh(y) = 1 - 2 / (e^2y + 1) with specchat's own e^z, 2|y| clamped at 18 (beyond it tanh is
// +-1 in float32); and a soft-cap, cap tanh(x / cap) (Gemma 2's attention scores and logits).
// Scalar wherever it runs, so every build computes the same bits.
static inline float tanh_of(float y) {
    float y2 = 2.0f * y;
    y2 = y2 > 18.0f ? 18.0f : y2 < -18.0f ? -18.0f : y2;
    return 1.0f - 2.0f / (exp_core(y2) + 1.0f);
}

static inline float softcap_of(float x, float cap) { return cap * tanh_of(x / cap); }

// value c of a key, value or input row, float32 or bf16 (widened exactly)
static inline float load1(const void *row, int64_t c, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)row)[c]) : ((const float *)row)[c];
}

// ---- SIMD build only --------------------------------------------------------------------------
#if SPECCHAT_SIMD

static inline __m256 exp_core8(__m256 z) {  // `exp_core`, 8 lanes
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(z, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), z);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(exp_poly[0]);
    for (int k = 1; k < 6; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(exp_poly[k]));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// `exp_or_zero`, 8 lanes, and 0 where `keep` is clear
static inline __m256 exp_or_zero8(__m256 z, __m256 keep) {
    const __m256 low = _mm256_set1_ps(EXP_MIN);
    keep = _mm256_and_ps(keep, _mm256_cmp_ps(z, low, _CMP_GE_OQ));
    return _mm256_and_ps(exp_core8(_mm256_max_ps(z, low)), keep);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// y[j * out + o] for no decoded weight rows w (stride in) and nj rows of x (stride in). Every
// (o, j) is one 8-wide accumulator over k in order, then `hsum`: the tiling changes nothing.
static inline __attribute__((always_inline)) void tile(int no, int nj, const float *w,
                                                       const float *x, int64_t in, float *y,
                                                       int64_t out) {
    __m256 acc[OUT_TILE][X_TILE];
    for (int o = 0; o < no; o++)
        for (int j = 0; j < nj; j++) acc[o][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < in; k += 8) {
        __m256 xv[X_TILE];
        for (int j = 0; j < nj; j++) xv[j] = _mm256_loadu_ps(x + j * in + k);
        for (int o = 0; o < no; o++) {
            __m256 wv = _mm256_load_ps(w + o * in + k);
            for (int j = 0; j < nj; j++) acc[o][j] = _mm256_fmadd_ps(wv, xv[j], acc[o][j]);
        }
    }
    for (int o = 0; o < no; o++)
        for (int j = 0; j < nj; j++) y[j * out + o] = hsum(acc[o][j]);
}

#define TILE(NO, NJ) tile(NO, NJ, w, x + j * in, in, y + j * out, out)

// all rows of x against no (<= OUT_TILE) decoded weight rows; constant tile shapes, so the
// accumulators stay in registers. A function of its own (noinline), called once per group of
// weight rows.
static __attribute__((noinline, unused)) void rows(int no, const float *w, const float *x,
                                                   int64_t n, int64_t in, float *y,
                                                   int64_t out) {
    for (int64_t j = 0; j < n; j += X_TILE) {
        int two = n - j >= 2;
        switch (no * 2 + two) {
            case 2: TILE(1, 1); break;
            case 3: TILE(1, 2); break;
            case 4: TILE(2, 1); break;
            case 5: TILE(2, 2); break;
            case 6: TILE(3, 1); break;
            case 7: TILE(3, 2); break;
            case 8: TILE(4, 1); break;
            case 9: TILE(4, 2); break;
        }
    }
}

#undef TILE

// 8 values of a key, value or input row, float32 or bf16 (widened exactly)
static inline __m256 load8(const void *row, int64_t c, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)row + c);
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

#endif  // SPECCHAT_SIMD

// An LM head's block maxima: the largest logit of each HEAD_BLOCK outputs of a row (NaN where
// the block holds a NaN), written by the head's product as it finishes each block, while the
// block is in its core's cache. The sampler finds the argmax and min-p's candidates from them
// (sample.c) and reads only the blocks it needs, not the whole row again after the product.
#define HEAD_BLOCK 64

// Every block maximum of n rows of `out` outputs NaN (unknown): what a product leaves where it
// returns early (sizes it does not take, no memory), and what its blocks then overwrite.
static inline void maxima_unknown(float *maxima, int64_t n, int64_t out) {
    if (!maxima || n <= 0 || out <= 0) return;
    for (int64_t i = 0; i < n * ((out + HEAD_BLOCK - 1) / HEAD_BLOCK); i++)
        maxima[i] = __builtin_nanf("");
}

// maxima[j * stride + b0 / HEAD_BLOCK] = the largest of y[j * out + b0 .. b1), for the n rows
// (b0 a multiple of HEAD_BLOCK, b1 - b0 at most HEAD_BLOCK). Max is exact: any order gives it.
static inline void block_maxima(const float *y, int64_t n, int64_t out, int64_t b0, int64_t b1,
                                float *maxima, int64_t stride) {
    for (int64_t j = 0; j < n; j++) {
        const float *v = y + j * out;
        float m = -INFINITY;
        int64_t o = b0;
#if SPECCHAT_SIMD
        __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        for (; o + 8 <= b1; o += 8) {
            __m256 x = _mm256_loadu_ps(v + o);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            best = _mm256_max_ps(best, x);
        }
        if (_mm256_movemask_ps(nan)) {
            m = __builtin_nanf("");
            o = b1;
        } else {
            float lanes[8];
            _mm256_storeu_ps(lanes, best);
            for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
        }
#endif
        for (; o < b1; o++) {
            if (v[o] != v[o]) {
                m = v[o];
                break;
            }
            m = v[o] > m ? v[o] : m;
        }
        maxima[j * stride + b0 / HEAD_BLOCK] = m;
    }
}

// ---- activations quantized as llama.cpp's Q8_0 (the integer products: q8_0.c, q6_k.c) ---
// dx of a block whose max |x| has the bits amax_bits; *id the factor that quantizes it
static inline float q8i_scale(uint32_t amax_bits, float *id) {
    if (amax_bits >= 0x7f800000u) {  // an infinity or a NaN in the block
        *id = 0.0f;
        return __builtin_nanf("");
    }
    float amax;
    memcpy(&amax, &amax_bits, 4);
    const float dx = amax / 127.0f;
    float inv = dx != 0.0f ? 1.0f / dx : 0.0f;
    if (!(inv <= 0x1.fffffep127f)) inv = 0.0f;  // 1 / dx overflowed: dx tinier than 2^-128
    *id = inv;
    return dx;
}

// qx [n, in] and dx [n, in / 32] for the quantized rows; without the memory for them, y [n, out]
// is NaN (rather than stale values) and the answer 0
static inline int q8i_buffers(int64_t n, int64_t in, int8_t **qx, float **dx, float *y, int64_t out) {
    *qx = malloc((size_t)(n * in));
    *dx = malloc((size_t)(n * (in / 32)) * sizeof(float));
    if (*qx && *dx) return 1;
    for (int64_t i = 0; i < n * out; i++) y[i] = __builtin_nanf("");
    free(*qx);
    free(*dx);
    return 0;
}

// x [n, in] -> qx [n, in] (int8) and dx [n, in / 32], plain C
static inline void q8i_quantize_ref(const float *x, int64_t n, int64_t in, int8_t *qx, float *dx) {
    for (int64_t b = 0; b < n * in / 32; b++) {
        const float *xb = x + 32 * b;
        uint32_t m = 0;
        for (int t = 0; t < 32; t++) {
            uint32_t u;
            memcpy(&u, xb + t, 4);
            u &= 0x7fffffffu;
            m = u > m ? u : m;
        }
        float id;
        dx[b] = q8i_scale(m, &id);
        for (int t = 0; t < 32; t++)
            qx[32 * b + t] = id == 0.0f ? 0 : (int8_t)nearbyintf(xb[t] * id);
    }
}

#endif  // SPECCHAT_KERNELS_COMMON_H
