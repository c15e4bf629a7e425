// Products y[n, O] = x[n, I] @ W^T on x86 CPUs with AVX2 + FMA, for weights kept compact:
// bitsandbytes' NF4 (4-bit codes, a float scale per block) and bf16. Compiled by
// specchat/cpu_kernels.py on first use; called through ctypes with torch tensors' pointers.
//
// Each output y[j, o] is computed by the same instructions in the same order whatever n is:
// W's row o is decoded to float32 (exactly the value bitsandbytes' dequantize gives), then
// dotted with x's row j in one 8-wide accumulator over the row in order, then summed in a
// fixed order. So a row's result is the same bits alone or among any number of rows, which
// is what keeps greedy speculative decoding identical to plain greedy decoding.
#include <immintrin.h>
#include <stdint.h>
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
// one row) scaled by its absmax. Requires in % blocksize == 0 and blocksize % 8 == 0.
void nf4_matmul(const float *x, int64_t n, int64_t in, const uint8_t *codes,
                const float *absmax, int64_t blocksize, const float *table, float *y,
                int64_t out, int threads) {
    const __m256 lo = _mm256_loadu_ps(table), hi = _mm256_loadu_ps(table + 8);
    const __m256i shifts = _mm256_setr_epi32(4, 0, 12, 8, 20, 16, 28, 24);
    const __m256i nibble = _mm256_set1_epi32(15);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o0 = 0; o0 < out; o0 += OUT_TILE) {
        float w[OUT_TILE * MAX_IN] __attribute__((aligned(32)));
        int no = out - o0 < OUT_TILE ? (int)(out - o0) : OUT_TILE;
        for (int64_t e = o0 * in; e < (o0 + no) * in; e += blocksize) {
            const __m256 scale = _mm256_set1_ps(absmax[e / blocksize]);
            for (int64_t c = e; c < e + blocksize; c += 8) {
                uint32_t four;
                memcpy(&four, codes + c / 2, 4);
                __m256i idx = _mm256_and_si256(
                    _mm256_srlv_epi32(_mm256_set1_epi32((int)four), shifts), nibble);
                __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx),
                                            _mm256_permutevar8x32_ps(hi, idx),
                                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
                _mm256_store_ps(w + (c - o0 * in), _mm256_mul_ps(v, scale));
            }
        }
        rows(no, w, x, n, in, y + o0, out);
    }
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

// GGUF Q8_0 weights [out, in] as int8 values q and one float32 scale d per 32 values (the
// file's fp16 scales, widened exactly): W = q * d, which float32 holds exactly (a 7-bit integer
// times an 11-bit mantissa). Half the bytes of bf16. Requires in % 32 == 0.
void q8_0_matmul(const float *x, int64_t n, int64_t in, const int8_t *q, const float *d,
                 float *y, int64_t out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o0 = 0; o0 < out; o0 += OUT_TILE) {
        float w[OUT_TILE * MAX_IN] __attribute__((aligned(32)));
        int no = out - o0 < OUT_TILE ? (int)(out - o0) : OUT_TILE;
        for (int64_t c = 0; c < no * in; c += 32) {
            const __m256 scale = _mm256_set1_ps(d[(o0 * in + c) / 32]);
            for (int64_t e = c; e < c + 32; e += 8) {
                __m256i v = _mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(q + o0 * in + e)));
                _mm256_store_ps(w + e, _mm256_mul_ps(_mm256_cvtepi32_ps(v), scale));
            }
        }
        rows(no, w, x, n, in, y + o0, out);
    }
}
