// GGUF Q8_0 weights [out, in] as int8 values q and one fp16 scale d per 32 values (the file's,
// widened exactly in registers): W = q * d, which float32 holds exactly (a 7-bit integer times
// an 11-bit mantissa). Half the bytes of bf16. Requires in % 32 == 0.
//
// y[j, o] = hsum(acc), acc = fma(q * d, x[j], acc) over the row in order, 8 wide, as for the
// other weights. One input row streams the weights (memory bounds it); from two rows on, the FMAs
// bound it, so a few weight rows are decoded in registers and dotted with tiles of up to
// Q8_TILE_X input rows at once (8 or 10 accumulators), no buffer in between. Both paths do the
// same arithmetic in the same order for each (o, j).
//
// The same products 16 wide (`q8_0_matmul_avx512`), for CPUs with AVX-512: twice the FMA
// width and 32 registers. One 16-wide accumulator per (o, j) over the row in order, then a fixed
// reduction: other bits than the 8-wide kernel's, so a process uses one of the two for every
// row count (kernels.py picks), and rows stay the same bits alone or among others.
#include "common.h"

// The references: acc over the row `width` lanes wide (8: `q8_0_matmul`, 16:
// `q8_0_matmul_avx512`), then the kernel's horizontal sum.
static void q8_ref(int width, const float *x, int64_t n, int64_t in, const int8_t *q,
                   const uint16_t *d, float *y, int64_t out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < out; o++)
        for (int64_t j = 0; j < n; j++) {
            const int8_t *qo = q + o * in;
            const float *xj = x + j * in;
            float acc[16] = {0};
            for (int64_t k = 0; k < in; k += width) {
                const float scale = half_to_float(d[o * (in / 32) + k / 32]);
                for (int l = 0; l < width; l++)
                    acc[l] = fmaf((float)qo[k + l] * scale, xj[k + l], acc[l]);  // q * d: exact
            }
            y[j * out + o] = width == 16 ? sum_lanes16(acc) : sum_lanes8(acc);
        }
}

void q8_0_matmul_ref(const float *x, int64_t n, int64_t in, const int8_t *q, const uint16_t *d,
                     float *y, int64_t out, int threads) {
    if (!sizes_ok(n, in, out, 32, 0, y)) return;
    q8_ref(8, x, n, in, q, d, y, out, threads);
}

void q8_0_matmul16_ref(const float *x, int64_t n, int64_t in, const int8_t *q,
                       const uint16_t *d, float *y, int64_t out, int threads) {
    if (!sizes_ok(n, in, out, 32, 0, y)) return;
    q8_ref(16, x, n, in, q, d, y, out, threads);
}

