// GGUF Q6_K weights [out, in] by integer dot products: the LM head of most Q4_K_M, Q5_K_M, Q6_K
// and Q4_0 files (llama-quantize writes their head in Q6_K), read in its own 6.56 bits a weight
// where a Q8_0 copy of it reads 8.5. Requires in % 256 == 0 and out % 16 == 0.
//
// The file's rows: superblocks of 256 values, 210 bytes each (ggml's `block_q6_K`): ql[128] (low
// 4 bits), qh[64] (high 2 bits), scales[16] (int8, one per 16 values), d (fp16). Value v of a
// superblock, in its half h = v / 128 (r = v % 128, l = r % 32):
//   q = (ql[64 h + 32 ((r / 32) & 1) + l] >> 4 (r / 64)) & 15
//     | ((qh[32 h + l] >> (4 (r / 64) + 2 ((r / 32) & 1))) & 3) << 4        (0..63)
//   w = (d * scales[v / 16]) * (q - 32)     (d * scale is exact in float32)
//
// `q6_k_pack` repacks them at load, the same bytes in another order, 16 weight rows a group, so
// that a vector's lanes are weight rows (as the NF4 integer kernels' are, nf4_i8.c): a group's
// superblock is 3360 bytes (16 x 210):
//   for each sub-block t of 16 values: 128 bytes of low bits, then 64 of high bits (192 bytes);
//     "quad" k (0..3) of the sub-block is its values 4k..4k+3 of the 16 rows: position
//     p = 4 row + m (m = 0..3) of 64; byte p of low-bits part k / 2 holds position p of quad k
//     in its low nibble (k even) or its high nibble (k odd), and byte p of the high bits holds
//     quad k's 2 bits at bits 2k, 2k + 1;
//   then the scales, [16 sub-blocks][16 rows] int8, then d, [16 rows] fp16.
// A quad is then one vector of 64 bytes: 16 rows x 4 values (AVX2: 8 rows, two halves).
//
// The arithmetic, for each weight row o and input row j (row-exact: a row's logits are the same
// bits alone or among any number of rows; and every kernel, 8 or 16 lanes wide, gives the
// reference's bits, a lane being a weight row):
// 1. x's row quantized once per call to int8 per block of 32 (`q8i_quantize_ref`, the Q8_0
//    head's activations), and c[t] = -32 * (the sum of qx over each sub-block t), int32.
// 2. acc = 0.0f; for each sub-block t of the row, in order:
//      s = c[t] + (the sum of q * qx over its 16 values)   (= (q - 32) . qx, exact in int32)
//      acc = fmaf((float)s, (d * scale) * dx, acc)           (x's block's dx)
//    y[j, o] = acc.
// The kernels' integer sums: VNNI's `vpdpbusd` (unsigned q x signed qx, 4 products a lane), or
// `vpmaddubsw` (|pairs| <= 2 * 63 * 127, no int16 saturation) then `vpmaddwd` with ones: the
// same integers, so the same bits.
#include "common.h"

#define Q6_SUPER 256   // values of a superblock
#define Q6_BYTES 210   // its bytes in the file
#define Q6_ROWS 16     // weight rows of a packed group
#define Q6_SUB 192     // packed bytes of a group's sub-block: 128 low bits, 64 high bits
#define Q6_GROUP (Q6_ROWS * Q6_BYTES)  // packed bytes of a group's superblock (3360)
#define Q6_BLOCK HEAD_BLOCK            // weight rows a thread takes at a time (the maxima's)

static inline int q6_value(const uint8_t *sb, int v) {  // 0..63, from a superblock of the file
    const int h = v / 128, r = v % 128, nibble = r / 64, upper = (r / 32) & 1, l = r % 32;
    const int ql = sb[64 * h + 32 * upper + l], qh = sb[128 + 32 * h + l];
    return ((ql >> (4 * nibble)) & 15) | ((qh >> (4 * nibble + 2 * upper)) & 3) << 4;
}

