// NF4 by integer dot products: the `cpu-int8` path's product.
//
// The weights stay 4-bit in memory; each code maps to an int8 value by one 16-entry table,
// w8[c] = round(112 * table[c]) (NF4's 16 values; within 0.4% of a block's scale, 0.17% RMS:
// of the scales up to 127, 112 rounds NF4's values closest, and 127's 0.22% RMS cost the
// integer path a point of top-1 agreement with the float path, docs/cpu.md), and each block of 32 inputs of an activation row is quantized to int8 with one
// float scale as llama.cpp quantizes activations (Q8_0): d = max|x| / 127, q = round(x / d),
// ties to even. Per block of 32 the dot product of the int8 values is an exact int32; the
// row's float arithmetic is then one epilogue in one fixed block order:
//
//   y[j, o] = acc, acc = fma((float)isum_b, dw_b * dx_b, acc) over the blocks b in order from 0,
//   dw_b = absmax(o, b) / 112 (the absmax of the NF4 block holding b), dx_b = d(j, b).
//
// Every kernel (the plain-C reference, AVX2, AVX-512 VNNI) computes those integers exactly and
// that epilogue with the same operations, so the same bits whatever instructions form the
// int32 sums, and whatever the rows fed with a row: a verify's logits are the one-token steps'.
//
// Layout. The codes are repacked once at load (`nf4_i8_pack`, the same 4 bits a weight) so that
// a kernel gets 16 weight rows' values side by side: for each group g of 16 output rows and
// block b of 32 inputs, 256 bytes; byte p * 64 + 4 i + t holds, in its low nibble, the code of
// row 16 g + i at input 32 b + 8 p + t, and in its high nibble the one at 32 b + 8 p + 4 + t
// (p < 4, t < 4). A 64-byte load, its low and its high nibbles, one table lookup each: two
// vectors of 16 rows x 4 consecutive inputs, what AVX-512 VNNI's `vpdpbusd` multiplies with 4
// bytes of an activation row broadcast (llama.cpp's IQ4_NL lookup with NF4's table). The block
// scales go with it: dw [groups, NF4 blocks, 16] floats. Rows past `out` (the last group's
// padding) have code 0 and scale 0: they add nothing and are never stored. A scale is kept once
// per NF4 block (bitsandbytes' 64 inputs: two blocks of 32 read one scale), as the checkpoint
// keeps it: 4.5 bits a weight, Q4_0's, where one a block of 32 would read 5. The kernels take
// the NF4 block as `blocksize` (32 times a power of two) and read block b's scale at b >> sh,
// sh = log2(blocksize / 32).
#include "common.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define I8_ROWS 16       // weight rows of a group
#define I8_BLOCK 32      // inputs of a block
#define I8_BYTES 256     // packed bytes of a group's block
#define I8_OFFSET 128    // VNNI: the weights as unsigned bytes, w8 + 128
#define I8_SCALE 112.0f  // NF4 value v -> round(I8_SCALE v); the block scale absmax / I8_SCALE
#define I8_PAD (16 * 32)  // bytes after a call's quantized rows: one tile's rows of a block

// the table's int8 values: round(I8_SCALE * v), ties to even
static inline void i8_table(const float *table, int8_t w8[16]) {
    for (int c = 0; c < 16; c++) w8[c] = (int8_t)lrintf(I8_SCALE * table[c]);
}

// log2(blocksize / 32): the shift from a block of 32 to its NF4 block's scale; -1 for a
// blocksize that is not 32 times a power of two
static inline int i8_shift(int64_t blocksize) {
    if (blocksize < I8_BLOCK || blocksize % I8_BLOCK) return -1;
    const int64_t per = blocksize / I8_BLOCK;
    return per & (per - 1) ? -1 : __builtin_ctzll((unsigned long long)per);
}

// Whether an NF4 product of these sizes runs (`sizes_ok`, NaN rows where not: `in` a multiple
// of a blocksize that is 32 times a power of two); its scale shift in *sh
static inline int i8_nf4_sizes_ok(int64_t n, int64_t in, int64_t out, int64_t blocksize,
                                  float *y, int *sh) {
    *sh = i8_shift(blocksize);
    return sizes_ok(n, in, out, *sh < 0 ? 0 : blocksize, 0, y);
}

// the code of weight row i (of its group) at input t (of its block), from the group's block
static inline int i8_code(const uint8_t *blk, int i, int t) {
    const int q = t / 4, byte = (q / 2) * 64 + 4 * i + t % 4;
    return q % 2 ? blk[byte] >> 4 : blk[byte] & 15;
}

int64_t nf4_i8_packed_bytes(int64_t out, int64_t in) {
    return (out + I8_ROWS - 1) / I8_ROWS * (in / I8_BLOCK) * I8_BYTES;
}

// bitsandbytes' codes [out, in] (two a byte, the first in the high nibble) and absmax [out,
// in / blocksize] -> packed [nf4_i8_packed_bytes] and dw [groups, in / blocksize, 16]. 0, or -1
// for sizes it does not take (in a multiple of blocksize, blocksize 32 times a power of two).
int nf4_i8_pack(const uint8_t *codes, const float *absmax, int64_t out, int64_t in,
                int64_t blocksize, uint8_t *packed, float *dw) {
    if (out <= 0 || in <= 0 || i8_shift(blocksize) < 0 || in % blocksize) return -1;
    const int64_t groups = (out + I8_ROWS - 1) / I8_ROWS, nb = in / I8_BLOCK;
    const int64_t per = blocksize / I8_BLOCK, ns = in / blocksize;
    memset(packed, 0, (size_t)nf4_i8_packed_bytes(out, in));
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = packed + (g * nb + b) * I8_BYTES;
            float *s = dw + (g * ns + b / per) * I8_ROWS;
            for (int i = 0; i < I8_ROWS; i++) {
                const int64_t o = g * I8_ROWS + i;
                if (o >= out) {
                    s[i] = 0.0f;
                    continue;
                }
                s[i] = absmax[o * ns + b / per] / I8_SCALE;
                for (int t = 0; t < I8_BLOCK; t++) {
                    const int64_t e = o * in + b * I8_BLOCK + t;
                    const int c = e % 2 ? codes[e / 2] & 15 : codes[e / 2] >> 4;
                    const int q = t / 4, byte = (q / 2) * 64 + 4 * i + t % 4;
                    blk[byte] |= (uint8_t)(q % 2 ? c << 4 : c);
                }
            }
        }
    return 0;
}

