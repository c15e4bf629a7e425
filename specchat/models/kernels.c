// Products y[n, O] = x[n, I] @ W^T on x86 CPUs with AVX2 + FMA, for weights kept compact:
// bitsandbytes' NF4 (4-bit codes, a float scale per block), bf16 and GGUF's Q8_0; and the
// attention of a few query rows over the KV cache (`attend`, at the end). Compiled by
// specchat/models/kernels.py on first use; called through ctypes with torch tensors' pointers.
//
// Each output y[j, o] is computed by the same instructions in the same order whatever n is:
// W's row o is decoded to float32 (exactly the value bitsandbytes' dequantize gives), then
// dotted with x's row j in one 8-wide accumulator over the row in order (NF4: over each block,
// then scaled once per block), then summed in a fixed order. So a row's result is the same bits
// alone or among any number of rows, which is what keeps greedy speculative decoding identical
// to plain greedy decoding.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_IN 16384  // floats of one decoded weight row (on the stack, OUT_TILE of them)
#define OUT_TILE 4     // weight rows decoded and used together
#define X_TILE 2       // rows of x per pass over them

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
// accumulators stay in registers
static void rows(int no, const float *w, const float *x, int64_t n, int64_t in, float *y,
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

// NF4: two codes a byte, the first in the high nibble, each block of `blocksize` codes (within
// one row) scaled by its absmax. Requires in % blocksize == 0 and blocksize % 32 == 0.
//
// The decoding is what bounds one or two rows: AVX2 has no 16-entry float lookup, and the
// shuffle units that do lookups are few. So a table value is looked up a byte at a time: the
// 16 values' bytes form four 16-byte tables (`nf4_planes`), one vpshufb each gives a byte of
// 32 values, and four unpacks interleave them into floats (`nf4_decode32`). That is 13 shuffles
// per 32 codes, and no stack round trip for one or two rows.
//
// y[j, o] = hsum over the row of acc, acc = fma(blk_b, absmax_b, acc) over the blocks b in
// order, blk_b = table[code] * x in one 8-wide accumulator over the block in order. The codes,
// the table and the scales are bitsandbytes' own, read exactly; applying each block's scale to
// the block's sum instead of to each weight changes only the rounding. The unpacks leave
// the 8 floats of each group of 8 codes in the order 0, 2, 4, 6, 1, 3, 5, 7, so x is permuted
// the same way once per call. Every path (1 row, 2 rows, more) runs those operations in that
// order, so a row's result is the same bits alone or among any number of rows.
#define NF4_FUSED_ROWS 3  // weight rows decoded in registers together for one input row
#define NF4_TILE_OUT 3    // weight rows decoded into a buffer for 3 or more input rows
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
// in), decoding in registers: for one or two input rows.
static inline __attribute__((always_inline)) void nf4_fused(int R, int J, const uint8_t *codes,
                                                            const float *absmax, int64_t in,
                                                            int64_t bs, nf4_planes t,
                                                            const float *xp, float *y,
                                                            int64_t out) {
    __m256 acc[NF4_FUSED_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r][j] = _mm256_setzero_ps();
    const int64_t nb = in / bs;
    for (int64_t i = 0, b = 0; i < nb; i++, b += bs) {
        __m256 blk[NF4_FUSED_ROWS][2];
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
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
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

// bf16 weights [out, in]. Requires in % 8 == 0.
void bf16_matmul(const float *x, int64_t n, int64_t in, const uint16_t *weight, float *y,
                 int64_t out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o0 = 0; o0 < out; o0 += OUT_TILE) {
        float w[OUT_TILE * MAX_IN] __attribute__((aligned(32)));
        int no = out - o0 < OUT_TILE ? (int)(out - o0) : OUT_TILE;
        for (int64_t c = 0; c < no * in; c += 8) {
            __m256i v = _mm256_cvtepu16_epi32(
                _mm_loadu_si128((const __m128i *)(weight + o0 * in + c)));
            _mm256_store_ps(w + c, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        }
        rows(no, w, x, n, in, y + o0, out);
    }
}

int max_in(void) { return MAX_IN; }

// GGUF Q8_0 weights [out, in] as int8 values q and one fp16 scale d per 32 values (the file's,
// widened exactly in registers): W = q * d, which float32 holds exactly (a 7-bit integer times
// an 11-bit mantissa). Half the bytes of bf16. Requires in % 32 == 0.
//
// y[j, o] = hsum(acc), acc = fma(q * d, x[j], acc) over the row in order, 8 wide, as for the
// other weights. One input row streams the weights (memory bounds it); from two rows on, the FMAs
// bound it, so a few weight rows are decoded in registers and dotted with tiles of up to
// Q8_TILE_X input rows at once (8 or 10 accumulators), no buffer in between. Both paths do the
// same arithmetic in the same order for each (o, j).
#define Q8_TILE_X 5

static inline __attribute__((always_inline)) __m256 q8_decode8(const int8_t *q, __m256 scale) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                             _mm_loadl_epi64((const __m128i *)q))), scale);
}