#if SPECCHAT_SIMD
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
#define Q8_BLOCK HEAD_BLOCK  // (the block maxima's blocks: `block_maxima`)
Q8_512 void q8_0_matmul_avx512(const float *x, int64_t n, int64_t in, const int8_t *q,
                               const uint16_t *d, float *y, int64_t out, int threads) {
    if (!sizes_ok(n, in, out, 32, 0, y)) return;
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
    if (!sizes_ok(n, in, out, 32, MAX_IN, y)) return;
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
#endif  // SPECCHAT_SIMD

// ---- integer dot products: `q8_0_matmul_i8` ---------------------------------------------------
// The same product y = x @ (q * d)^T with the activations quantized too, as llama.cpp computes
// Q8_0 products (`quantize_row_q8_0` for x, then `ggml_vec_dot_q8_0_q8_0`): integer dot products
// of 32 int8 pairs per block, scaled once per block. Fewer instructions per weight than widening
// q to float, and other bits than `q8_0_matmul` (x is rounded to 8 bits per block first).
//
// 1. Each row of x is quantized once per call, per block of 32 values, as llama.cpp quantizes
//    activations to Q8_0 (but its scale dx kept in float32, not rounded to fp16):
//      amax = max |x|, dx = amax / 127.0f, id = dx != 0 ? 1.0f / dx : 0.0f,
//      qx = nearest-even rounding of x * id (|x * id| < 127.5, so qx in [-127, 127]).
//    Two cases llama.cpp leaves undefined are defined here: where 1 / dx overflows (amax below
//    about 3.7e-37), id = 0 (the block's qx are 0); where the block holds an infinity or a NaN,
//    qx = 0 and dx = NaN, so every output of that row is NaN. (amax is taken on the bits of |x|,
//    as integers, which orders non-negative floats as floats do and puts NaNs above all.)
// 2. For each (o, j): eight float lanes acc = 0; for each block b in order,
//      s[l] = sum of q[o, 32b + 4l + t] * qx[j, 32b + 4l + t] for t = 0..3 (int32, exact),
//      acc[l] = fmaf((float)s[l], dw * dx, acc[l])  (dw the fp16 scale widened exactly; one
//      float multiply, then one fused multiply-add; |s| <= 4 * 128 * 127, exact in float),
//    then y[j, o] = `sum_lanes8`(acc) (`hsum`'s order).
// The AVX2 kernel's lanes: vpmaddubsw of |q| (unsigned) with qx signed by q (the sign trick),
//    then vpmaddwd with ones, leave s[l] in int32 lane l. A weight byte of -128 is exact: its
//    |q| is 128 as an unsigned byte, and 128 * 127 + 127 * 127 = 32385 fits an int16 (no
//    saturation), because |qx| <= 127. (llama.cpp's Q8_0 files hold no -128; others may.)
// Integer sums are exact in any order, so every (o, j) gets the same bits whatever n, the tiling
// or the thread count: the kernel is row-exact. (Step 1 is `q8i_quantize_ref`, common.h.)

// The references of both widths: `width` 8 (`q8_0_matmul_i8`), or 16 (`q8_0_matmul_i8_avx512`,
// lanes 0-7 taking the even blocks and 8-15 the odd ones, then `sum_lanes16`). Written so that a
// compiler may run the lanes side by side (each lane's own sums in order, the same bits): the
// block's int16 products first, then each lane's sum of four and its fma.
static void q8i_ref(int width, const float *x, int64_t n, int64_t in, const int8_t *q,
                    const uint16_t *d, float *y, int64_t out, float *maxima, int threads) {
    const int64_t nb = in / 32, odd = width == 16;  // odd: the odd blocks take lanes 8-15
    int8_t *qx;
    float *dx;
    if (!q8i_buffers(n, in, &qx, &dx, y, out)) return;
    q8i_quantize_ref(x, n, in, qx, dx);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < out; o++) {
        const int8_t *qo = q + o * in;
        float scale[nb];
        for (int64_t b = 0; b < nb; b++) scale[b] = half_to_float(d[o * nb + b]);
        for (int64_t j = 0; j < n; j++) {
            const int8_t *xj = qx + j * in;
            float acc[16] = {0};
            for (int64_t b = 0; b < nb; b++) {
                const float f = scale[b] * dx[j * nb + b];
                float *lanes = acc + 8 * (b & odd);
                int16_t p[32];  // |q * x| <= 127 * 128: an int16
                int32_t s[8];
                for (int t = 0; t < 32; t++)
                    p[t] = (int16_t)((int16_t)qo[32 * b + t] * (int16_t)xj[32 * b + t]);
                for (int l = 0; l < 8; l++)
                    s[l] = ((int32_t)p[4 * l] + p[4 * l + 1]) + ((int32_t)p[4 * l + 2] + p[4 * l + 3]);
                for (int l = 0; l < 8; l++) lanes[l] = fmaf((float)s[l], f, lanes[l]);
            }
            y[j * out + o] = width == 16 ? sum_lanes16(acc) : sum_lanes8(acc);
        }
    }
    if (maxima) {
        const int64_t blocks = (out + HEAD_BLOCK - 1) / HEAD_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t b = 0; b < blocks; b++)
            block_maxima(y, n, out, b * HEAD_BLOCK,
                         out < (b + 1) * HEAD_BLOCK ? out : (b + 1) * HEAD_BLOCK, maxima, blocks);
    }
    free(qx);
    free(dx);
}