// The file's rows [out, in / 256 * 210] -> `packed`, room for out rounded up to whole groups
// (the rows past out zero, never written out by the kernels): -1 for other sizes.
int q6_k_pack(const uint8_t *rows, int64_t out, int64_t in, uint8_t *packed) {
    if (out <= 0 || in <= 0 || in % Q6_SUPER) return -1;
    const int64_t supers = in / Q6_SUPER, row = supers * Q6_BYTES;
    for (int64_t g = 0; g < (out + Q6_ROWS - 1) / Q6_ROWS; g++)
        for (int64_t s = 0; s < supers; s++) {
            uint8_t *dst = packed + (g * supers + s) * Q6_GROUP;
            memset(dst, 0, Q6_GROUP);
            for (int i = 0; i < Q6_ROWS && g * Q6_ROWS + i < out; i++) {
                const uint8_t *sb = rows + (g * Q6_ROWS + i) * row + s * Q6_BYTES;
                for (int v = 0; v < Q6_SUPER; v++) {
                    const int t = v / 16, k = v % 16 / 4, p = 4 * i + v % 4, q = q6_value(sb, v);
                    dst[t * Q6_SUB + 64 * (k / 2) + p] |= (uint8_t)((q & 15) << 4 * (k & 1));
                    dst[t * Q6_SUB + 128 + p] |= (uint8_t)((q >> 4) << 2 * k);
                }
                for (int t = 0; t < 16; t++) dst[Q6_SUB * 16 + 16 * t + i] = sb[192 + t];
                memcpy(dst + Q6_SUB * 16 + 256 + 2 * i, sb + 208, 2);
            }
        }
    return 0;
}

// value v (0..255) of row i of a packed group's superblock `g`, 0..63
static inline int q6_packed_value(const uint8_t *g, int i, int v) {
    const int t = v / 16, k = v % 16 / 4, p = 4 * i + v % 4;
    return ((g[t * Q6_SUB + 64 * (k / 2) + p] >> 4 * (k & 1)) & 15) |
           ((g[t * Q6_SUB + 128 + p] >> 2 * k) & 3) << 4;
}

static inline float q6_packed_scale(const uint8_t *g, int i, int t) {  // d * scale, exact
    uint16_t h;
    memcpy(&h, g + Q6_SUB * 16 + 256 + 2 * i, 2);
    return half_to_float(h) * (float)(int8_t)g[Q6_SUB * 16 + 16 * t + i];
}

// qx [n, in] and dx [n, in / 32] (`q8i_quantize_ref`) and c [n, in / 16]; 0 (y NaN) without the
// memory
static int q6_rows(const float *x, int64_t n, int64_t in, int8_t **qx, float **dx, int32_t **c,
                   float *y, int64_t out) {
    if (!q8i_buffers(n, in, qx, dx, y, out)) return 0;
    *c = malloc((size_t)(n * in / 16) * sizeof(int32_t));
    if (!*c) {
        for (int64_t i = 0; i < n * out; i++) y[i] = __builtin_nanf("");
        free(*qx), free(*dx);
        return 0;
    }
    q8i_quantize_ref(x, n, in, *qx, *dx);
    for (int64_t t = 0; t < n * in / 16; t++) {
        int32_t sum = 0;
        for (int m = 0; m < 16; m++) sum += (*qx)[16 * t + m];
        (*c)[t] = -32 * sum;
    }
    return 1;
}

static int q6_sizes_ok(int64_t n, int64_t in, int64_t out, float *y) {
    return sizes_ok(n, in, out, Q6_SUPER, 0, y);
}

