// NF4: two codes a byte, the first in the high nibble, each block of `blocksize` codes (within
// one row) scaled by its absmax. Requires in % blocksize == 0 and blocksize % 32 == 0.
//
// y[j, o] = hsum over the row of acc, acc = fma(blk_b, absmax_b, acc) over the blocks b in
// order, blk_b = table[code] * x in one 8-wide accumulator over the block in order. The codes,
// the table and the scales are bitsandbytes' own, read exactly; applying each block's scale to
// the block's sum instead of to each weight changes only the rounding. The SIMD decoding leaves
// the 8 floats of each group of 8 codes in the order 0, 2, 4, 6, 1, 3, 5, 7 (see nf4_decode32),
// so x is permuted the same way once per call: lane l of an accumulator takes code
// 8g + nf4_lane_code[l] of each group g. Every path (1 row, 2 rows, more) runs those operations
// in that order, so a row's result is the same bits alone or among any number of rows.
#include "common.h"

// the code (within its group of 8) that each of the 8 lanes takes
static const int nf4_lane_code[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// The reference: the arithmetic above, written so that a compiler may run the 8 lanes side by
// side (each lane's own sums in order, the same bits). x is permuted once per call as the SIMD
// path does, and each weight row is decoded once into floats in the lanes' order.
void nf4_matmul_ref(const float *x, int64_t n, int64_t in, const uint8_t *codes,
                    const float *absmax, int64_t blocksize, const float *table, float *y,
                    int64_t out, int threads) {
    if (blocksize <= 0 || blocksize % 32) blocksize = 0;  // no block size it takes: NaN
    if (!sizes_ok(n, in, out, blocksize, 0, y)) return;
    const int64_t nb = in / blocksize;
    float *xp = malloc((size_t)(n * in) * sizeof(float));
    if (!xp) {  // no memory: say so in the output rather than return stale values
        for (int64_t i = 0; i < n * out; i++) y[i] = __builtin_nanf("");
        return;
    }
    for (int64_t k = 0; k < n * in; k += 8)
        for (int l = 0; l < 8; l++) xp[k + l] = x[k + nf4_lane_code[l]];
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < out; o++) {
        const uint8_t *c = codes + o * in / 2;
        float w[in];  // the row's table values, lane l of each 8 holding code nf4_lane_code[l]
        for (int64_t k = 0; k < in; k += 8)
            for (int l = 0; l < 8; l++) {
                const int64_t e = k + nf4_lane_code[l];
                w[k + l] = table[e % 2 ? c[e / 2] & 15 : c[e / 2] >> 4];
            }
        for (int64_t j = 0; j < n; j++) {
            const float *xj = xp + j * in;
            float acc[8] = {0};
            for (int64_t b = 0; b < nb; b++) {
                float blk[8] = {0};
                for (int64_t k = b * blocksize; k < (b + 1) * blocksize; k += 8)
                    for (int l = 0; l < 8; l++) blk[l] = fmaf(w[k + l], xj[k + l], blk[l]);
                const float s = absmax[o * nb + b];
                for (int l = 0; l < 8; l++) acc[l] = fmaf(blk[l], s, acc[l]);
            }
            y[j * out + o] = sum_lanes8(acc);
        }
    }
    free(xp);
}