// R weight rows from q / d (row stride in, in / 32) against J input rows of x (stride in)
static inline __attribute__((always_inline)) void q8_tile(int R, int J, const int8_t *q,
                                                          const uint16_t *d, const float *x,
                                                          int64_t in, float *y, int64_t out) {
    __m256 acc[4][Q8_TILE_X];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < in; b += 32) {
        __m256 scale[4];
        for (int r = 0; r < R; r++) scale[r] = _mm256_set1_ps(_cvtsh_ss(d[r * (in / 32) + b / 32]));
        for (int64_t k = b; k < b + 32; k += 8) {
            __m256 w[4];
            for (int r = 0; r < R; r++) w[r] = q8_decode8(q + r * in + k, scale[r]);
            for (int j = 0; j < J; j++) {
                const __m256 xv = _mm256_loadu_ps(x + j * in + k);
                for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(w[r], xv, acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) y[j * out + r] = hsum(acc[r][j]);
}

// The same products 16 wide (`q8_0_matmul_avx512`), for CPUs with AVX-512: twice the FMA
// width and 32 registers. One 16-wide accumulator per (o, j) over the row in order, then a fixed
// reduction: other bits than the 8-wide kernel's, so a process uses one of the two for every
// row count (kernels.py picks), and rows stay the same bits alone or among others.
#define Q8_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

Q8_512 static inline __attribute__((always_inline)) __m512 q8_decode16(const int8_t *q,
                                                                        __m512 scale) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                             _mm_loadu_si128((const __m128i *)q))), scale);
}

Q8_512 static inline float hsum16(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

Q8_512 static inline __attribute__((always_inline)) void q8_tile16(int R, int J,
                                                                   const int8_t *q,
                                                                   const uint16_t *d,
                                                                   const float *x, int64_t in,
                                                                   float *y, int64_t out) {
    __m512 acc[4][Q8_TILE_X];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < in; b += 32) {
        __m512 scale[4];
        for (int r = 0; r < R; r++) scale[r] = _mm512_set1_ps(_cvtsh_ss(d[r * (in / 32) + b / 32]));
        for (int64_t k = b; k < b + 32; k += 16) {
            __m512 w[4];
            for (int r = 0; r < R; r++) w[r] = q8_decode16(q + r * in + k, scale[r]);
            for (int j = 0; j < J; j++) {
                const __m512 xv = _mm512_loadu_ps(x + j * in + k);
                for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(w[r], xv, acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) y[j * out + r] = hsum16(acc[r][j]);
}

// one function per tile shape: each keeps its accumulators in registers
#define Q8_TILE16_FN(RR, JJ)                                                                  \
    Q8_512 __attribute__((noinline)) static void q8_tile16_##RR##_##JJ(                       \
        const int8_t *q, const uint16_t *d, const float *x, int64_t in, float *y, int64_t out) { \
        q8_tile16(RR, JJ, q, d, x, in, y, out);                                               \
    }
Q8_TILE16_FN(1, 1) Q8_TILE16_FN(1, 2) Q8_TILE16_FN(1, 3) Q8_TILE16_FN(1, 4) Q8_TILE16_FN(1, 5)
Q8_TILE16_FN(2, 1) Q8_TILE16_FN(2, 2) Q8_TILE16_FN(2, 3) Q8_TILE16_FN(2, 4) Q8_TILE16_FN(2, 5)
Q8_TILE16_FN(3, 1) Q8_TILE16_FN(3, 2) Q8_TILE16_FN(3, 3) Q8_TILE16_FN(3, 4) Q8_TILE16_FN(3, 5)
Q8_TILE16_FN(4, 1) Q8_TILE16_FN(4, 2) Q8_TILE16_FN(4, 3) Q8_TILE16_FN(4, 4) Q8_TILE16_FN(4, 5)
#undef Q8_TILE16_FN

typedef void (*q8_tile_fn)(const int8_t *, const uint16_t *, const float *, int64_t, float *,
                           int64_t);
static const q8_tile_fn q8_tiles16[4][Q8_TILE_X] = {
    {q8_tile16_1_1, q8_tile16_1_2, q8_tile16_1_3, q8_tile16_1_4, q8_tile16_1_5},
    {q8_tile16_2_1, q8_tile16_2_2, q8_tile16_2_3, q8_tile16_2_4, q8_tile16_2_5},
    {q8_tile16_3_1, q8_tile16_3_2, q8_tile16_3_3, q8_tile16_3_4, q8_tile16_3_5},
    {q8_tile16_4_1, q8_tile16_4_2, q8_tile16_4_3, q8_tile16_4_4, q8_tile16_4_5}};

// 4 weight rows (32 registers: up to 4 x 5 accumulators) against tiles of up to 5 input rows,
// a block of Q8_BLOCK weight rows at a time: the block stays in cache for every tile after the
// first, and each tile writes whole cache lines of y.
#define Q8_BLOCK 64
Q8_512 void q8_0_matmul_avx512(const float *x, int64_t n, int64_t in, const int8_t *q,
                               const uint16_t *d, float *y, int64_t out, int threads) {
    const int64_t tiles = (n + Q8_TILE_X - 1) / Q8_TILE_X, per = (n + tiles - 1) / tiles;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b0 = 0; b0 < out; b0 += Q8_BLOCK) {
        const int64_t b1 = out - b0 < Q8_BLOCK ? out : b0 + Q8_BLOCK;
        for (int64_t j = 0; j < n; j += per) {
            const int J = n - j < per ? (int)(n - j) : (int)per;
            for (int64_t o0 = b0; o0 < b1; o0 += 4) {
                const int R = b1 - o0 >= 4 ? 4 : (int)(b1 - o0);
                q8_tiles16[R - 1][J - 1](q + o0 * in, d + o0 * (in / 32), x + j * in, in,
                                         y + j * out + o0, out);
            }
        }
    }
}

#define Q8_TILE8_FN(RR, JJ)                                                                   \
    __attribute__((noinline)) static void q8_tile8_##RR##_##JJ(                               \
        const int8_t *q, const uint16_t *d, const float *x, int64_t in, float *y, int64_t out) { \
        q8_tile(RR, JJ, q, d, x, in, y, out);                                                 \
    }