void q6_k_matmul_i8_ref(const float *x, int64_t n, int64_t in, const uint8_t *packed, float *y,
                        int64_t out, float *maxima, int threads) {
    maxima_unknown(maxima, n, out);
    if (!q6_sizes_ok(n, in, out, y)) return;
    int8_t *qx;
    float *dx;
    int32_t *c;
    if (!q6_rows(x, n, in, &qx, &dx, &c, y, out)) return;
    const int64_t supers = in / Q6_SUPER;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < out; o++)
        for (int64_t j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int64_t s = 0; s < supers; s++) {
                const uint8_t *g = packed + (o / Q6_ROWS * supers + s) * Q6_GROUP;
                for (int t = 0; t < 16; t++) {
                    const int64_t v = s * Q6_SUPER + 16 * t;
                    int32_t sum = c[(j * in + v) / 16];
                    for (int m = 0; m < 16; m++)
                        sum += q6_packed_value(g, (int)(o % Q6_ROWS), 16 * t + m) *
                               qx[j * in + v + m];
                    const float f = q6_packed_scale(g, (int)(o % Q6_ROWS), t) *
                                    dx[(j * in + v) / 32];
                    acc = fmaf((float)sum, f, acc);
                }
            }
            y[j * out + o] = acc;
        }
    if (maxima) {
        const int64_t blocks = (out + HEAD_BLOCK - 1) / HEAD_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t b = 0; b < blocks; b++)
            block_maxima(y, n, out, b * HEAD_BLOCK,
                         out < (b + 1) * HEAD_BLOCK ? out : (b + 1) * HEAD_BLOCK, maxima, blocks);
    }
    free(qx), free(dx), free(c);
}

#if SPECCHAT_SIMD
// A tile: one group's 16 weight rows (AVX2: 8 of them, `half`) against J input rows, the
// group's superblocks in order; `rows` of the 16 are written (the last group of a one-row call
// that stops early, `upto`).
typedef void (*q6_tile_fn)(const uint8_t *g, int64_t supers, int half, const int8_t *qx,
                           const int32_t *c, const float *dx, int64_t in, float *y, int64_t out,
                           int rows);

static inline int32_t q6_quad(const int8_t *x) {  // 4 activation bytes as one int32
    int32_t v;
    memcpy(&v, x, 4);
    return v;
}

#define Q6_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define Q6_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define Q6_J16 12  // most input rows of an AVX-512 tile: 12 accumulators, 4 weight vectors, temps
#define Q6_J8 4    // of an AVX2 one (16 registers)

// ---- 16 lanes: AVX-512 (VNNI, or AVX512BW) ----------------------------------------------------
#define Q6_TILE16_BODY(VNNI)                                                                  \
    (void)half;                                                                               \
    const __m512i low4 = _mm512_set1_epi8(0x0f), high2 = _mm512_set1_epi8(0x30);              \
    const __m512i ones = _mm512_set1_epi16(1);                                                \
    __m512 acc[Q6_J16];                                                                       \
    for (int j = 0; j < J; j++) acc[j] = _mm512_setzero_ps();                                 \
    int64_t s = 0;                                                                            \
    do { /* supers >= 1 (a for loop here leaves the accumulators on the stack) */             \
        const uint8_t *gs = g + s * Q6_GROUP;                                                 \
        const __m512 d = _mm512_cvtph_ps(                                                     \
            _mm256_loadu_si256((const __m256i *)(gs + Q6_SUB * 16 + 256)));                   \
        for (int t = 0; t < 16; t++) {                                                        \
            const uint8_t *sub = gs + t * Q6_SUB;                                             \
            _mm_prefetch((const char *)sub + 4 * Q6_GROUP, _MM_HINT_T0);                      \
            _mm_prefetch((const char *)sub + 4 * Q6_GROUP + 64, _MM_HINT_T0);                 \
            _mm_prefetch((const char *)sub + 4 * Q6_GROUP + 128, _MM_HINT_T0);                \
            const __m512i n01 = _mm512_loadu_si512(sub), n23 = _mm512_loadu_si512(sub + 64);  \
            const __m512i hb = _mm512_loadu_si512(sub + 128);                                 \
            __m512i w[4]; /* quad k: lo | (its high bits moved to bits 4-5) */                \
            w[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(n01, low4),                     \
                                             _mm512_slli_epi16(hb, 4), high2, 0xF8);          \
            w[1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(n01, 4), low4), \
                                             _mm512_slli_epi16(hb, 2), high2, 0xF8);          \
            w[2] = _mm512_ternarylogic_epi32(_mm512_and_si512(n23, low4), hb, high2, 0xF8);   \
            w[3] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(n23, 4), low4), \
                                             _mm512_srli_epi16(hb, 2), high2, 0xF8);          \
            const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(           \
                _mm_loadu_si128((const __m128i *)(gs + Q6_SUB * 16 + 16 * t)))), d);           \
            const int64_t v = s * Q6_SUPER + 16 * t;                                          \
            for (int j = 0; j < J; j++) {                                                     \
                const int8_t *xj = qx + j * in + v;                                           \
                __m512i sum = _mm512_set1_epi32(c[(j * in + v) >> 4]);                        \
                for (int k = 0; k < 4; k++) {                                                 \
                    const __m512i xv = _mm512_set1_epi32(q6_quad(xj + 4 * k));                \
                    sum = VNNI ? _mm512_dpbusd_epi32(sum, w[k], xv)                           \
                               : _mm512_add_epi32(sum, _mm512_madd_epi16(                     \
                                                           _mm512_maddubs_epi16(w[k], xv), ones)); \
                }                                                                             \
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),                             \
                                         _mm512_mul_ps(f, _mm512_set1_ps(dx[(j * in + v) >> 5])), \
                                         acc[j]);                                             \
            }                                                                                 \
        }                                                                                     \
    } while (++s < supers);                                                                   \
    const __mmask16 keep = (__mmask16)((1u << rows) - 1);                                     \
    for (int j = 0; j < J; j++) _mm512_mask_storeu_ps(y + j * out, keep, acc[j]);