// The inverse of `nf4_i8_pack`'s codes: packed -> bitsandbytes' codes [out, in] (two a byte, the
// first in the high nibble), for a module that reads its layer again after the codes it held
// were let go. 0, or -1 for sizes the packing does not take.
int nf4_i8_unpack(const uint8_t *packed, int64_t out, int64_t in, uint8_t *codes) {
    if (out <= 0 || in <= 0 || in % I8_BLOCK) return -1;
    const int64_t nb = in / I8_BLOCK;
    for (int64_t o = 0; o < out; o++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = packed + ((o / I8_ROWS) * nb + b) * I8_BYTES;
            for (int t = 0; t < I8_BLOCK; t += 2) {
                const int hi = i8_code(blk, (int)(o % I8_ROWS), t);
                const int lo = i8_code(blk, (int)(o % I8_ROWS), t + 1);
                codes[(o * in + b * I8_BLOCK + t) / 2] = (uint8_t)(hi << 4 | lo);
            }
        }
    return 0;
}

// The largest |v| of a block of 32 (`a > m ? a : m` from 0: a NaN never wins; max is exact in
// any order, so the SIMD form gives the plain one's value)
static inline float block_amax(const float *v) {
#if SPECCHAT_SIMD
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int t = 0; t < I8_BLOCK; t += 8)  // max_ps(a, m): m where a is NaN
        m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + t)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
#else
    float amax = 0.0f;
    for (int t = 0; t < I8_BLOCK; t++) {
        const float a = fabsf(v[t]);
        amax = a > amax ? a : amax;
    }
    return amax;
#endif
}

// Activation rows x [n, in] -> q int8, d (the blocks' scales) and bias (-128 times the blocks'
// sums of q, VNNI's starting sums), block-major so that a block's rows lie side by side: block
// b of row j at q + (b n + j) 32, d[b n + j], bias[b n + j]. One function for every kernel: the
// same bits.
static void i8_quantize(const float *x, int64_t n, int64_t in, int8_t *q, float *d,
                        int32_t *bias) {
    const int64_t nb = in / I8_BLOCK;
    for (int64_t j = 0; j < n; j++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + j * in + b * I8_BLOCK;
            int8_t *o = q + (b * n + j) * I8_BLOCK;
            const float dd = block_amax(v) / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
            int32_t sum = 0;
            for (int t = 0; t < I8_BLOCK; t++) {
                // to nearest, ties to even (|v| < 2^22: adding 1.5 * 2^23 leaves no fraction)
                const float r = (v[t] * id + 12582912.0f) - 12582912.0f;
                int32_t i = (int32_t)r;
                i = i > 127 ? 127 : i < -127 ? -127 : i;
                o[t] = (int8_t)i;
                sum += i;
            }
            d[b * n + j] = dd;
            bias[b * n + j] = -I8_OFFSET * sum;
        }
}

// The buffers of one call (`i8_quantize`'s layout): n rows' values, scales and biases
typedef struct {
    int64_t n;
    int8_t *q;
    float *d;
    int32_t *bias;
} i8_rows;

// block b of row j: its 32 values, its scale
static inline const int8_t *i8_q(const i8_rows *r, int64_t j, int64_t b) {
    return r->q + (b * r->n + j) * I8_BLOCK;
}
static inline float i8_d(const i8_rows *r, int64_t j, int64_t b) { return r->d[b * r->n + j]; }

static int i8_rows_new(const float *x, int64_t n, int64_t in, i8_rows *r, float *y,
                       int64_t out) {
    const int64_t nb = in / I8_BLOCK;
    // room past the last block for a whole tile of rows (the AMX kernel loads 16 rows of a
    // block at a time; the rows past n add nothing that is stored)
    const size_t bytes = (size_t)((n * in + I8_PAD + 63) / 64 * 64);
    r->q = aligned_alloc(64, bytes);
    r->d = malloc(sizeof(float) * (size_t)(n * nb));
    r->bias = malloc(sizeof(int32_t) * (size_t)(n * nb));
    r->n = n;
    if (!r->q || !r->d || !r->bias) {  // no memory: say so in the output
        free(r->q), free(r->d), free(r->bias);
        for (int64_t i = 0; i < n * out; i++) y[i] = __builtin_nanf("");
        return 0;
    }
    i8_quantize(x, n, in, r->q, r->d, r->bias);
    memset(r->q + n * in, 0, bytes - (size_t)(n * in));
    return 1;
}

static void i8_rows_free(i8_rows *r) { free(r->q), free(r->d), free(r->bias); }

// The reference: the arithmetic above for one (o, j) at a time. `blocksize` and the layout's
// scales come from the packing; `table` is NF4's codebook.
void nf4_matmul_i8_ref(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                       const float *dw, int64_t blocksize, const float *table, float *y,
                       int64_t out, int threads) {
    int sh;
    if (!i8_nf4_sizes_ok(n, in, out, blocksize, y, &sh)) return;
    i8_rows r;
    if (!i8_rows_new(x, n, in, &r, y, out)) return;
    int8_t w8[16];
    i8_table(table, w8);
    const int64_t nb = in / I8_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < out; o++) {
        const int64_t g = o / I8_ROWS;
        const int i = (int)(o % I8_ROWS);
        for (int64_t j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = packed + (g * nb + b) * I8_BYTES;
                const int8_t *qx = i8_q(&r, j, b);
                int32_t isum = 0;
                for (int t = 0; t < I8_BLOCK; t++) isum += w8[i8_code(blk, i, t)] * qx[t];
                const float dw_b = dw[(g * (nb >> sh) + (b >> sh)) * I8_ROWS + i];
                const float scale = dw_b * i8_d(&r, j, b);
                acc = fmaf((float)isum, scale, acc);
            }
            y[j * out + o] = acc;
        }
    }
    i8_rows_free(&r);
}

// ---- The Q8_0 LM head by the same arithmetic ---------------------------------------------------
// GGUF's Q8_0 values (int8, one fp16 scale per 32) in the layout of the NF4 kernels' decoded
// vectors: for group g of 16 rows and block b, 512 bytes, byte 64 v + 4 i + t the value of row
// 16 g + i at input 32 b + 4 v + t, plus 128 (unsigned, for vpdpbusd); the scales kept fp16
// [groups, blocks, 16] (GGUF's own values, exact in float32: half the bytes of float32 scales,
// a twentieth of what a token reads of the head). Repacked in place, a group at a time: a group's rows and its packed
// blocks are the same 16 * in bytes, so the head takes no second copy. The product is the NF4
// one's: y = acc over the blocks in order, acc = fma((float)isum_b, dw_b * dx_b, acc).