#if SPECCHAT_SIMD
// The decoding is what bounds one or two rows: AVX2 has no 16-entry float lookup, and the
// shuffle units that do lookups are few. So a table value is looked up a byte at a time: the
// 16 values' bytes form four 16-byte tables (`nf4_planes`), one vpshufb each gives a byte of
// 32 values, and four unpacks interleave them into floats (`nf4_decode32`). That is 13 shuffles
// per 32 codes.
//
// Up to NF4_FUSED_X input rows, the decoded codes stay in registers (`nf4_fused`): each group of
// 32 codes is decoded once and multiplied into every input row's accumulator, two weight rows at
// a time (three for one input row: chains enough to hide the FMA latency). Beyond that the block
// accumulators of more rows no longer fit AVX2's 16 registers, and decoding NF4_TILE_OUT rows
// into a stack buffer, then running register tiles over it (`nf4_tile`), is faster. Measured on
// Zen 3 at 2048x640 and 640x2048: in registers is as fast or faster (up to 1.2x, the latter,
// where the buffer and x outgrow L1) for 3 to 5 rows, slower from 6.
#define NF4_FUSED_ROWS 3  // weight rows decoded in registers together for one input row
#define NF4_FUSED_X 5     // input rows up to which the decoding stays in registers
#define NF4_TILE_OUT 3    // weight rows decoded into a buffer for more input rows
#define NF4_TILE_X 3      // input rows per pass over that buffer
#define NF4_AHEAD 2048    // bytes of codes prefetched ahead of each row's decoding

typedef struct {
    __m256i b0, b1, b2, b3;  // byte p of the 16 table values, in both 128-bit lanes
} nf4_planes;

// 16 bytes of codes (32 values, unscaled) -> f[0..3], in x's permuted order
static inline __attribute__((always_inline)) void nf4_decode32(const uint8_t *c, nf4_planes t,
                                                               __m256 *f) {
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)c));
    // low lane: the high nibbles (even codes); high lane: the low nibbles (odd codes)
    __m256i idx = _mm256_and_si256(
        _mm256_srlv_epi32(b, _mm256_setr_epi32(4, 4, 4, 4, 0, 0, 0, 0)), _mm256_set1_epi8(15));
    __m256i p0 = _mm256_shuffle_epi8(t.b0, idx), p1 = _mm256_shuffle_epi8(t.b1, idx);
    __m256i p2 = _mm256_shuffle_epi8(t.b2, idx), p3 = _mm256_shuffle_epi8(t.b3, idx);
    __m256i l01 = _mm256_unpacklo_epi8(p0, p1), h01 = _mm256_unpackhi_epi8(p0, p1);
    __m256i l23 = _mm256_unpacklo_epi8(p2, p3), h23 = _mm256_unpackhi_epi8(p2, p3);
    f[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(l01, l23));
    f[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(l01, l23));
    f[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(h01, h23));
    f[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(h01, h23));
}

// y[j * out + r] for R weight rows (codes, absmax from the first) and J input rows (xp, stride
// in), decoding in registers: for up to NF4_FUSED_X input rows.
static inline __attribute__((always_inline)) void nf4_fused(int R, int J, const uint8_t *codes,
                                                            const float *absmax, int64_t in,
                                                            int64_t bs, nf4_planes t,
                                                            const float *xp, float *y,
                                                            int64_t out) {
    __m256 acc[NF4_FUSED_ROWS][NF4_FUSED_X];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r][j] = _mm256_setzero_ps();
    const int64_t nb = in / bs;
    for (int64_t i = 0, b = 0; i < nb; i++, b += bs) {
        __m256 blk[NF4_FUSED_ROWS][NF4_FUSED_X];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < J; j++) blk[r][j] = _mm256_setzero_ps();
        for (int r = 0; r < R; r++)  // the hardware's prefetch alone leaves memory time unused
            _mm_prefetch((const char *)codes + ((r * in + b) >> 1) + NF4_AHEAD, _MM_HINT_T0);
        for (int64_t k = b; k < b + bs; k += 32)
            for (int r = 0; r < R; r++) {  // rows interleaved: independent chains
                __m256 f[4];
                nf4_decode32(codes + ((r * in + k) >> 1), t, f);
                for (int q = 0; q < 4; q++)
                    for (int j = 0; j < J; j++)
                        blk[r][j] = _mm256_fmadd_ps(f[q], _mm256_load_ps(xp + j * in + k + 8 * q),
                                                    blk[r][j]);
            }
        for (int r = 0; r < R; r++) {
            __m256 s = _mm256_broadcast_ss(absmax + r * nb + i);
            for (int j = 0; j < J; j++) acc[r][j] = _mm256_fmadd_ps(blk[r][j], s, acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) y[j * out + r] = hsum(acc[r][j]);
}