Q6_512 static inline __attribute__((always_inline)) void q6_tile16_bw(
    int J, const uint8_t *g, int64_t supers, int half, const int8_t *qx, const int32_t *c,
    const float *dx, int64_t in, float *y, int64_t out, int rows) {
    Q6_TILE16_BODY(0)
}

Q6_VNNI static inline __attribute__((always_inline)) void q6_tile16_vnni(
    int J, const uint8_t *g, int64_t supers, int half, const int8_t *qx, const int32_t *c,
    const float *dx, int64_t in, float *y, int64_t out, int rows) {
    Q6_TILE16_BODY(1)
}
#undef Q6_TILE16_BODY

// ---- 8 lanes: AVX2 (AVX-VNNI, or vpmaddubsw), rows 8 half .. 8 half + 7 of the group -----------
#define Q6_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

#define Q6_TILE8_BODY(DOT)                                                                    \
    const __m256i low4 = _mm256_set1_epi8(0x0f), high2 = _mm256_set1_epi8(0x30);              \
    const __m256i ones = _mm256_set1_epi16(1);                                                \
    (void)ones;                                                                               \
    __m256 acc[Q6_J8];                                                                        \
    for (int j = 0; j < J; j++) acc[j] = _mm256_setzero_ps();                                 \
    int64_t s = 0;                                                                            \
    do {                                                                                      \
        const uint8_t *gs = g + s * Q6_GROUP;                                                 \
        const __m256 d = _mm256_cvtph_ps(                                                     \
            _mm_loadu_si128((const __m128i *)(gs + Q6_SUB * 16 + 256 + 16 * half)));          \
        for (int t = 0; t < 16; t++) {                                                        \
            const uint8_t *sub = gs + t * Q6_SUB + 32 * half;                                 \
            _mm_prefetch((const char *)sub + 4 * Q6_GROUP, _MM_HINT_T0);                      \
            _mm_prefetch((const char *)sub + 4 * Q6_GROUP + 64, _MM_HINT_T0);                 \
            _mm_prefetch((const char *)sub + 4 * Q6_GROUP + 128, _MM_HINT_T0);                \
            const __m256i n01 = _mm256_loadu_si256((const __m256i *)sub);                     \
            const __m256i n23 = _mm256_loadu_si256((const __m256i *)(sub + 64));              \
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(sub + 128));              \
            __m256i w[4];                                                                     \
            w[0] = _mm256_or_si256(_mm256_and_si256(n01, low4),                               \
                                   _mm256_and_si256(_mm256_slli_epi16(hb, 4), high2));        \
            w[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n01, 4), low4),         \
                                   _mm256_and_si256(_mm256_slli_epi16(hb, 2), high2));        \
            w[2] = _mm256_or_si256(_mm256_and_si256(n23, low4), _mm256_and_si256(hb, high2)); \
            w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n23, 4), low4),         \
                                   _mm256_and_si256(_mm256_srli_epi16(hb, 2), high2));        \
            const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(           \
                _mm_loadl_epi64((const __m128i *)(gs + Q6_SUB * 16 + 16 * t + 8 * half)))),   \
                d);                                                                           \
            const int64_t v = s * Q6_SUPER + 16 * t;                                          \
            __m256i sum[Q6_J8];                                                               \
            for (int j = 0; j < J; j++) sum[j] = _mm256_set1_epi32(c[(j * in + v) >> 4]);     \
            for (int k = 0; k < 4; k++)                                                       \
                for (int j = 0; j < J; j++)                                                   \
                    sum[j] = DOT(sum[j], w[k],                                                \
                                 _mm256_set1_epi32(q6_quad(qx + j * in + v + 4 * k)));        \
            for (int j = 0; j < J; j++)                                                       \
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[j]),                          \
                                         _mm256_mul_ps(f, _mm256_set1_ps(dx[(j * in + v) >> 5])), \
                                         acc[j]);                                             \
        }                                                                                     \
    } while (++s < supers);                                                                   \
    if (rows >= 8) {                                                                          \
        for (int j = 0; j < J; j++) _mm256_storeu_ps(y + j * out, acc[j]);                    \
    } else {                                                                                  \
        for (int j = 0; j < J; j++) {                                                         \
            float lanes[8];                                                                   \
            _mm256_storeu_ps(lanes, acc[j]);                                                  \
            memcpy(y + j * out, lanes, (size_t)(rows > 0 ? rows : 0) * sizeof(float));        \
        }                                                                                     \
    }