void q8_0_matmul_i8_ref(const float *x, int64_t n, int64_t in, const int8_t *q,
                        const uint16_t *d, float *y, int64_t out, float *maxima, int threads) {
    maxima_unknown(maxima, n, out);
    if (!sizes_ok(n, in, out, 32, 0, y)) return;
    q8i_ref(8, x, n, in, q, d, y, out, maxima, threads);
}

void q8_0_matmul_i8_16_ref(const float *x, int64_t n, int64_t in, const int8_t *q,
                           const uint16_t *d, float *y, int64_t out, float *maxima,
                           int threads) {
    maxima_unknown(maxima, n, out);
    if (!sizes_ok(n, in, out, 32, 0, y)) return;
    q8i_ref(16, x, n, in, q, d, y, out, maxima, threads);
}

#if SPECCHAT_SIMD
// Tiles: a tile takes one weight row against up to Q8I_J input rows (Q8I_J accumulators in
// registers), so up to Q8I_J rows cost one pass over the weights, each weight row loaded (and its
// |q| made) once for all of them; more rows go in tiles of as equal sizes as can be, a block of
// Q8_BLOCK weight rows at a time (it stays in cache for each tile of input rows). Measured on a
// Zen 3 core for 1 to 16 rows, it beats tiles of 2 weight rows x up to 5 input rows (two
// weight streams) and splitting 6 to 8 rows into two tiles. The AVX-512 kernels below take up
// to Q8I_R weight rows per tile, whole pairs of blocks without masks, a last odd block alone.
#define Q8I_R 2         // weight rows of an AVX-512 tile (the last of a block: 1)
#define Q8I_J 8         // most input rows of a tile
#define Q8I_AHEAD 2048  // bytes of weights prefetched ahead of each row

// x [n, in] -> qx, dx as `q8i_quantize_ref` does, 32 values at a time
static void q8i_quantize(const float *x, int64_t n, int64_t in, int8_t *qx, float *dx) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' lanes
    for (int64_t b = 0; b < n * in / 32; b++) {
        __m256 v[4];
        __m256i m = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
            m = _mm256_max_epi32(m, _mm256_and_si256(_mm256_castps_si256(v[i]), abs_mask));
        }
        __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
        h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
        float id;
        dx[b] = q8i_scale((uint32_t)_mm_cvtsi128_si32(h), &id);
        if (id == 0.0f) {
            _mm256_storeu_si256((__m256i *)(qx + 32 * b), _mm256_setzero_si256());
            continue;
        }
        const __m256 mul = _mm256_set1_ps(id);
        __m256i i32[4];
        for (int i = 0; i < 4; i++)
            i32[i] = _mm256_cvttps_epi32(_mm256_round_ps(
                _mm256_mul_ps(v[i], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]),
                                             _mm256_packs_epi32(i32[2], i32[3]));
        _mm256_storeu_si256((__m256i *)(qx + 32 * b), _mm256_permutevar8x32_epi32(p, order));
    }
}

// f[j * nb + b] = dw[b] * dx[j, b] (one float multiply each) for a weight row's scales d and J
// input rows' dx (stride nb), 8 blocks at a time: the last 8 end at the row's end (overlapping
// the previous 8 when nb % 8 != 0; the same values again), so no load reads past a row. Fewer
// than 8 blocks: one at a time.
static inline __attribute__((always_inline)) void q8i_factors(int J, const uint16_t *d,
                                                              const float *dx, int64_t nb,
                                                              float *f) {
    if (nb < 8) {
        for (int j = 0; j < J; j++)
            for (int64_t b = 0; b < nb; b++) f[j * nb + b] = _cvtsh_ss(d[b]) * dx[j * nb + b];
        return;
    }
    for (int64_t b = 0;; b += 8) {
        if (b > nb - 8) b = nb - 8;
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
        for (int j = 0; j < J; j++)
            _mm256_storeu_ps(f + j * nb + b, _mm256_mul_ps(dw, _mm256_loadu_ps(dx + j * nb + b)));
        if (b == nb - 8) break;
    }
}