// q [out, in] in place (out a multiple of 16), d [out, in / 32] fp16 -> dw. 0, or -1 for
// sizes it does not take or no memory (q is then unchanged).
int q8_0_i8_pack(int8_t *q, const uint16_t *d, int64_t out, int64_t in, uint16_t *dw) {
    if (out <= 0 || out % I8_ROWS || in <= 0 || in % I8_BLOCK) return -1;
    const int64_t nb = in / I8_BLOCK, span = I8_ROWS * in;
    int8_t *rows = malloc((size_t)span);
    if (!rows) return -1;
    for (int64_t g = 0; g < out / I8_ROWS; g++) {
        int8_t *group = q + g * span;
        memcpy(rows, group, (size_t)span);
        for (int64_t b = 0; b < nb; b++)
            for (int i = 0; i < I8_ROWS; i++) {
                for (int t = 0; t < I8_BLOCK; t++)
                    group[b * 2 * I8_BYTES + 64 * (t / 4) + 4 * i + t % 4] =
                        (int8_t)(uint8_t)(rows[i * in + b * I8_BLOCK + t] + I8_OFFSET);
                dw[(g * nb + b) * I8_ROWS + i] = d[(g * I8_ROWS + i) * nb + b];
            }
    }
    free(rows);
    return 0;
}

// The packed value (signed) of row i of a group's block at input t
static inline int q8_value(const uint8_t *blk, int i, int t) {
    return (int)blk[64 * (t / 4) + 4 * i + t % 4] - I8_OFFSET;
}

// y [n, out] (out: the rows computed, a multiple of 16 or the rest of a head; see
// `q8_0_matmul_i8`), and each row's block maxima where `maxima` is not NULL
void q8_0_rows_matmul_i8_ref(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                             const uint16_t *dw, float *y, int64_t out, float *maxima,
                             int threads) {
    maxima_unknown(maxima, n, out);
    if (!sizes_ok(n, in, out, I8_BLOCK, 0, y)) return;
    i8_rows r;
    if (!i8_rows_new(x, n, in, &r, y, out)) return;
    const int64_t nb = in / I8_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b0 = 0; b0 < out; b0 += HEAD_BLOCK) {
        const int64_t b1 = out - b0 < HEAD_BLOCK ? out : b0 + HEAD_BLOCK;
        for (int64_t o = b0; o < b1; o++) {
            const int64_t g = o / I8_ROWS;
            const int i = (int)(o % I8_ROWS);
            for (int64_t j = 0; j < n; j++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = packed + (g * nb + b) * 2 * I8_BYTES;
                    const int8_t *qx = i8_q(&r, j, b);
                    int32_t isum = 0;
                    for (int t = 0; t < I8_BLOCK; t++) isum += q8_value(blk, i, t) * qx[t];
                    const float scale =
                        half_to_float(dw[(g * nb + b) * I8_ROWS + i]) * i8_d(&r, j, b);
                    acc = fmaf((float)isum, scale, acc);
                }
                y[j * out + o] = acc;
            }
        }
        if (maxima) block_maxima(y, n, out, b0, b1, maxima, (out + HEAD_BLOCK - 1) / HEAD_BLOCK);
    }
    i8_rows_free(&r);
}

#if SPECCHAT_SIMD
// ---- 256 bits: 8 weight rows a vector (AVX2, AVX-VNNI) ------------------------------------------
// A group's half (8 of its 16 rows) at a time: in both layouts the 32 bytes at 64 v + 32 h of a
// block hold rows 8 h .. 8 h + 7, 4 consecutive inputs each. Two ways to the int32 sums:
// - AVX2: vpmaddubsw multiplies unsigned by signed bytes into saturating 16-bit pair sums: the
//   weights' magnitudes |w8| times the activations given the weights' signs (vpsignb), whose
//   pair sums stay within 2 * 128 * 127; then vpmaddwd sums the pairs into the 8 lanes' int32.
// - AVX-VNNI (Intel's client cores from Alder Lake, Zen 5): vpdpbusd on 256 bits, the AVX-512
//   VNNI kernel's arithmetic below: the weights as unsigned bytes w8 + 128, each lane's sum
//   starting at the block's bias.
// The float epilogue is every kernel's: the same bits.
#define I8_J2 4  // activation rows per tile (the weights are decoded once per tile)
#define I8_AHEAD 8192  // bytes prefetched ahead of a group's block: 16 Q8_0 blocks, 32 NF4