#define Q6_MADDUBS(sum, w, xv) \
    _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones))
#define Q6_DPBUSD(sum, w, xv) _mm256_dpbusd_avx_epi32(sum, w, xv)

static inline __attribute__((always_inline)) void q6_tile8_avx2(
    int J, const uint8_t *g, int64_t supers, int half, const int8_t *qx, const int32_t *c,
    const float *dx, int64_t in, float *y, int64_t out, int rows) {
    Q6_TILE8_BODY(Q6_MADDUBS)
}

Q6_AVXVNNI static inline __attribute__((always_inline)) void q6_tile8_avxvnni(
    int J, const uint8_t *g, int64_t supers, int half, const int8_t *qx, const int32_t *c,
    const float *dx, int64_t in, float *y, int64_t out, int rows) {
    Q6_TILE8_BODY(Q6_DPBUSD)
}
#undef Q6_TILE8_BODY

// one function per tile height: each keeps its accumulators in registers
#define Q6_TILE_FN(KIND, TARGET, JJ)                                                          \
    TARGET __attribute__((noinline)) static void q6_tile_##KIND##_##JJ(                       \
        const uint8_t *g, int64_t supers, int half, const int8_t *qx, const int32_t *c,       \
        const float *dx, int64_t in, float *y, int64_t out, int rows) {                       \
        q6_tile##KIND(JJ, g, supers, half, qx, c, dx, in, y, out, rows);                      \
    }
#define Q6_TILES4(KIND, TARGET)                                                               \
    Q6_TILE_FN(KIND, TARGET, 1) Q6_TILE_FN(KIND, TARGET, 2) Q6_TILE_FN(KIND, TARGET, 3)       \
    Q6_TILE_FN(KIND, TARGET, 4)
#define Q6_TILES12(KIND, TARGET)                                                              \
    Q6_TILES4(KIND, TARGET) Q6_TILE_FN(KIND, TARGET, 5) Q6_TILE_FN(KIND, TARGET, 6)           \
    Q6_TILE_FN(KIND, TARGET, 7) Q6_TILE_FN(KIND, TARGET, 8) Q6_TILE_FN(KIND, TARGET, 9)       \
    Q6_TILE_FN(KIND, TARGET, 10) Q6_TILE_FN(KIND, TARGET, 11) Q6_TILE_FN(KIND, TARGET, 12)
#define Q6_LIST4(KIND) \
    q6_tile_##KIND##_1, q6_tile_##KIND##_2, q6_tile_##KIND##_3, q6_tile_##KIND##_4
