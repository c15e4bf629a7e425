// Attention of a few query rows against one key/value head: for each query row r,
// out[r] = sum_j p_j v_j / sum_j p_j over the slots j that mask row (r % mask_rows) allows,
// p_j = exp(s_j - max s), s_j = scale * (q[r] . k_j). q [rows, dim] float32 (the query heads
// of this key/value head, packed head by head), k and v [slots, dim] with row strides in
// elements, float32 or bf16; mask [mask_rows, slots] bytes (1: attend), row stride mstride;
// scores [rows, slots] scratch. Each row runs alone, in slot order, whatever the other rows:
// a row's output is the same bits among any number of rows. Requires dim % 8 == 0.
//
// q . k_j is one 8-wide accumulator over the dims in order, then `hsum`; exp is libm's expf;
// the sum of the p_j is in slot order; out[r][c] = (fma(p_j, v_j[c], acc) over the slots in
// order) / that sum, for each dim c alone.
#include "common.h"

void attend_ref(const float *q, int64_t rows, int64_t dim, const void *k, const void *v,
                int64_t slots, int64_t kstride, int64_t vstride, int bf16, const uint8_t *mask,
                int64_t mask_rows, int64_t mstride, float scale, float *scores, float *out,
                int threads) {
    if (!rows_ok(rows, dim, slots >= 0 && mask_rows > 0, 0, out)) return;
    const int64_t es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = q + r * dim;
        const uint8_t *allowed = mask + (r % mask_rows) * mstride;
        float *s = scores + r * slots, top = -INFINITY;
        for (int64_t j = 0; j < slots; j++) {
            if (!allowed[j]) continue;
            const char *kj = (const char *)k + j * kstride * es;
            float acc[8] = {0};
            for (int64_t c = 0; c < dim; c += 8)
                for (int l = 0; l < 8; l++)
                    acc[l] = fmaf(qr[c + l], load1(kj, c + l, bf16), acc[l]);
            s[j] = sum_lanes8(acc) * scale;
            if (s[j] > top) top = s[j];
        }
        float total = 0.0f;
        for (int64_t j = 0; j < slots; j++)
            if (allowed[j]) total += s[j] = expf(s[j] - top);
        float *o = out + r * dim;  // one accumulator per dim (a lane of the kernel's), here
        for (int64_t c = 0; c < dim; c++) o[c] = 0.0f;
        for (int64_t j = 0; j < slots; j++) {
            if (!allowed[j]) continue;
            const char *vj = (const char *)v + j * vstride * es;
            for (int64_t c = 0; c < dim; c++) o[c] = fmaf(s[j], load1(vj, c, bf16), o[c]);
        }
        for (int64_t c = 0; c < dim; c++) o[c] /= total;
    }
}

#if SPECCHAT_SIMD
// The same arithmetic for every (row, slot) and every (row, dim) as the reference, in three
// phases that read each key and each value once for all rows, not once per row: the rows of a
// key/value head's grouped queries share its cache, and a decoding step's few rows are bound by
// reading it. Each phase splits work whose results do not depend on the split: the scores by
// slot (up to ATTEND_ROWS rows a pass over a key), the softmax by row, the weighted sums of the
// values by 64 dimensions.
#define ATTEND_ROWS 4

void attend(const float *q, int64_t rows, int64_t dim, const void *k, const void *v,
            int64_t slots, int64_t kstride, int64_t vstride, int bf16, const uint8_t *mask,
            int64_t mask_rows, int64_t mstride, float scale, float *scores, float *out,
            int threads) {
    if (!rows_ok(rows, dim, slots >= 0 && mask_rows > 0, 0, out)) return;
    const int64_t es = bf16 ? 2 : 4;
    float *totals = malloc(sizeof(float) * rows);
    if (!totals) {  // no memory: NaN rows, which no caller can miss
        for (int64_t i = 0; i < rows * dim; i++) out[i] = __builtin_nanf("");
        return;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < slots; j++) {
            const char *kj = (const char *)k + j * kstride * es;
            for (int64_t r0 = 0; r0 < rows; r0 += ATTEND_ROWS) {
                const int nr = rows - r0 < ATTEND_ROWS ? (int)(rows - r0) : ATTEND_ROWS;
                int seen = 0;
                for (int i = 0; i < nr; i++) seen |= mask[((r0 + i) % mask_rows) * mstride + j];
                if (!seen) continue;
                __m256 acc[ATTEND_ROWS];
                for (int i = 0; i < nr; i++) acc[i] = _mm256_setzero_ps();
                for (int64_t c = 0; c < dim; c += 8) {
                    const __m256 kv = load8(kj, c, bf16);
                    for (int i = 0; i < nr; i++)
                        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (r0 + i) * dim + c), kv,
                                                 acc[i]);
                }
                for (int i = 0; i < nr; i++)
                    if (mask[((r0 + i) % mask_rows) * mstride + j])
                        scores[(r0 + i) * slots + j] = hsum(acc[i]) * scale;
            }
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *allowed = mask + (r % mask_rows) * mstride;
            float *s = scores + r * slots, top = -__builtin_inff(), total = 0.0f;
            for (int64_t j = 0; j < slots; j++)
                if (allowed[j] && s[j] > top) top = s[j];
            for (int64_t j = 0; j < slots; j++)
                if (allowed[j]) total += s[j] = expf(s[j] - top);
            totals[r] = total;
        }
#pragma omp for schedule(static) collapse(2)
        for (int64_t c = 0; c < dim; c += 64)  // 8 accumulators of 8 dims each
            for (int64_t r = 0; r < rows; r++) {
                const uint8_t *allowed = mask + (r % mask_rows) * mstride;
                const float *s = scores + r * slots;
                const int nv = dim - c >= 64 ? 8 : (int)(dim - c) / 8;
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
                const __m256 t = _mm256_set1_ps(totals[r]);
                for (int u = 0; u < nv; u++)
                    _mm256_storeu_ps(out + r * dim + c + 8 * u, _mm256_div_ps(acc[u], t));
            }
    }
    free(totals);
}
#endif  // SPECCHAT_SIMD
