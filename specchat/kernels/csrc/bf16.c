// bf16 weights [out, in], widened exactly to float32. Requires in % 8 == 0.
//
// y[j, o] = hsum(acc), acc = fma(w, x[j], acc) over the row in order, 8 wide (`tile`).
#include "common.h"

int max_in(void) { return MAX_IN; }  // the longest weight row the kernels take

void bf16_matmul_ref(const float *x, int64_t n, int64_t in, const uint16_t *weight, float *y,
                     int64_t out, int threads) {
    if (!sizes_ok(n, in, out, 8, 0, y)) return;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < out; o++)
        for (int64_t j = 0; j < n; j++) {
            const uint16_t *w = weight + o * in;
            const float *xj = x + j * in;
            float acc[8] = {0};
            for (int64_t k = 0; k < in; k += 8)
                for (int l = 0; l < 8; l++)
                    acc[l] = fmaf(bf16_to_float(w[k + l]), xj[k + l], acc[l]);
            y[j * out + o] = sum_lanes8(acc);
        }
}

#if SPECCHAT_SIMD
void bf16_matmul(const float *x, int64_t n, int64_t in, const uint16_t *weight, float *y,
                 int64_t out, int threads) {
    if (!sizes_ok(n, in, out, 8, MAX_IN, y)) return;
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
#endif  // SPECCHAT_SIMD