#define Q6_LIST12(KIND)                                                                       \
    Q6_LIST4(KIND), q6_tile_##KIND##_5, q6_tile_##KIND##_6, q6_tile_##KIND##_7,               \
        q6_tile_##KIND##_8, q6_tile_##KIND##_9, q6_tile_##KIND##_10, q6_tile_##KIND##_11,     \
        q6_tile_##KIND##_12
Q6_TILES12(16_bw, Q6_512)
Q6_TILES12(16_vnni, Q6_VNNI)
Q6_TILES4(8_avx2, )
Q6_TILES4(8_avxvnni, Q6_AVXVNNI)
static const q6_tile_fn q6_tiles16_bw[Q6_J16] = {Q6_LIST12(16_bw)};
static const q6_tile_fn q6_tiles16_vnni[Q6_J16] = {Q6_LIST12(16_vnni)};
static const q6_tile_fn q6_tiles8_avx2[Q6_J8] = {Q6_LIST4(8_avx2)};
static const q6_tile_fn q6_tiles8_avxvnni[Q6_J8] = {Q6_LIST4(8_avxvnni)};
#undef Q6_LIST12
#undef Q6_LIST4
#undef Q6_TILES12
#undef Q6_TILES4
#undef Q6_TILE_FN

// Tiles of a group x up to `most` input rows, a block of Q6_BLOCK weight rows at a time (it
// stays in cache for every tile of input rows after the first), the block's maxima last.
// `lanes`: the weight rows of a tile (16, or 8: each group in two halves).
static void q6_matmul(const q6_tile_fn *tiles, int most, int lanes, const float *x, int64_t n,
                      int64_t in, const uint8_t *packed, float *y, int64_t out, float *maxima,
                      int threads) {
    maxima_unknown(maxima, n, out);
    if (!q6_sizes_ok(n, in, out, y)) return;
    int8_t *qx;
    float *dx;
    int32_t *c;
    if (!q6_rows(x, n, in, &qx, &dx, &c, y, out)) return;
    const int64_t supers = in / Q6_SUPER;
    const int64_t count = (n + most - 1) / most, per = (n + count - 1) / count;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b0 = 0; b0 < out; b0 += Q6_BLOCK) {
        const int64_t b1 = out - b0 < Q6_BLOCK ? out : b0 + Q6_BLOCK;
        for (int64_t j = 0; j < n; j += per) {
            const int J = n - j < per ? (int)(n - j) : (int)per;
            for (int64_t o0 = b0; o0 < b1; o0 += lanes) {
                const int rows = b1 - o0 < lanes ? (int)(b1 - o0) : lanes;
                tiles[J - 1](packed + o0 / Q6_ROWS * supers * Q6_GROUP, supers,
                             (int)(o0 % Q6_ROWS / 8), qx + j * in, c + j * in / 16,
                             dx + j * in / 32, in, y + j * out + o0, out, rows);
            }
        }
        if (maxima) block_maxima(y, n, out, b0, b1, maxima, (out + Q6_BLOCK - 1) / Q6_BLOCK);
    }
    free(qx), free(dx), free(c);
}

void q6_k_matmul_i8_avx512(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                           float *y, int64_t out, float *maxima, int threads) {
    q6_matmul(q6_tiles16_bw, Q6_J16, 16, x, n, in, packed, y, out, maxima, threads);
}

void q6_k_matmul_i8_vnni(const float *x, int64_t n, int64_t in, const uint8_t *packed, float *y,
                         int64_t out, float *maxima, int threads) {
    q6_matmul(q6_tiles16_vnni, Q6_J16, 16, x, n, in, packed, y, out, maxima, threads);
}

void q6_k_matmul_i8_avx2(const float *x, int64_t n, int64_t in, const uint8_t *packed, float *y,
                         int64_t out, float *maxima, int threads) {
    q6_matmul(q6_tiles8_avx2, Q6_J8, 8, x, n, in, packed, y, out, maxima, threads);
}

void q6_k_matmul_i8_avxvnni(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                            float *y, int64_t out, float *maxima, int threads) {
    q6_matmul(q6_tiles8_avxvnni, Q6_J8, 8, x, n, in, packed, y, out, maxima, threads);
}
#endif  // SPECCHAT_SIMD