// Tiles of one instruction set: BYTES 0 a group's block of NF4 codes (256 bytes, decoded by the
// table `tbl`: signed for AVX2, unsigned for AVX-VNNI), 1 of Q8_0 values as packed (512 bytes,
// unsigned). dw: float scales (NF4) or fp16 (Q8_0), [blocks, 16] of the group. Writes the tile's
// rows' 8 outputs to acc_out[8 j ..]. A macro, instantiated once per instruction set: a body
// holding AVX-VNNI's intrinsic must carry that target, which AVX2's callers may not inline.
#define I8_TILE256(NAME, TARGET, VNNI)                                                             \
    TARGET static inline __attribute__((always_inline)) void NAME(                                \
        int J, int BYTES, const uint8_t *packed, const void *dw, int64_t nb, int sh, int half,    \
        __m256i tbl, const i8_rows *r, int64_t j0, float *acc_out) {                              \
        __m256 acc[I8_J2];                                                                        \
        for (int j = 0; j < J; j++) acc[j] = _mm256_setzero_ps();                                 \
        const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);                    \
        const __m256i flip = _mm256_set1_epi8((char)0x80);                                        \
        const int64_t stride = BYTES ? 2 * I8_BYTES : I8_BYTES;                                   \
        for (int64_t b = 0; b < nb; b++) {                                                        \
            const uint8_t *blk = packed + b * stride;                                             \
            if (!half) /* every line ahead, once a group (as the AVX-512 kernel) */               \
                for (int64_t l = 0; l < stride; l += 64)                                          \
                    _mm_prefetch((const char *)blk + I8_AHEAD + l, _MM_HINT_T1);                  \
            const int32_t *qx = (const int32_t *)i8_q(r, j0, b);                                  \
            const int32_t *bias = r->bias + b * r->n + j0;                                        \
            __m256i isum[I8_J2][1];                                                               \
            for (int j = 0; j < J; j++)                                                           \
                isum[j][0] = VNNI ? _mm256_set1_epi32(bias[j]) : _mm256_setzero_si256();          \
            for (int p = 0; p < 4; p++) { /* vectors 2p and 2p + 1: inputs 8p .. 8p + 7 */       \
                __m256i w[2];                                                                     \
                if (BYTES) {                                                                      \
                    for (int h = 0; h < 2; h++) {                                                 \
                        w[h] = _mm256_loadu_si256(                                                \
                            (const __m256i *)(blk + 64 * (2 * p + h) + 32 * half));               \
                        if (!VNNI) w[h] = _mm256_xor_si256(w[h], flip); /* signed again */        \
                    }                                                                             \
                } else {                                                                          \
                    const __m256i c =                                                             \
                        _mm256_loadu_si256((const __m256i *)(blk + 64 * p + 32 * half));          \
                    w[0] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(c, low));                    \
                    w[1] = _mm256_shuffle_epi8(tbl,                                               \
                                               _mm256_and_si256(_mm256_srli_epi16(c, 4), low));   \
                }                                                                                 \
                for (int h = 0; h < 2; h++) {                                                     \
                    const __m256i mag = _mm256_abs_epi8(w[h]);                                    \
                    for (int j = 0; j < J; j++) {                                                 \
                        const __m256i x4 = _mm256_set1_epi32(qx[8 * j + 2 * p + h]);              \
                        isum[j][0] = VNNI ? I8_DPBUSD256(isum[j][0], w[h], x4)                    \
                                          : _mm256_add_epi32(isum[j][0], _mm256_madd_epi16(       \
                                                _mm256_maddubs_epi16(                             \
                                                    mag, _mm256_sign_epi8(x4, w[h])),             \
                                                ones));                                           \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            const __m256 dwv =                                                                    \
                BYTES ? _mm256_cvtph_ps(_mm_loadu_si128(                                          \
                            (const __m128i *)((const uint16_t *)dw + b * I8_ROWS + 8 * half)))    \
                      : _mm256_loadu_ps((const float *)dw + (b >> sh) * I8_ROWS + 8 * half);      \
            const float *dx = r->d + b * r->n + j0;                                               \
            for (int j = 0; j < J; j++) {                                                         \
                const __m256 scale = _mm256_mul_ps(dwv, _mm256_set1_ps(dx[j]));                   \
                const __m256i sum = isum[j][0];                     \
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[j]);                 \
            }                                                                                     \
        }                                                                                         \
        for (int j = 0; j < J; j++) _mm256_storeu_ps(acc_out + 8 * j, acc[j]);                    \
    }

typedef void (*i8_tile256_fn)(const uint8_t *, const void *, int64_t, int, int, __m256i,
                              const i8_rows *, int64_t, float *);
#define I8_TILE256_J(TILE, TARGET, KIND, BYTES, JJ)                                               \
    TARGET __attribute__((noinline)) static void TILE##_##KIND##_##JJ(                            \
        const uint8_t *packed, const void *dw, int64_t nb, int sh, int half, __m256i tbl,         \
        const i8_rows *r, int64_t j0, float *acc_out) {                                          \
        TILE(JJ, BYTES, packed, dw, nb, sh, half, tbl, r, j0, acc_out);                           \
    }
#define I8_TILES256(TILE, TARGET, KIND, BYTES)                                                    \
    I8_TILE256_J(TILE, TARGET, KIND, BYTES, 1) I8_TILE256_J(TILE, TARGET, KIND, BYTES, 2)         \
    I8_TILE256_J(TILE, TARGET, KIND, BYTES, 3) I8_TILE256_J(TILE, TARGET, KIND, BYTES, 4)         \
    static const i8_tile256_fn TILE##_##KIND[I8_J2] = {TILE##_##KIND##_1, TILE##_##KIND##_2,      \
                                                       TILE##_##KIND##_3, TILE##_##KIND##_4};

// The 256-bit kernels' driver: n activation rows in as few tiles as fit (of sizes as equal as
// can be) over each group's two halves, BYTES as above (sh: NF4's scale shift, 0 for Q8_0);
// for the Q8_0 head (BYTES 1) a block of maxima at a time, while its outputs are in the cache.
static void i8_matmul256(const i8_tile256_fn tiles[I8_J2], int BYTES, const i8_rows *r,
                         int64_t in, const uint8_t *packed, const void *dw, int sh, __m256i tbl,
                         float *y, int64_t out, float *maxima, int threads) {
    const int64_t n = r->n, nb = in / I8_BLOCK;
    const int64_t tiles_n = (n + I8_J2 - 1) / I8_J2, per = (n + tiles_n - 1) / tiles_n;
    const int64_t span = BYTES ? HEAD_BLOCK : I8_ROWS;  // outputs a thread's step takes
    const int64_t stride = BYTES ? 2 * I8_BYTES : I8_BYTES;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b0 = 0; b0 < out; b0 += span) {
        const int64_t b1 = out - b0 < span ? out : b0 + span;
        float acc[8 * I8_J2];
        for (int64_t o0 = b0; o0 < b1; o0 += 8) {
            const int64_t g = o0 / I8_ROWS;
            const int rows = b1 - o0 < 8 ? (int)(b1 - o0) : 8, half = (int)(o0 / 8 % 2);
            for (int64_t j0 = 0; j0 < n; j0 += per) {
                const int J = n - j0 < per ? (int)(n - j0) : (int)per;
                const void *scales =
                    BYTES ? (const void *)((const uint16_t *)dw + g * nb * I8_ROWS)
                          : (const void *)((const float *)dw + g * (nb >> sh) * I8_ROWS);
                tiles[J - 1](packed + g * nb * stride, scales, nb, sh, half, tbl, r, j0, acc);
                for (int j = 0; j < J; j++)
                    memcpy(y + (j0 + j) * out + o0, acc + 8 * j, sizeof(float) * (size_t)rows);
            }
        }
        if (maxima) block_maxima(y, n, out, b0, b1, maxima, (out + HEAD_BLOCK - 1) / HEAD_BLOCK);
    }
}

