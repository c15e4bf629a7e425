// Gemma's RMSNorm over n rows of dim values, float32 or bf16 in and out:
// y = x * rsqrt(mean(x^2) + eps) * w1 in float32 (w1 = 1 + weight), rounded to bf16 for bf16.
// One thread, each row alone: a row's result is the same bits among any number of rows.
// Requires dim % 8 == 0.
//
// The sum of squares is one 8-wide accumulator over the row in order, then `hsum`; then
// scale = 1 / sqrtf(sum / dim + eps), y[c] = (x[c] * scale) * w1[c].
#include "common.h"

void rms_norm_ref(const void *x, int64_t n, int64_t dim, int bf16, const float *w1, float eps,
                  void *y) {
    if (!rows_ok(n, dim, 1, bf16, y)) return;
    for (int64_t r = 0; r < n; r++) {
        const char *xr = (const char *)x + r * dim * (bf16 ? 2 : 4);
        float acc[8] = {0};
        for (int64_t c = 0; c < dim; c += 8)
            for (int l = 0; l < 8; l++) {
                const float v = load1(xr, c + l, bf16);
                acc[l] = fmaf(v, v, acc[l]);
            }
        const float scale = 1.0f / sqrtf(sum_lanes8(acc) / (float)dim + eps);
        for (int64_t c = 0; c < dim; c++) {
            const float out = load1(xr, c, bf16) * scale * w1[c];
            if (bf16)
                ((uint16_t *)y)[r * dim + c] = to_bf16(out);
            else
                ((float *)y)[r * dim + c] = out;
        }
    }
}

#if SPECCHAT_SIMD
void rms_norm(const void *x, int64_t n, int64_t dim, int bf16, const float *w1, float eps,
              void *y) {
    if (!rows_ok(n, dim, 1, bf16, y)) return;
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
#endif  // SPECCHAT_SIMD