// nf4_fused for 3 to NF4_FUSED_X input rows, with constant shapes
__attribute__((noinline)) static void nf4_fused_call(int R, int J, const uint8_t *codes,
                                                     const float *absmax, int64_t in, int64_t bs,
                                                     nf4_planes t, const float *xp, float *y,
                                                     int64_t out) {
#define NF4_FUSED(RR, JJ) \
    case RR * 8 + JJ: nf4_fused(RR, JJ, codes, absmax, in, bs, t, xp, y, out); break;
    switch (R * 8 + J) {
        NF4_FUSED(2, 3) NF4_FUSED(2, 4) NF4_FUSED(2, 5)
        NF4_FUSED(1, 3) NF4_FUSED(1, 4) NF4_FUSED(1, 5)  // an odd last weight row
    }
#undef NF4_FUSED
}

// the same sums from decoded rows w (stride in, unscaled): no weight rows, nj input rows
static inline __attribute__((always_inline)) void nf4_tile(int no, int nj, const float *w,
                                                           const float *absmax, const float *xp,
                                                           int64_t in, int64_t bs, float *y,
                                                           int64_t out) {
    __m256 acc[NF4_TILE_OUT][NF4_TILE_X];
    for (int o = 0; o < no; o++)
        for (int j = 0; j < nj; j++) acc[o][j] = _mm256_setzero_ps();
    const int64_t nb = in / bs;
    for (int64_t i = 0, b = 0; i < nb; i++, b += bs) {
        __m256 blk[NF4_TILE_OUT][NF4_TILE_X];
        for (int o = 0; o < no; o++)
            for (int j = 0; j < nj; j++) blk[o][j] = _mm256_setzero_ps();
        for (int64_t k = b; k < b + bs; k += 8) {
            __m256 xv[NF4_TILE_X];
            for (int j = 0; j < nj; j++) xv[j] = _mm256_load_ps(xp + j * in + k);
            for (int o = 0; o < no; o++) {
                __m256 wv = _mm256_load_ps(w + o * in + k);
                for (int j = 0; j < nj; j++) blk[o][j] = _mm256_fmadd_ps(wv, xv[j], blk[o][j]);
            }
        }
        for (int o = 0; o < no; o++) {
            __m256 s = _mm256_broadcast_ss(absmax + o * nb + i);
            for (int j = 0; j < nj; j++) acc[o][j] = _mm256_fmadd_ps(blk[o][j], s, acc[o][j]);
        }
    }
    for (int o = 0; o < no; o++)
        for (int j = 0; j < nj; j++) y[j * out + o] = hsum(acc[o][j]);
}

// all n input rows against no (<= NF4_TILE_OUT) decoded weight rows; constant tile shapes
__attribute__((noinline)) static void nf4_rows(int no, const float *w, const float *absmax,
                                               const float *xp, int64_t n, int64_t in,
                                               int64_t bs, float *y, int64_t out) {
    for (int64_t j = 0; j < n; j += NF4_TILE_X) {
        int nj = n - j < NF4_TILE_X ? (int)(n - j) : NF4_TILE_X;
#define NF4_TILE(NO, NJ) \
    case NO * 4 + NJ: nf4_tile(NO, NJ, w, absmax, xp + j * in, in, bs, y + j * out, out); break;
        switch (no * 4 + nj) {
            NF4_TILE(1, 1) NF4_TILE(1, 2) NF4_TILE(1, 3)
            NF4_TILE(2, 1) NF4_TILE(2, 2) NF4_TILE(2, 3)
            NF4_TILE(3, 1) NF4_TILE(3, 2) NF4_TILE(3, 3)
        }
#undef NF4_TILE
    }
}