// y[j * out] for one weight row q / d against J quantized input rows qx / dx (stride in, nb);
// f: room for the J * nb block factors dw * dx (`q8i_factors`), computed first, then broadcast
// from there.
static inline __attribute__((always_inline)) void q8i_tile(int J, const int8_t *q,
                                                           const uint16_t *d, const int8_t *qx,
                                                           const float *dx, float *f,
                                                           int64_t in, float *y, int64_t out) {
    const int64_t nb = in / 32;
    q8i_factors(J, d, dx, nb, f);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[Q8I_J];
    for (int j = 0; j < J; j++) acc[j] = _mm256_setzero_ps();
    int64_t b = 0;
    do {  // nb >= 1 (a for loop here leaves the accumulators stored to the stack each block)
        const int64_t k = 32 * b;
        _mm_prefetch((const char *)q + k + Q8I_AHEAD, _MM_HINT_T0);
        const __m256i w = _mm256_loadu_si256((const __m256i *)(q + k));
        const __m256i wa = _mm256_sign_epi8(w, w);  // |q|: -128 becomes 128 unsigned
        for (int j = 0; j < J; j++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + j * in + k));
            const __m256i p = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, w));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)),
                                     _mm256_broadcast_ss(f + j * nb + b), acc[j]);
        }
    } while (++b < nb);
    for (int j = 0; j < J; j++) y[j * out] = hsum(acc[j]);
}

#define Q8I_TILE_FN(JJ)                                                                       \
    __attribute__((noinline)) static void q8i_tile_##JJ(const int8_t *q, const uint16_t *d,   \
                                                        const int8_t *qx, const float *dx,    \
                                                        float *f, int64_t in, float *y,       \
                                                        int64_t out) {                        \
        q8i_tile(JJ, q, d, qx, dx, f, in, y, out);                                            \
    }
Q8I_TILE_FN(1) Q8I_TILE_FN(2) Q8I_TILE_FN(3) Q8I_TILE_FN(4)
Q8I_TILE_FN(5) Q8I_TILE_FN(6) Q8I_TILE_FN(7) Q8I_TILE_FN(8)
#undef Q8I_TILE_FN

typedef void (*q8i_tile_fn)(const int8_t *, const uint16_t *, const int8_t *, const float *,
                            float *, int64_t, float *, int64_t);
static const q8i_tile_fn q8i_tiles[Q8I_J] = {q8i_tile_1, q8i_tile_2, q8i_tile_3, q8i_tile_4,
                                             q8i_tile_5, q8i_tile_6, q8i_tile_7, q8i_tile_8};

void q8_0_matmul_i8(const float *x, int64_t n, int64_t in, const int8_t *q, const uint16_t *d,
                    float *y, int64_t out, float *maxima, int threads) {
    maxima_unknown(maxima, n, out);
    if (!sizes_ok(n, in, out, 32, 0, y)) return;
    if (in > MAX_IN) {  // the factors' buffer is on the stack: the reference's bits
        q8_0_matmul_i8_ref(x, n, in, q, d, y, out, maxima, threads);
        return;
    }
    const int64_t nb = in / 32;
    int8_t *qx;
    float *dx;
    if (!q8i_buffers(n, in, &qx, &dx, y, out)) return;
    q8i_quantize(x, n, in, qx, dx);
    // input rows in as few tiles as fit, of sizes as equal as can be (11: 6, 5)
    const int64_t tiles = (n + Q8I_J - 1) / Q8I_J, per = (n + tiles - 1) / tiles;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b0 = 0; b0 < out; b0 += Q8_BLOCK) {
        const int64_t b1 = out - b0 < Q8_BLOCK ? out : b0 + Q8_BLOCK;
        float f[Q8I_J * nb];
        for (int64_t j = 0; j < n; j += per) {
            const int J = n - j < per ? (int)(n - j) : (int)per;
            for (int64_t o = b0; o < b1; o++)
                q8i_tiles[J - 1](q + o * in, d + o * nb, qx + j * in, dx + j * nb, f, in,
                                 y + j * out + o, out);
        }
        if (maxima) block_maxima(y, n, out, b0, b1, maxima, (out + Q8_BLOCK - 1) / Q8_BLOCK);
    }
    free(qx);
    free(dx);
}