// The 256-bit entry points of a kernel's tiles: the activation rows quantized once, then the
// driver. NF4's table as the tiles read it: `offset` 0 (AVX2's signed values) or I8_OFFSET
// (AVX-VNNI's unsigned ones).
static void nf4_i8_256(const i8_tile256_fn tiles[I8_J2], int offset, const float *x, int64_t n,
                       int64_t in, const uint8_t *packed, const float *dw, int64_t blocksize,
                       const float *table, float *y, int64_t out, int threads) {
    int sh;
    if (!i8_nf4_sizes_ok(n, in, out, blocksize, y, &sh)) return;
    i8_rows r;
    if (!i8_rows_new(x, n, in, &r, y, out)) return;
    int8_t w8[16];
    i8_table(table, w8);
    uint8_t t8[16];
    for (int c = 0; c < 16; c++) t8[c] = (uint8_t)(w8[c] + offset);
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t8));
    i8_matmul256(tiles, 0, &r, in, packed, dw, sh, tbl, y, out, NULL, threads);
    i8_rows_free(&r);
}

static void q8_rows_256(const i8_tile256_fn tiles[I8_J2], const float *x, int64_t n, int64_t in,
                        const uint8_t *packed, const uint16_t *dw, float *y, int64_t out,
                        float *maxima, int threads) {
    maxima_unknown(maxima, n, out);
    if (!sizes_ok(n, in, out, I8_BLOCK, 0, y)) return;
    i8_rows r;
    if (!i8_rows_new(x, n, in, &r, y, out)) return;
    i8_matmul256(tiles, 1, &r, in, packed, dw, 0, _mm256_setzero_si256(), y, out, maxima,
                 threads);
    i8_rows_free(&r);
}

#define I8_DPBUSD256(acc, w, x) (acc)  // AVX2: not used (VNNI 0)
I8_TILE256(i8_tile_avx2, , 0)
#undef I8_DPBUSD256
I8_TILES256(i8_tile_avx2, , nf4, 0)
I8_TILES256(i8_tile_avx2, , q8, 1)

// AVX-VNNI's intrinsics came with GCC 11 and Clang 12: before them the AVX-VNNI kernels are the
// AVX2 ones under their names (the same bits)
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define I8_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define I8_DPBUSD256(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
I8_TILE256(i8_tile_avxvnni, I8_AVXVNNI, 1)
#undef I8_DPBUSD256
I8_TILES256(i8_tile_avxvnni, I8_AVXVNNI, nf4, 0)
I8_TILES256(i8_tile_avxvnni, I8_AVXVNNI, q8, 1)
#undef I8_AVXVNNI
#define I8_AVXVNNI_NF4 i8_tile_avxvnni_nf4, I8_OFFSET
#define I8_AVXVNNI_Q8 i8_tile_avxvnni_q8
#else
#define I8_AVXVNNI_NF4 i8_tile_avx2_nf4, 0
#define I8_AVXVNNI_Q8 i8_tile_avx2_q8
#endif

void nf4_matmul_i8_avx2(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                        const float *dw, int64_t blocksize, const float *table, float *y,
                        int64_t out, int threads) {
    nf4_i8_256(i8_tile_avx2_nf4, 0, x, n, in, packed, dw, blocksize, table, y, out, threads);
}
void nf4_matmul_i8_avxvnni(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                           const float *dw, int64_t blocksize, const float *table, float *y,
                           int64_t out, int threads) {
    nf4_i8_256(I8_AVXVNNI_NF4, x, n, in, packed, dw, blocksize, table, y, out, threads);
}
void q8_0_rows_matmul_i8_avx2(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                              const uint16_t *dw, float *y, int64_t out, float *maxima,
                              int threads) {
    q8_rows_256(i8_tile_avx2_q8, x, n, in, packed, dw, y, out, maxima, threads);
}
void q8_0_rows_matmul_i8_avxvnni(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                                 const uint16_t *dw, float *y, int64_t out, float *maxima,
                                 int threads) {
    q8_rows_256(I8_AVXVNNI_Q8, x, n, in, packed, dw, y, out, maxima, threads);
}
#undef I8_AVXVNNI_NF4
#undef I8_AVXVNNI_Q8
#undef I8_TILES256
#undef I8_TILE256_J
#undef I8_TILE256

// ---- AVX-512 VNNI: 16 weight rows a vector --------------------------------------------------------
// vpdpbusd multiplies unsigned by signed bytes into int32 lanes without saturation: the weights
// as unsigned bytes w8 + 128, each lane's sum starting at -128 times the block's sum of the
// activations (exact integers). The weights of a group's block are decoded once (8 vectors)
// for every activation row of a tile.
#define I8_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define I8_J16 12  // activation rows per tile: 8 weight vectors and 2 per row within 32 registers

// BYTES 0: a group's block of NF4 codes (256 bytes, decoded by the table); 1: of Q8_0 values
// already unsigned (512 bytes, `q8_0_i8_pack`: vector v at 64 v)
I8_512 static inline __attribute__((always_inline)) void i8_tile_vnni(
    int J, int BYTES, const uint8_t *packed, const void *dw, int64_t nb, int sh, __m512i tbl,
    const i8_rows *r, int64_t j0, float *y, int64_t out, int rows) {
    __m512 acc[I8_J16];
    for (int j = 0; j < J; j++) acc[j] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    const int64_t stride = BYTES ? 2 * I8_BYTES : I8_BYTES;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = packed + b * stride;
        // every line ahead into L2, at any rows a tile: with one line in four below 4 rows
        // (which Zen 4's hardware prefetcher followed) the AMX Xeon's forward of 1 row took 7%
        // longer and of 2 and 3 rows 16% (docs/performance.md)
        for (int64_t l = 0; l < stride; l += 64)
            _mm_prefetch((const char *)blk + I8_AHEAD + l, _MM_HINT_T1);
        __m512i w[8];
        if (BYTES) {
            for (int v = 0; v < 8; v++) w[v] = _mm512_loadu_si512((const void *)(blk + 64 * v));
        } else
            for (int p = 0; p < 4; p++) {
                const __m512i c = _mm512_loadu_si512((const void *)(blk + 64 * p));
                w[2 * p] = _mm512_shuffle_epi8(tbl, _mm512_and_si512(c, low));
                w[2 * p + 1] = _mm512_shuffle_epi8(
                    tbl, _mm512_and_si512(_mm512_srli_epi16(c, 4), low));
            }
        const __m512 dwv = BYTES ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                       (const __m256i *)((const uint16_t *)dw + b * I8_ROWS)))
                                 : _mm512_loadu_ps((const float *)dw + (b >> sh) * I8_ROWS);
        // this block of the tile's rows: their values side by side (one pointer, constant
        // offsets: each 4 bytes broadcast from memory inside vpdpbusd), scales and biases
        const int32_t *qx = (const int32_t *)i8_q(r, j0, b);
        const float *dx = r->d + b * r->n + j0;
        const int32_t *bias = r->bias + b * r->n + j0;
        for (int j = 0; j < J; j++) {
            // two chains of four (integer sums: exact in any order), joined after
            __m512i isum = _mm512_set1_epi32(bias[j]);
            __m512i odd = _mm512_setzero_si512();
            for (int v = 0; v < 8; v += 2) {  // vector 2p + h: inputs 8p + 4h .. 8p + 4h + 3
                isum = _mm512_dpbusd_epi32(isum, w[v], _mm512_set1_epi32(qx[8 * j + v]));
                odd = _mm512_dpbusd_epi32(odd, w[v + 1], _mm512_set1_epi32(qx[8 * j + v + 1]));
            }
            isum = _mm512_add_epi32(isum, odd);
            const __m512 scale = _mm512_mul_ps(dwv, _mm512_set1_ps(dx[j]));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[j]);
        }
    }
    const __mmask16 keep = rows == 16 ? (__mmask16)0xffff : (__mmask16)((1u << rows) - 1);
    for (int j = 0; j < J; j++) _mm512_mask_storeu_ps(y + (j0 + j) * out, keep, acc[j]);
}