void nf4_matmul(const float *x, int64_t n, int64_t in, const uint8_t *codes,
                const float *absmax, int64_t blocksize, const float *table, float *y,
                int64_t out, int threads) {
    if (blocksize <= 0 || blocksize % 32) blocksize = 0;  // no block size it takes: NaN
    if (!sizes_ok(n, in, out, blocksize, MAX_IN, y)) return;
    uint8_t bytes[4][16];
    for (int c = 0; c < 16; c++) {
        uint32_t u;
        memcpy(&u, table + c, 4);
        for (int p = 0; p < 4; p++) bytes[p][c] = (uint8_t)(u >> (8 * p));
    }
    nf4_planes t = {_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes[0])),
                    _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes[1])),
                    _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes[2])),
                    _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes[3]))};
    float *xp = aligned_alloc(32, (size_t)(n * in) * sizeof(float));
    if (!xp) {  // no memory: say so in the output rather than return stale values
        for (int64_t i = 0; i < n * out; i++) y[i] = __builtin_nanf("");
        return;
    }
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // nf4_lane_code
    for (int64_t k = 0; k < n * in; k += 8)
        _mm256_store_ps(xp + k, _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + k), order));
    if (n <= 2) {
        const int R = n == 1 ? NF4_FUSED_ROWS : 2;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t o0 = 0; o0 < out; o0 += R) {
            const uint8_t *c = codes + o0 * in / 2;
            const float *a = absmax + o0 * in / blocksize;
            if (out - o0 >= R && n == 1)
                nf4_fused(NF4_FUSED_ROWS, 1, c, a, in, blocksize, t, xp, y + o0, out);
            else if (out - o0 >= R)
                nf4_fused(2, 2, c, a, in, blocksize, t, xp, y + o0, out);
            else
                for (int64_t r = 0; r < out - o0; r++)
                    for (int64_t j = 0; j < n; j++)
                        nf4_fused(1, 1, c + r * in / 2, a + r * in / blocksize, in, blocksize, t,
                                  xp + j * in, y + j * out + o0 + r, out);
        }
    } else if (n <= NF4_FUSED_X) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t o0 = 0; o0 < out; o0 += 2) {
            const uint8_t *c = codes + o0 * in / 2;
            const float *a = absmax + o0 * in / blocksize;
            nf4_fused_call(out - o0 >= 2 ? 2 : 1, (int)n, c, a, in, blocksize, t, xp, y + o0, out);
        }
    } else {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t o0 = 0; o0 < out; o0 += NF4_TILE_OUT) {
            float w[NF4_TILE_OUT * MAX_IN] __attribute__((aligned(32)));
            int no = out - o0 < NF4_TILE_OUT ? (int)(out - o0) : NF4_TILE_OUT;
            for (int64_t e = 0; e < no * in; e += 32)
                nf4_decode32(codes + (o0 * in + e) / 2, t, (__m256 *)(w + e));
            nf4_rows(no, w, absmax + o0 * in / blocksize, xp, n, in, blocksize, y + o0, out);
        }
    }
    free(xp);
}
#endif  // SPECCHAT_SIMD