Q8_TILE8_FN(1, 1) Q8_TILE8_FN(1, 2) Q8_TILE8_FN(1, 3) Q8_TILE8_FN(1, 4) Q8_TILE8_FN(1, 5)
Q8_TILE8_FN(2, 1) Q8_TILE8_FN(2, 2) Q8_TILE8_FN(2, 3) Q8_TILE8_FN(2, 4) Q8_TILE8_FN(2, 5)
Q8_TILE8_FN(3, 2) Q8_TILE8_FN(4, 2)
#undef Q8_TILE8_FN

static const q8_tile_fn q8_tiles8[4][Q8_TILE_X] = {
    {q8_tile8_1_1, q8_tile8_1_2, q8_tile8_1_3, q8_tile8_1_4, q8_tile8_1_5},
    {q8_tile8_2_1, q8_tile8_2_2, q8_tile8_2_3, q8_tile8_2_4, q8_tile8_2_5},
    {0, q8_tile8_3_2, 0, 0, 0},  // a block's last rows when 4 are decoded together (n = 2)
    {0, q8_tile8_4_2, 0, 0, 0}};

void q8_0_matmul(const float *x, int64_t n, int64_t in, const int8_t *q, const uint16_t *d,
                 float *y, int64_t out, int threads) {
    if (n == 1) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t o0 = 0; o0 < out; o0 += OUT_TILE) {
            float w[OUT_TILE * MAX_IN] __attribute__((aligned(32)));
            int no = out - o0 < OUT_TILE ? (int)(out - o0) : OUT_TILE;
            for (int64_t c = 0; c < no * in; c += 32) {
                const __m256 scale = _mm256_set1_ps(_cvtsh_ss(d[(o0 * in + c) / 32]));
                for (int64_t e = c; e < c + 32; e += 8)
                    _mm256_store_ps(w + e, q8_decode8(q + o0 * in + e, scale));
            }
            rows(no, w, x, n, in, y + o0, out);
        }
        return;
    }
    const int64_t tiles = (n + Q8_TILE_X - 1) / Q8_TILE_X, per = (n + tiles - 1) / tiles;
    const int step = n == 2 ? 4 : 2;  // weight rows decoded together: 8 or 10 accumulators
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b0 = 0; b0 < out; b0 += Q8_BLOCK) {
        const int64_t b1 = out - b0 < Q8_BLOCK ? out : b0 + Q8_BLOCK;
        for (int64_t j = 0; j < n; j += per) {
            const int J = n - j < per ? (int)(n - j) : (int)per;
            for (int64_t o0 = b0; o0 < b1; o0 += step) {
                const int R = b1 - o0 >= step ? step : (int)(b1 - o0);
                q8_tiles8[R - 1][J - 1](q + o0 * in, d + o0 * (in / 32), x + j * in, in,
                                        y + j * out + o0, out);
            }
        }
    }
}