// ---- `q8_0_matmul_i8` 16 lanes wide, for CPUs with AVX-512 ----------------------------------
// One zmm holds a pair of blocks (64 bytes of a weight row): its 16 int32 lanes get the sums of
// 4 products, lanes 0-7 from the even block and 8-15 from the odd one, and the block factors
// dw * dx go to the same halves. Per pair and (weight row, input row): one integer dot product
// instruction, a conversion, a multiply and a fused multiply-add, a third of the AVX2 kernel's
// instructions per weight byte. Two ways to the same integers (exact, so the same bits):
// - VNNI (`vpdpbusd`, unsigned x signed bytes into int32 without saturation): qx + 128 as
//   unsigned bytes against q, starting from -128 * (the sum of q's 4 bytes), which cancels the
//   offset; the correction is one more `vpdpbusd` per weight row and pair, shared by every input
//   row;
// - AVX512BW without VNNI: `vpmaddubsw` of |q| with qx signed by q, then `vpmaddwd` with ones, the
//   AVX2 kernel's sign trick (AVX-512 has no `vpsignb`: qx is negated under q's sign mask).
// An odd last block goes alone into the low half, its high half masked off.
#define Q8I_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define Q8I_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define Q8I_J16 8  // most input rows of a tile

Q8I_512 static inline float hsum16_i8(__m512 v) {  // `sum_lanes16`'s order
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// xs: each input row's bytes as the tile takes them (VNNI: qx + 128 unsigned; else qx), dxs: each
// row's block scales as [dx_b x 8, dx_b+1 x 8] per pair (`q8i_prepare16`).
// One pair of blocks p for R weight rows and J input rows; PAIR 0: a last, odd block alone (the
// high half masked off), 1: a whole pair (no masks).
#define Q8I_PAIR16(VNNI, PAIR)                                                                \
    {                                                                                         \
        const int64_t b = 2 * p, k = 64 * p;                                                  \
        __m512i w[Q8I_R], wx[Q8I_R];                                                          \
        __mmask64 neg[Q8I_R];                                                                 \
        __m512 dw[Q8I_R];                                                                     \
        for (int r = 0; r < R; r++) {                                                         \
            _mm_prefetch((const char *)q + r * in + k + Q8I_AHEAD, _MM_HINT_T0);              \
            w[r] = PAIR ? _mm512_loadu_si512(q + r * in + k)                                  \
                        : _mm512_maskz_loadu_epi8((__mmask64)0xffffffffu, q + r * in + k);    \
            if (VNNI) {  /* -128 * (the sum of each lane's 4 weight bytes) */                 \
                wx[r] = _mm512_sub_epi32(_mm512_setzero_si512(),                              \
                                         _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset,  \
                                                             w[r]));                          \
            } else {                                                                          \
                neg[r] = _mm512_movepi8_mask(w[r]);                                           \
                wx[r] = _mm512_abs_epi8(w[r]); /* -128 becomes 128 unsigned */                \
            }                                                                                 \
            const __m128i h = _mm_maskz_loadu_epi16(PAIR ? 3 : 1, d + r * nb + b);            \
            dw[r] = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_cvtph_ps(h)));     \
        }                                                                                     \
        for (int j = 0; j < J; j++) {                                                         \
            const __m512i xv = _mm512_loadu_si512(xs + j * 64 * np + k);                      \
            const __m512 dxv = _mm512_loadu_ps(dxs + (j * np + p) * 16);                      \
            for (int r = 0; r < R; r++) {                                                     \
                __m512i s;                                                                    \
                if (VNNI)                                                                     \
                    s = _mm512_dpbusd_epi32(wx[r], xv, w[r]);                                 \
                else                                                                          \
                    s = _mm512_madd_epi16(                                                    \
                        _mm512_maddubs_epi16(wx[r], _mm512_mask_sub_epi8(                     \
                                                        xv, neg[r], _mm512_setzero_si512(), xv)), \
                        ones);                                                                \
                const __m512 f = _mm512_mul_ps(dw[r], dxv);                                   \
                acc[r][j] = PAIR ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), f, acc[r][j])       \
                                 : _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(s), f, acc[r][j], \
                                                         (__mmask16)0x00ff);                  \
            }                                                                                 \
        }                                                                                     \
    }