// ---- `nf4_matmul` 16 lanes wide, for CPUs with AVX-512 ------------------------------------------
// AVX-512 holds the 16 NF4 values in one register, and `vpermps` looks 16 codes up at once: 32
// codes (16 bytes) cost two nibble extractions, two widenings and two lookups, against 13
// shuffles 8 wide. The lookup is into the table already multiplied by the block's scale (one
// multiply per block and weight row): table[code] * absmax_b is the same float whichever is
// done first. Other arithmetic than the 8-wide kernel's, so other bits; a process takes one
// of the two for every row count (the "avx512" variant this one, kernels.py), so a row's result
// is the same bits alone or among others:
//
// y[j, o] = `sum_lanes16`(acc), acc = fma(w, xp, acc) over the row in order, 16 lanes wide, with
// w = table[code] * absmax_b (one float32 multiply per weight: the block's scale applied to each
// dequantized weight, as bitsandbytes' dequantization does), and the codes of each group of 32
// taken even ones first: lane l takes code 32g + 2l, then code 32g + 2l + 1. So x is permuted
// once per call the same way (the 16 even inputs of each 32, then the 16 odd ones).
//
// The reference: that arithmetic for one (o, j) at a time.
void nf4_matmul16_ref(const float *x, int64_t n, int64_t in, const uint8_t *codes,
                      const float *absmax, int64_t blocksize, const float *table, float *y,
                      int64_t out, int threads) {
    if (blocksize <= 0 || blocksize % 32) blocksize = 0;  // no block size it takes: NaN
    if (!sizes_ok(n, in, out, blocksize, 0, y)) return;
    const int64_t nb = in / blocksize;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < out; o++) {
        const uint8_t *c = codes + o * in / 2;
        for (int64_t j = 0; j < n; j++) {
            const float *xj = x + j * in;
            float acc[16] = {0};
            for (int64_t k = 0; k < in; k += 32) {
                const float s = absmax[o * nb + k / blocksize];
                for (int half = 0; half < 2; half++)  // the even codes, then the odd ones
                    for (int l = 0; l < 16; l++) {
                        const int64_t e = k + 2 * l + half;
                        const float w = table[half ? c[e / 2] & 15 : c[e / 2] >> 4] * s;
                        acc[l] = fmaf(w, xj[e], acc[l]);
                    }
            }
            y[j * out + o] = sum_lanes16(acc);
        }
    }
}

#if SPECCHAT_SIMD
#define NF4_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define NF4_R16 4  // most weight rows of a tile (for one or two input rows)
#define NF4_J16 8  // most input rows of a tile

NF4_512 static inline float nf4_hsum16(__m512 v) {  // `sum_lanes16`'s order
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    return hsum(h);
}

// R weight rows (codes, absmax from the first) against J permuted input rows xp (stride in):
// each group of 32 codes decoded once in registers, for every input row.
NF4_512 static inline __attribute__((always_inline)) void nf4_tile16(
    int R, int J, const uint8_t *codes, const float *absmax, int64_t in, int64_t bs,
    __m512 table, const float *xp, float *y, int64_t out) {
    __m512 acc[NF4_R16][NF4_J16];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();
    const int64_t nb = in / bs;
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t i = 0, b = 0; i < nb; i++, b += bs) {
        __m512 ts[NF4_R16];  // the table times the block's scale: table[code] * absmax_b
        for (int r = 0; r < R; r++) {          // looked up, the same bits as multiplied after
            ts[r] = _mm512_mul_ps(table, _mm512_set1_ps(absmax[r * nb + i]));
            _mm_prefetch((const char *)codes + ((r * in + b) >> 1) + NF4_AHEAD, _MM_HINT_T0);
        }
        for (int64_t k = b; k < b + bs; k += 32)
            for (int r = 0; r < R; r++) {  // rows interleaved: independent chains
                const __m128i c = _mm_loadu_si128((const __m128i *)(codes + ((r * in + k) >> 1)));
                const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(c, 4), low));
                const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(c, low));
                const __m512 even = _mm512_permutexvar_ps(hi, ts[r]);
                const __m512 odd = _mm512_permutexvar_ps(lo, ts[r]);
                for (int j = 0; j < J; j++) {
                    const float *xj = xp + j * in + k;
                    acc[r][j] = _mm512_fmadd_ps(even, _mm512_load_ps(xj), acc[r][j]);
                    acc[r][j] = _mm512_fmadd_ps(odd, _mm512_load_ps(xj + 16), acc[r][j]);
                }
            }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) y[j * out + r] = nf4_hsum16(acc[r][j]);
}