// 8 values of a key or value row, float32 or bf16 (widened exactly)
static inline __m256 load8(const void *row, int64_t c, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)row + c);
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// Attention of a few query rows against one key/value head: for each query row r,
// out[r] = sum_j p_j v_j / sum_j p_j over the slots j that mask row (r % mask_rows) allows,
// p_j = exp(s_j - max s), s_j = scale * (q[r] . k_j). q [rows, dim] float32 (the query heads
// of this key/value head, packed head by head), k and v [slots, dim] with row strides in
// elements, float32 or bf16; mask [mask_rows, slots] bytes (1: attend), row stride mstride;
// scores [rows, slots] scratch. Each row runs alone, in slot order, whatever the other rows:
// a row's output is the same bits among any number of rows. Requires dim % 8 == 0.
void attend(const float *q, int64_t rows, int64_t dim, const void *k, const void *v,
            int64_t slots, int64_t kstride, int64_t vstride, int bf16, const uint8_t *mask,
            int64_t mask_rows, int64_t mstride, float scale, float *scores, float *out,
            int threads) {
    const int64_t es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = q + r * dim;
        const uint8_t *allowed = mask + (r % mask_rows) * mstride;
        float *s = scores + r * slots, top = -__builtin_inff();
        for (int64_t j = 0; j < slots; j++) {
            if (!allowed[j]) continue;
            const char *kj = (const char *)k + j * kstride * es;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t c = 0; c < dim; c += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + c), load8(kj, c, bf16), acc);
            s[j] = hsum(acc) * scale;
            if (s[j] > top) top = s[j];
        }
        float total = 0.0f;
        for (int64_t j = 0; j < slots; j++)
            if (allowed[j]) total += s[j] = expf(s[j] - top);
        float *o = out + r * dim;
        for (int64_t c = 0; c < dim; c += 64) {  // 8 accumulators of 8 dims each
            int nv = dim - c >= 64 ? 8 : (int)(dim - c) / 8;
            __m256 acc[8];
            for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
            for (int64_t j = 0; j < slots; j++) {
                if (!allowed[j]) continue;
                const char *vj = (const char *)v + j * vstride * es;
                const __m256 p = _mm256_set1_ps(s[j]);
                if (nv == 8)
                    for (int u = 0; u < 8; u++)
                        acc[u] = _mm256_fmadd_ps(p, load8(vj, c + 8 * u, bf16), acc[u]);
                else
                    for (int u = 0; u < nv; u++)
                        acc[u] = _mm256_fmadd_ps(p, load8(vj, c + 8 * u, bf16), acc[u]);
            }
            const __m256 t = _mm256_set1_ps(total);
            for (int u = 0; u < nv; u++) _mm256_storeu_ps(o + c + 8 * u, _mm256_div_ps(acc[u], t));
        }
    }
}

static inline uint16_t to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// Gemma's RMSNorm over n rows of dim values, float32 or bf16 in and out:
// y = x * rsqrt(mean(x^2) + eps) * w1 in float32 (w1 = 1 + weight), rounded to bf16 for bf16.
// One thread, each row alone: a row's result is the same bits among any number of rows.
// Requires dim % 8 == 0.
void rms_norm(const void *x, int64_t n, int64_t dim, int bf16, const float *w1, float eps,
              void *y) {
    for (int64_t r = 0; r < n; r++) {
        const char *xr = (const char *)x + r * dim * (bf16 ? 2 : 4);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < dim; c += 8) {
            __m256 v = load8(xr, c, bf16);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const float scale = 1.0f / sqrtf(hsum(acc) / (float)dim + eps);
        for (int64_t c = 0; c < dim; c++) {
            float v;
            if (bf16) {
                uint32_t u = (uint32_t)((const uint16_t *)xr)[c] << 16;
                memcpy(&v, &u, 4);
            } else {
                v = ((const float *)xr)[c];
            }
            const float out = v * scale * w1[c];
            if (bf16)
                ((uint16_t *)y)[r * dim + c] = to_bf16(out);
            else
                ((float *)y)[r * dim + c] = out;
        }
    }
}