#define Q8I_TILE16_BODY(VNNI)                                                                 \
    const int64_t nb = in / 32, np = (nb + 1) / 2;                                            \
    const __m512i offset = _mm512_set1_epi8((char)0x80);                                      \
    const __m512i ones = _mm512_set1_epi16(1);                                                \
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);   \
    __m512 acc[Q8I_R][Q8I_J16];                                                               \
    for (int r = 0; r < R; r++)                                                               \
        for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();                          \
    int64_t p = 0;                                                                            \
    for (; p < nb / 2; p++) Q8I_PAIR16(VNNI, 1)                                               \
    if (nb % 2) Q8I_PAIR16(VNNI, 0)                                                           \
    for (int r = 0; r < R; r++)                                                               \
        for (int j = 0; j < J; j++) y[j * out + r] = hsum16_i8(acc[r][j]);

Q8I_512 static inline __attribute__((always_inline)) void q8i_tile16_bw(
    int R, int J, const int8_t *q, const uint16_t *d, const int8_t *xs, const float *dxs,
    int64_t in, float *y, int64_t out) {
    Q8I_TILE16_BODY(0)
}

Q8I_VNNI static inline __attribute__((always_inline)) void q8i_tile16_vnni(
    int R, int J, const int8_t *q, const uint16_t *d, const int8_t *xs, const float *dxs,
    int64_t in, float *y, int64_t out) {
    Q8I_TILE16_BODY(1)
}
#undef Q8I_TILE16_BODY
#undef Q8I_PAIR16

typedef void (*q8i16_tile_fn)(const int8_t *, const uint16_t *, const int8_t *, const float *,
                              int64_t, float *, int64_t);
#define Q8I_TILE16_FN(KIND, TARGET, RR, JJ)                                                   \
    TARGET __attribute__((noinline)) static void q8i_tile16_##KIND##_##RR##_##JJ(             \
        const int8_t *q, const uint16_t *d, const int8_t *qx, const float *dx, int64_t in,    \
        float *y, int64_t out) {                                                              \
        q8i_tile16_##KIND(RR, JJ, q, d, qx, dx, in, y, out);                                  \
    }
#define Q8I_ROWS16(KIND, TARGET, RR)                                                          \
    Q8I_TILE16_FN(KIND, TARGET, RR, 1) Q8I_TILE16_FN(KIND, TARGET, RR, 2)                     \
    Q8I_TILE16_FN(KIND, TARGET, RR, 3) Q8I_TILE16_FN(KIND, TARGET, RR, 4)                     \
    Q8I_TILE16_FN(KIND, TARGET, RR, 5) Q8I_TILE16_FN(KIND, TARGET, RR, 6)                     \
    Q8I_TILE16_FN(KIND, TARGET, RR, 7) Q8I_TILE16_FN(KIND, TARGET, RR, 8)