#define I8_TILE16(KIND, BYTES, JJ)                                                         \
    I8_512 __attribute__((noinline)) static void i8_tile_##KIND##_##JJ(                    \
        const uint8_t *packed, const void *dw, int64_t nb, int sh, __m512i tbl,            \
        const i8_rows *r, int64_t j0, float *y, int64_t out, int rows) {                  \
        i8_tile_vnni(JJ, BYTES, packed, dw, nb, sh, tbl, r, j0, y, out, rows);             \
    }
#define I8_TILES16(KIND, BYTES)                                                                \
    I8_TILE16(KIND, BYTES, 1) I8_TILE16(KIND, BYTES, 2) I8_TILE16(KIND, BYTES, 3)              \
    I8_TILE16(KIND, BYTES, 4) I8_TILE16(KIND, BYTES, 5) I8_TILE16(KIND, BYTES, 6)              \
    I8_TILE16(KIND, BYTES, 7) I8_TILE16(KIND, BYTES, 8) I8_TILE16(KIND, BYTES, 9)              \
    I8_TILE16(KIND, BYTES, 10) I8_TILE16(KIND, BYTES, 11) I8_TILE16(KIND, BYTES, 12)           \
    static const i8_tile16_fn i8_tiles16_##KIND[I8_J16] = {                                    \
        i8_tile_##KIND##_1, i8_tile_##KIND##_2,  i8_tile_##KIND##_3,  i8_tile_##KIND##_4,      \
        i8_tile_##KIND##_5, i8_tile_##KIND##_6,  i8_tile_##KIND##_7,  i8_tile_##KIND##_8,      \
        i8_tile_##KIND##_9, i8_tile_##KIND##_10, i8_tile_##KIND##_11, i8_tile_##KIND##_12};
typedef void (*i8_tile16_fn)(const uint8_t *, const void *, int64_t, int, __m512i,
                             const i8_rows *, int64_t, float *, int64_t, int);
I8_TILES16(nf4, 0)
I8_TILES16(q8, 1)
#undef I8_TILES16
#undef I8_TILE16

I8_512 void nf4_matmul_i8_vnni(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                               const float *dw, int64_t blocksize, const float *table, float *y,
                               int64_t out, int threads) {
    int sh;
    if (!i8_nf4_sizes_ok(n, in, out, blocksize, y, &sh)) return;
    i8_rows r;
    if (!i8_rows_new(x, n, in, &r, y, out)) return;
    int8_t w8[16];
    i8_table(table, w8);
    uint8_t u8[16];
    for (int c = 0; c < 16; c++) u8[c] = (uint8_t)(w8[c] + I8_OFFSET);
    const __m512i tbl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)u8));
    const int64_t nb = in / I8_BLOCK, groups = (out + I8_ROWS - 1) / I8_ROWS;
    // activation rows in as few tiles as fit, of sizes as equal as can be
    const int64_t tiles = (n + I8_J16 - 1) / I8_J16, per = (n + tiles - 1) / tiles;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t o0 = g * I8_ROWS;
        const int rows = out - o0 < I8_ROWS ? (int)(out - o0) : I8_ROWS;
        for (int64_t j0 = 0; j0 < n; j0 += per) {
            const int J = n - j0 < per ? (int)(n - j0) : (int)per;
            i8_tiles16_nf4[J - 1](packed + g * nb * I8_BYTES, dw + g * (nb >> sh) * I8_ROWS, nb,
                                  sh, tbl, &r, j0, y + o0, out, rows);
        }
    }
    i8_rows_free(&r);
}
I8_512 void q8_0_rows_matmul_i8_vnni(const float *x, int64_t n, int64_t in,
                                     const uint8_t *packed, const uint16_t *dw, float *y,
                                     int64_t out, float *maxima, int threads) {
    maxima_unknown(maxima, n, out);
    if (!sizes_ok(n, in, out, I8_BLOCK, 0, y)) return;
    i8_rows r;
    if (!i8_rows_new(x, n, in, &r, y, out)) return;
    const int64_t nb = in / I8_BLOCK;
    const int64_t tiles = (n + I8_J16 - 1) / I8_J16, per = (n + tiles - 1) / tiles;
    const __m512i unused = _mm512_setzero_si512();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b0 = 0; b0 < out; b0 += HEAD_BLOCK) {  // a block of maxima, in the cache
        const int64_t b1 = out - b0 < HEAD_BLOCK ? out : b0 + HEAD_BLOCK;
        for (int64_t o0 = b0; o0 < b1; o0 += I8_ROWS) {
            const int64_t g = o0 / I8_ROWS;
            const int rows = b1 - o0 < I8_ROWS ? (int)(b1 - o0) : I8_ROWS;
            for (int64_t j0 = 0; j0 < n; j0 += per) {
                const int J = n - j0 < per ? (int)(n - j0) : (int)per;
                i8_tiles16_q8[J - 1](packed + g * nb * 2 * I8_BYTES, dw + g * nb * I8_ROWS, nb,
                                     0, unused, &r, j0, y + o0, out, rows);
            }
        }
        if (maxima) block_maxima(y, n, out, b0, b1, maxima, (out + HEAD_BLOCK - 1) / HEAD_BLOCK);
    }
    i8_rows_free(&r);
}