typedef void (*nf4_tile16_fn)(const uint8_t *, const float *, int64_t, int64_t, __m512,
                              const float *, float *, int64_t);
// one function per tile shape: each keeps its accumulators in registers
#define NF4_TILE16_FN(RR, JJ)                                                                 \
    NF4_512 __attribute__((noinline)) static void nf4_tile16_##RR##_##JJ(                     \
        const uint8_t *codes, const float *absmax, int64_t in, int64_t bs, __m512 table,      \
        const float *xp, float *y, int64_t out) {                                             \
        nf4_tile16(RR, JJ, codes, absmax, in, bs, table, xp, y, out);                         \
    }
#define NF4_TILES16_J(JJ) \
    NF4_TILE16_FN(1, JJ) NF4_TILE16_FN(2, JJ) NF4_TILE16_FN(3, JJ) NF4_TILE16_FN(4, JJ)
NF4_TILES16_J(1) NF4_TILES16_J(2) NF4_TILES16_J(3) NF4_TILES16_J(4)
NF4_TILES16_J(5) NF4_TILES16_J(6) NF4_TILES16_J(7) NF4_TILES16_J(8)
#undef NF4_TILES16_J
#undef NF4_TILE16_FN
#define NF4_ROW16(JJ) \
    {nf4_tile16_1_##JJ, nf4_tile16_2_##JJ, nf4_tile16_3_##JJ, nf4_tile16_4_##JJ}
static const nf4_tile16_fn nf4_tiles16[NF4_J16][NF4_R16] = {
    NF4_ROW16(1), NF4_ROW16(2), NF4_ROW16(3), NF4_ROW16(4),
    NF4_ROW16(5), NF4_ROW16(6), NF4_ROW16(7), NF4_ROW16(8)};
#undef NF4_ROW16

// weight rows per tile for J input rows: accumulators and the decoded rows within 32 registers
static inline int nf4_rows16(int J) { return J <= 2 ? 4 : J <= 4 ? 3 : 2; }

NF4_512 void nf4_matmul_avx512(const float *x, int64_t n, int64_t in, const uint8_t *codes,
                               const float *absmax, int64_t blocksize, const float *table,
                               float *y, int64_t out, int threads) {
    if (blocksize <= 0 || blocksize % 32) blocksize = 0;  // no block size it takes: NaN
    if (!sizes_ok(n, in, out, blocksize, 0, y)) return;
    const __m512 t = _mm512_loadu_ps(table);
    float *xp = aligned_alloc(64, (size_t)(n * in) * sizeof(float));
    if (!xp) {  // no memory: say so in the output rather than return stale values
        for (int64_t i = 0; i < n * out; i++) y[i] = __builtin_nanf("");
        return;
    }
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t k = 0; k < n * in; k += 32) {
        const __m512 a = _mm512_loadu_ps(x + k), b = _mm512_loadu_ps(x + k + 16);
        _mm512_store_ps(xp + k, _mm512_permutex2var_ps(a, even, b));
        _mm512_store_ps(xp + k + 16, _mm512_permutex2var_ps(a, odd, b));
    }
    // input rows in as few tiles as fit, of sizes as equal as can be (11: 6, 5)
    const int64_t tiles = (n + NF4_J16 - 1) / NF4_J16, per = (n + tiles - 1) / tiles;
    const int R = nf4_rows16((int)per);
    const int64_t nb = in / blocksize;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o0 = 0; o0 < out; o0 += R) {
        const int no = out - o0 < R ? (int)(out - o0) : R;
        for (int64_t j = 0; j < n; j += per) {
            const int J = n - j < per ? (int)(n - j) : (int)per;
            nf4_tiles16[J - 1][no - 1](codes + o0 * in / 2, absmax + o0 * nb, in, blocksize, t,
                                       xp + j * in, y + j * out + o0, out);
        }
    }
    free(xp);
}
#undef NF4_512
#endif  // SPECCHAT_SIMD