#define Q8I_TABLE_ROW(KIND, RR)                                                               \
    {q8i_tile16_##KIND##_##RR##_1, q8i_tile16_##KIND##_##RR##_2, q8i_tile16_##KIND##_##RR##_3, \
     q8i_tile16_##KIND##_##RR##_4, q8i_tile16_##KIND##_##RR##_5, q8i_tile16_##KIND##_##RR##_6, \
     q8i_tile16_##KIND##_##RR##_7, q8i_tile16_##KIND##_##RR##_8}
#define Q8I_TILES16(KIND, TARGET)                                                             \
    Q8I_ROWS16(KIND, TARGET, 1) Q8I_ROWS16(KIND, TARGET, 2)                                   \
    static const q8i16_tile_fn q8i_tiles16_##KIND[Q8I_R][Q8I_J16] = {                         \
        Q8I_TABLE_ROW(KIND, 1), Q8I_TABLE_ROW(KIND, 2)};
Q8I_TILES16(bw, Q8I_512)
Q8I_TILES16(vnni, Q8I_VNNI)
#undef Q8I_TILES16
#undef Q8I_TABLE_ROW
#undef Q8I_ROWS16
#undef Q8I_TILE16_FN

// The tiles' copies of the quantized rows: bytes in pairs of blocks, an odd row's last pair
// padded with zeros (VNNI: qx + 128 as unsigned bytes, the zeros of the padding included, which
// the weights' masked zeros cancel); scales as [dx_b x 8, dx_b+1 x 8] per pair (the padding 0).
static int q8i_prepare16(int64_t n, int64_t nb, int vnni, const int8_t *qx, const float *dx,
                         int8_t **xs, float **dxs) {
    const int64_t np = (nb + 1) / 2;
    *xs = malloc((size_t)(n * np * 64));
    *dxs = malloc((size_t)(n * np * 16) * sizeof(float));
    if (!*xs || !*dxs) return 0;
    for (int64_t j = 0; j < n; j++) {
        int8_t *row = *xs + j * np * 64;
        memset(row, 0, (size_t)(np * 64));
        memcpy(row, qx + j * nb * 32, (size_t)(nb * 32));
        if (vnni)
            for (int64_t t = 0; t < np * 64; t++) row[t] = (int8_t)((uint8_t)row[t] ^ 0x80u);
        for (int64_t b = 0; b < 2 * np; b++)
            for (int l = 0; l < 8; l++)
                (*dxs)[(j * np + b / 2) * 16 + 8 * (b & 1) + l] = b < nb ? dx[j * nb + b] : 0.0f;
    }
    return 1;
}

// Tiles of up to Q8I_R weight rows x Q8I_J16 input rows of `tiles`, a block of Q8_BLOCK weight
// rows at a time.
static void q8i_matmul16(const q8i16_tile_fn tiles[Q8I_R][Q8I_J16], int vnni, const float *x,
                         int64_t n, int64_t in, const int8_t *q, const uint16_t *d, float *y,
                         int64_t out, float *maxima, int threads) {
    int8_t *xs = NULL;
    maxima_unknown(maxima, n, out);
    float *dxs = NULL;
    if (!sizes_ok(n, in, out, 32, 0, y)) return;
    const int64_t nb = in / 32;
    int8_t *qx;
    float *dx;
    if (!q8i_buffers(n, in, &qx, &dx, y, out)) return;
    q8i_quantize(x, n, in, qx, dx);
    if (!q8i_prepare16(n, nb, vnni, qx, dx, &xs, &dxs)) {  // no memory: NaN, as above
        for (int64_t i = 0; i < n * out; i++) y[i] = __builtin_nanf("");
        free(qx);
        free(dx);
        free(xs);
        free(dxs);
        return;
    }
    const int64_t np = (nb + 1) / 2;
    const int64_t count = (n + Q8I_J16 - 1) / Q8I_J16, per = (n + count - 1) / count;
    // two weight rows a tile: 10-25% faster than one for 1 to 8 rows (an AVX-512 + VNNI Xeon)
    const int step = Q8I_R;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b0 = 0; b0 < out; b0 += Q8_BLOCK) {
        const int64_t b1 = out - b0 < Q8_BLOCK ? out : b0 + Q8_BLOCK;
        for (int64_t j = 0; j < n; j += per) {
            const int J = n - j < per ? (int)(n - j) : (int)per;
            for (int64_t o0 = b0; o0 < b1; o0 += step) {
                const int R = b1 - o0 >= step ? step : (int)(b1 - o0);
                tiles[R - 1][J - 1](q + o0 * in, d + o0 * nb, xs + j * 64 * np,
                                    dxs + j * np * 16, in, y + j * out + o0, out);
            }
        }
        if (maxima) block_maxima(y, n, out, b0, b1, maxima, (out + Q8_BLOCK - 1) / Q8_BLOCK);
    }
    free(qx);
    free(dx);
    free(xs);
    free(dxs);
}