// ---- AMX-INT8: 16 activation rows by 16 weight rows in one instruction -------------------------
// One tile product multiplies 16 activation rows of a block (tile A: 32 signed bytes a row) by
// 16 weight rows (tile B) into their int32 sums (tile C: 16 x 16), exactly. B is a group's
// block as the VNNI kernel's 8 vectors hold it (16 weight rows x 4 consecutive inputs each),
// which is AMX's own layout for B (K / 4 rows of N x 4 bytes): the Q8_0 head's packed blocks
// load as they lie (unsigned, w8 + 128: tdpbsud, then each sum plus the row's bias, as VNNI's),
// and an NF4 block is decoded by the signed table into 512 bytes first (tdpbssd: no bias).
// C goes through memory to the VNNI kernel's epilogue, the same operations in the same block
// order: the same bits. Per-32 block sums keep a tile product to half its depth (K = 32 of
// 64), and the epilogue (convert, scale, add: a vector op each per row and block) is most of
// the work. A thread configures its tiles once a call (`amx_tiles`); the process needs the
// kernel's permission first (`amx_ready`). Fewer rows than AMX_MIN_ROWS go to the VNNI kernel.
// Compilers before GCC 11 and Clang 12 know no AMX intrinsics: there the AMX kernels are the
// VNNI ones under their names (the same bits), and the rest of the build still compiles.
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define SPECCHAT_AMX 1
#else
#define SPECCHAT_AMX 0
#endif
#if SPECCHAT_AMX
#define I8_AMX \
    __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define AMX_ROWS 16      // activation rows of a tile
#define AMX_MIN_ROWS 8   // fewer rows: the VNNI kernel (as fast up to 7 rows, measured)

// Linux hands a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction kills the process. 1 where granted
// (once a process; the grant covers every thread), else 0 and the kernels below run VNNI's.
int amx_ready(void) {
    static int state;  // 0: not asked yet, 1: granted, -1: refused
#if defined(__linux__)
    if (!state) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
#else
    state = -1;
#endif
    return state > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config;

// Two sets of tiles, one for even blocks and one for odd, so that a block's loads and product
// need not wait for the last block's to finish with a tile: B (8 rows x 64 bytes) in 0 and 1,
// A (`rows` rows x 32 bytes) in 2 and 3, C (`rows` rows x 64 bytes) in 4 and 5. `rows`: 16, or
// a call's fewer rows (less to load and store).
I8_AMX static void amx_tiles(int rows) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) {
        c.rows[t] = t < 2 ? 8 : (uint8_t)rows;
        c.colsb[t] = t == 2 || t == 3 ? I8_BLOCK : 64;
    }
    _tile_loadconfig(&c);
}

// A group's block of NF4 codes decoded into B's layout (512 bytes: the VNNI kernel's 8 vectors)
I8_AMX static inline __attribute__((always_inline)) void amx_decode(const uint8_t *blk,
                                                                     __m512i tbl, uint8_t *wt) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int p = 0; p < 4; p++) {
        const __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * p));
        _mm512_store_si512((void *)(wt + 128 * p),
                           _mm512_shuffle_epi8(tbl, _mm512_and_si512(v, low)));
        _mm512_store_si512((void *)(wt + 128 * p + 64), _mm512_shuffle_epi8(
                               tbl, _mm512_and_si512(_mm512_srli_epi16(v, 4), low)));
    }
}

// Block b's sums (stored at c, a row each 16) into the accumulators of its J rows: the VNNI
// kernel's epilogue
I8_AMX static inline __attribute__((always_inline)) void amx_epilogue(
    int BYTES, const int32_t *c, int64_t J, const i8_rows *r, int64_t j0, int64_t b, __m512 dwv,
    __m512 *acc) {
    const float *dx = r->d + b * r->n + j0;
    const int32_t *bias = r->bias + b * r->n + j0;
#pragma GCC unroll 16
    for (int j = 0; j < AMX_ROWS; j++)  // unrolled: the accumulators stay in registers
        if (j < J) {
            __m512i isum = _mm512_load_si512((const void *)(c + j * 16));
            if (BYTES) isum = _mm512_add_epi32(isum, _mm512_set1_epi32(bias[j]));
            const __m512 scale = _mm512_mul_ps(dwv, _mm512_set1_ps(dx[j]));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[j]);
        }
}

// Block b's product into its set of tiles (B tile BT, A tile AT, C tile CT: literal numbers, as
// the intrinsics take them): signed by unsigned bytes for Q8_0, signed by signed for NF4
#define AMX_PRODUCT(BT, AT, CT)                                                            \
    do {                                                                                   \
        _tile_loadd(BT, BYTES ? blk : wt[b & 1], 64);                                      \
        _tile_zero(CT);                                                                    \
        _tile_loadd(AT, i8_q(r, j0, b), I8_BLOCK);                                         \
        if (BYTES)                                                                         \
            _tile_dpbsud(CT, AT, BT);                                                      \
        else                                                                               \
            _tile_dpbssd(CT, AT, BT);                                                      \
    } while (0)

// block b's weight scales
#define AMX_DW(b)                                                                               \
    (BYTES ? _mm512_cvtph_ps(_mm256_loadu_si256(                                                \
                 (const __m256i *)((const uint16_t *)dw + (b) * I8_ROWS)))                      \
           : _mm512_loadu_ps((const float *)dw + ((b) >> sh) * I8_ROWS))