void q8_0_matmul_i8_avx512(const float *x, int64_t n, int64_t in, const int8_t *q,
                           const uint16_t *d, float *y, int64_t out, float *maxima,
                           int threads) {
    q8i_matmul16(q8i_tiles16_bw, 0, x, n, in, q, d, y, out, maxima, threads);
}

void q8_0_matmul_i8_vnni(const float *x, int64_t n, int64_t in, const int8_t *q,
                         const uint16_t *d, float *y, int64_t out, float *maxima,
                         int threads) {
    q8i_matmul16(q8i_tiles16_vnni, 1, x, n, in, q, d, y, out, maxima, threads);
}
#endif  // SPECCHAT_SIMD

// ---- an LM head's logits past `upto` --------------------------------------------------------
// After a head product of n rows that computed the first `computed` of `out` logits a row:
// logits upto.. set to -inf (ids never sampled), and the block maxima (stride: out's blocks)
// made those of the cut rows: -inf for the blocks wholly past `upto`, and the block `upto`
// falls in taken again over its logits before `upto`, where the product computed past it. What
// `kernels.q8_0_matmul_i8` did in torch calls, in one call.
void logits_cut_ref(float *y, int64_t n, int64_t out, int64_t upto, int64_t computed,
                    float *maxima) {
    if (upto < 0) upto = 0;
    if (upto >= out) return;
    const int64_t stride = (out + HEAD_BLOCK - 1) / HEAD_BLOCK;
    for (int64_t j = 0; j < n; j++)
        for (int64_t o = upto; o < out; o++) y[j * out + o] = -INFINITY;
    if (!maxima) return;
    for (int64_t j = 0; j < n; j++)
        for (int64_t b = (upto + HEAD_BLOCK - 1) / HEAD_BLOCK; b < stride; b++)
            maxima[j * stride + b] = -INFINITY;
    if (upto % HEAD_BLOCK && upto < computed) {
        const int64_t b0 = upto / HEAD_BLOCK * HEAD_BLOCK;
        block_maxima(y, n, out, b0, upto, maxima, stride);
    }
}

#if SPECCHAT_SIMD
void logits_cut(float *y, int64_t n, int64_t out, int64_t upto, int64_t computed,
                float *maxima) {
    logits_cut_ref(y, n, out, upto, computed, maxima);
}
#endif

// The block maxima of n rows of `out` logits already computed (`block_maxima`, stride: out's
// blocks), for a head whose product does not write them as it goes (the NF4 head of a draft
// model: `kernels.nf4_head_matmul_i8`). Max is exact: every build gives the same values.
void logits_maxima(const float *y, int64_t n, int64_t out, float *maxima, int threads) {
    const int64_t stride = (out + HEAD_BLOCK - 1) / HEAD_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < stride; b++) {
        const int64_t b0 = b * HEAD_BLOCK, b1 = out - b0 < HEAD_BLOCK ? out : b0 + HEAD_BLOCK;
        block_maxima(y, n, out, b0, b1, maxima, stride);
    }
}

// count logits soft-capped in place, cap tanh(y / cap) (`softcap_of`: Gemma 2's final logits),
// each value alone; -inf (an id never sampled, `logits_cut`) stays -inf.
void logits_softcap(float *y, int64_t count, float cap, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < count; i++)
        if (y[i] != -INFINITY) y[i] = softcap_of(y[i], cap);
}