// One group of 16 weight rows (`out_rows` of them stored) for activation rows j0 .. j0 + J (J
// at most 16: one tile, their accumulators in registers), over every block. Pipelined two
// blocks deep, so that nothing waits on a result just asked for: block b + 1's codes are
// decoded while block b's product runs, block b - 1's sums go to memory once block b's product
// is under way, and block b - 2's epilogue reads them from there. The epilogues still run in
// block order. BYTES as `i8_tile_vnni`'s.
I8_AMX static inline __attribute__((always_inline)) void i8_group_amx(
    int BYTES, const uint8_t *packed, const void *dw, int64_t nb, int sh, __m512i tbl,
    const i8_rows *r, int64_t j0, int64_t J, float *y, int64_t out, int out_rows) {
    __attribute__((aligned(64))) uint8_t wt[2][8 * 64];
    __attribute__((aligned(64))) int32_t c[2][AMX_ROWS * 16];
    __m512 acc[AMX_ROWS];
    for (int j = 0; j < AMX_ROWS; j++) acc[j] = _mm512_setzero_ps();
    const int64_t stride = BYTES ? 2 * I8_BYTES : I8_BYTES;
    if (!BYTES) amx_decode(packed, tbl, wt[0]);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = packed + b * stride;
        // into L2 far ahead, and into L1 two blocks ahead: a tile load waits for its lines,
        // and the tile instructions after it wait with it
        for (int64_t l = 0; l < stride; l += 64) {
            _mm_prefetch((const char *)blk + I8_AHEAD + l, _MM_HINT_T1);
            _mm_prefetch((const char *)blk + 2 * stride + l, _MM_HINT_T0);
        }
        if (!BYTES && b + 1 < nb) amx_decode(blk + stride, tbl, wt[(b + 1) & 1]);
        if (b & 1) {
            AMX_PRODUCT(1, 3, 5);
            _tile_stored(4, c[0], 64);  // block b - 1's
        } else {
            AMX_PRODUCT(0, 2, 4);
            if (b) _tile_stored(5, c[1], 64);
        }
        if (b >= 2) amx_epilogue(BYTES, c[b & 1], J, r, j0, b - 2, AMX_DW(b - 2), acc);
    }
    if ((nb - 1) & 1)  // the last block's sums, then the last two epilogues
        _tile_stored(5, c[1], 64);
    else
        _tile_stored(4, c[0], 64);
    if (nb >= 2) amx_epilogue(BYTES, c[nb & 1], J, r, j0, nb - 2, AMX_DW(nb - 2), acc);
    amx_epilogue(BYTES, c[(nb - 1) & 1], J, r, j0, nb - 1, AMX_DW(nb - 1), acc);
    const __mmask16 keep =
        out_rows == 16 ? (__mmask16)0xffff : (__mmask16)((1u << out_rows) - 1);
#pragma GCC unroll 16
    for (int j = 0; j < AMX_ROWS; j++)
        if (j < J) _mm512_mask_storeu_ps(y + (j0 + j) * out, keep, acc[j]);
}
#undef AMX_PRODUCT
#undef AMX_DW

I8_AMX void nf4_matmul_i8_amx(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                              const float *dw, int64_t blocksize, const float *table, float *y,
                              int64_t out, int threads) {
    if (n < AMX_MIN_ROWS || !amx_ready()) {
        nf4_matmul_i8_vnni(x, n, in, packed, dw, blocksize, table, y, out, threads);
        return;
    }
    int sh;
    if (!i8_nf4_sizes_ok(n, in, out, blocksize, y, &sh)) return;
    i8_rows r;
    if (!i8_rows_new(x, n, in, &r, y, out)) return;
    int8_t w8[16];  // signed: tdpbssd, and no bias to add
    i8_table(table, w8);
    const __m512i tbl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)w8));
    const int64_t nb = in / I8_BLOCK, groups = (out + I8_ROWS - 1) / I8_ROWS;
    // rows in as few tiles as fit, of sizes as equal as can be
    const int64_t tiles = (n + AMX_ROWS - 1) / AMX_ROWS, per = (n + tiles - 1) / tiles;
    const int rows = (int)per;  // a tile's rows
#pragma omp parallel num_threads(threads)
    {
        amx_tiles(rows);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t o0 = g * I8_ROWS;
            const int out_rows = out - o0 < I8_ROWS ? (int)(out - o0) : I8_ROWS;
            for (int64_t j0 = 0; j0 < n; j0 += per)  // the group's weights stay in the cache
                i8_group_amx(0, packed + g * nb * I8_BYTES, dw + g * (nb >> sh) * I8_ROWS, nb,
                             sh, tbl, &r, j0, n - j0 < per ? n - j0 : per, y + o0, out,
                             out_rows);
        }
        _tile_release();
    }
    i8_rows_free(&r);
}

I8_AMX void q8_0_rows_matmul_i8_amx(const float *x, int64_t n, int64_t in,
                                    const uint8_t *packed, const uint16_t *dw, float *y,
                                    int64_t out, float *maxima, int threads) {
    if (n < AMX_MIN_ROWS || !amx_ready()) {
        q8_0_rows_matmul_i8_vnni(x, n, in, packed, dw, y, out, maxima, threads);
        return;
    }
    maxima_unknown(maxima, n, out);
    if (!sizes_ok(n, in, out, I8_BLOCK, 0, y)) return;
    i8_rows r;
    if (!i8_rows_new(x, n, in, &r, y, out)) return;
    const int64_t nb = in / I8_BLOCK;
    // rows in as few tiles as fit, of sizes as equal as can be
    const int64_t tiles = (n + AMX_ROWS - 1) / AMX_ROWS, per = (n + tiles - 1) / tiles;
    const int rows = (int)per;  // a tile's rows
    const __m512i unused = _mm512_setzero_si512();
#pragma omp parallel num_threads(threads)
    {
        amx_tiles(rows);
#pragma omp for schedule(static)
        for (int64_t b0 = 0; b0 < out; b0 += HEAD_BLOCK) {
            const int64_t b1 = out - b0 < HEAD_BLOCK ? out : b0 + HEAD_BLOCK;
            for (int64_t o0 = b0; o0 < b1; o0 += I8_ROWS) {
                const int64_t g = o0 / I8_ROWS;
                const int out_rows = b1 - o0 < I8_ROWS ? (int)(b1 - o0) : I8_ROWS;
                for (int64_t j0 = 0; j0 < n; j0 += per)
                    i8_group_amx(1, packed + g * nb * 2 * I8_BYTES, dw + g * nb * I8_ROWS, nb,
                                 0, unused, &r, j0, n - j0 < per ? n - j0 : per, y + o0, out,
                                 out_rows);
            }
            if (maxima)
                block_maxima(y, n, out, b0, b1, maxima, (out + HEAD_BLOCK - 1) / HEAD_BLOCK);
        }
        _tile_release();
    }
    i8_rows_free(&r);
}
#undef I8_AMX
#else   // no AMX in this compiler
int amx_ready(void) { return 0; }
void nf4_matmul_i8_amx(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                       const float *dw, int64_t blocksize, const float *table, float *y,
                       int64_t out, int threads) {
    nf4_matmul_i8_vnni(x, n, in, packed, dw, blocksize, table, y, out, threads);
}
void q8_0_rows_matmul_i8_amx(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                             const uint16_t *dw, float *y, int64_t out, float *maxima,
                             int threads) {
    q8_0_rows_matmul_i8_vnni(x, n, in, packed, dw, y, out, maxima, threads);
}
#endif  // SPECCHAT_AMX
#undef I8_512
#endif  // SPECCHAT_SIMD
