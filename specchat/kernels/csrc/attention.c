// Attention of a few query rows against one key/value head: for each query row r,
// out[r] = sum_j p_j v_j / sum_j p_j over the slots j that mask row (r % mask_rows) allows,
// p_j = exp(s_j - max s), s_j = scale * (q[r] . k_j), soft-capped where softcap > 0
// (softcap tanh(s_j / softcap), `softcap_of`: Gemma 2's). q [rows, dim] float32 (the query heads
// of this key/value head, packed head by head), k and v [slots, dim] with row strides in
// elements, float32 or bf16; mask [mask_rows, slots] bytes (1: attend), row stride mstride;
// scores [rows, slots] scratch. Each row runs alone, in slot order, whatever the other rows:
// a row's output is the same bits among any number of rows. Requires dim % 8 == 0.
//
// q . k_j is one 8-wide accumulator over the dims in order, then `hsum`; exp is specchat's own
// (`exp_or_zero`, common.h), the same bits on every CPU; the sum of the p_j is in slot order (a
// slot's place among the allowed ones, not its index, so a draft tree's row sums as the same
// path's chain row does); out[r][c] = (fma(p_j, v_j[c], acc) over the slots in order) / that sum,
// for each dim c alone.
#include "common.h"

// A row's softmax weights in place: s[j] = exp(s[j] - max) for the slots it sees (0 for the
// others), and their sum as above
static float softmax_ref(float *s, const uint8_t *allowed, int64_t slots) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t j = 0; j < slots; j++)
        if (allowed[j] && s[j] > top) top = s[j];
    for (int64_t j = 0; j < slots; j++) s[j] = allowed[j] ? exp_or_zero(s[j] - top) : 0.0f;
    for (int64_t j = 0; j < slots; j++) total += s[j];  // + 0 for the others: exact
    return total;
}

void attend_ref(const float *q, int64_t rows, int64_t dim, const void *k, const void *v,
                int64_t slots, int64_t kstride, int64_t vstride, int bf16, const uint8_t *mask,
                int64_t mask_rows, int64_t mstride, float scale, float softcap, float *scores,
                float *out, int threads) {
    if (!rows_ok(rows, dim, slots >= 0 && mask_rows > 0, 0, out)) return;
    const int64_t es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = q + r * dim;
        const uint8_t *allowed = mask + (r % mask_rows) * mstride;
        float *s = scores + r * slots;
        for (int64_t j = 0; j < slots; j++) {
            if (!allowed[j]) continue;
            const char *kj = (const char *)k + j * kstride * es;
            float acc[8] = {0};
            for (int64_t c = 0; c < dim; c += 8)
                for (int l = 0; l < 8; l++)
                    acc[l] = fmaf(qr[c + l], load1(kj, c + l, bf16), acc[l]);
            const float sj = sum_lanes8(acc) * scale;
            s[j] = softcap > 0.0f ? softcap_of(sj, softcap) : sj;
        }
        const float total = softmax_ref(s, allowed, slots);
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
// phases that read each key and each value once for up to ATTEND_ROWS rows, not once per row:
// the rows of a key/value head's grouped queries share its cache, and a decoding step's few
// rows are bound by reading it. Each phase splits work whose results do not depend on the
// split: the scores by group of rows and slot, the softmax by row, the weighted sums of the
// values by group of rows and 16 dimensions. Row counts and the cache's dtype are constants in
// each phase's inner loop (`scores_of`, `values_of` are inlined once per case), so its
// accumulators stay in registers.
#define ATTEND_ROWS 8  // rows a pass over a key takes (8 accumulators of 8 floats)
#define VALUE_ROWS 4   // rows a pass over a value takes, 16 dimensions each (8 accumulators)
#define FEW_GROUPS 2   // groups of ATTEND_ROWS rows whose queries share the L1 (16 KB at 256 dims)
#define FEW_VALUE_GROUPS 16  // groups of VALUE_ROWS rows: a verify of 16 tokens of 4 query heads

// scores[r][j] for the nr rows from r0 at slot j (the rows its mask rows allow)
static inline __attribute__((always_inline)) void scores_of(
    int nr, int bf16, const float *q, int64_t r0, int64_t dim, const char *kj,
    const uint8_t **masks, int64_t j, float scale, float softcap, float *scores,
    int64_t slots) {
    __m256 acc[ATTEND_ROWS];
    for (int i = 0; i < nr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < dim; c += 8) {
        const __m256 kv = load8(kj, c, bf16);
        for (int i = 0; i < nr; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (r0 + i) * dim + c), kv, acc[i]);
    }
    for (int i = 0; i < nr; i++)
        if (masks[r0 + i][j]) {
            const float sj = hsum(acc[i]) * scale;
            scores[(r0 + i) * slots + j] = softcap > 0.0f ? softcap_of(sj, softcap) : sj;
        }
}

// out[r][c .. c + 16) for the nr rows from r0: the slots' values weighted by the rows'
// probabilities, over the slots in order, each row's allowed slots only
static inline __attribute__((always_inline)) void values_of(
    int nr, int bf16, const void *v, int64_t vstride, int64_t slots, int64_t c, int64_t r0,
    const uint8_t **masks, const float *scores, const float *totals, int64_t dim, float *out) {
    const int64_t es = bf16 ? 2 : 4;
    __m256 acc[VALUE_ROWS][2];
    for (int i = 0; i < nr; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < slots; j++) {
        const char *vj = (const char *)v + j * vstride * es;
        const __m256 v0 = load8(vj, c, bf16), v1 = load8(vj, c + 8, bf16);
        for (int i = 0; i < nr; i++) {
            if (!masks[r0 + i][j]) continue;
            const __m256 p = _mm256_broadcast_ss(scores + (r0 + i) * slots + j);
            acc[i][0] = _mm256_fmadd_ps(p, v0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(p, v1, acc[i][1]);
        }
    }
    for (int i = 0; i < nr; i++) {
        const __m256 t = _mm256_set1_ps(totals[r0 + i]);
        _mm256_storeu_ps(out + (r0 + i) * dim + c, _mm256_div_ps(acc[i][0], t));
        _mm256_storeu_ps(out + (r0 + i) * dim + c + 8, _mm256_div_ps(acc[i][1], t));
    }
}

// out[r][c .. c + 8) for one row where the head dimension leaves 8 past the last 16
static void values_of8(int bf16, const void *v, int64_t vstride, int64_t slots, int64_t c,
                       const uint8_t *allowed, const float *s, float total, float *out) {
    const int64_t es = bf16 ? 2 : 4;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < slots; j++)
        if (allowed[j])
            acc = _mm256_fmadd_ps(_mm256_set1_ps(s[j]),
                                  load8((const char *)v + j * vstride * es, c, bf16), acc);
    _mm256_storeu_ps(out + c, _mm256_div_ps(acc, _mm256_set1_ps(total)));
}

// `softmax_ref`, its max and exp 8 slots at a time
static float softmax8(float *s, const uint8_t *allowed, int64_t slots) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256 none = _mm256_set1_ps(-__builtin_inff());
    __m256 mx = none;
    int64_t j = 0;
    for (; j + 8 <= slots; j += 8) {
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(allowed + j))), zero));
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(none, _mm256_loadu_ps(s + j), keep));
    }
    float top_lanes[8], top;
    _mm256_storeu_ps(top_lanes, mx);
    top = top_lanes[0];
    for (int l = 1; l < 8; l++) top = top_lanes[l] > top ? top_lanes[l] : top;
    for (int64_t t = j; t < slots; t++)
        if (allowed[t] && s[t] > top) top = s[t];
    const __m256 tv = _mm256_set1_ps(top);
    for (j = 0; j + 8 <= slots; j += 8) {
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(allowed + j))), zero));
        _mm256_storeu_ps(s + j, exp_or_zero8(_mm256_sub_ps(_mm256_loadu_ps(s + j), tv), keep));
    }
    for (; j < slots; j++) s[j] = allowed[j] ? exp_or_zero(s[j] - top) : 0.0f;
    float total = 0.0f;
    for (j = 0; j < slots; j++) total += s[j];
    return total;
}

#define ATTEND_CASE(NR, CALL) \
    case NR:                  \
        if (bf16)             \
            CALL(NR, 1);      \
        else                  \
            CALL(NR, 0);      \
        break;

void attend(const float *q, int64_t rows, int64_t dim, const void *k, const void *v,
            int64_t slots, int64_t kstride, int64_t vstride, int bf16, const uint8_t *mask,
            int64_t mask_rows, int64_t mstride, float scale, float softcap, float *scores,
            float *out, int threads) {
    if (!rows_ok(rows, dim, slots >= 0 && mask_rows > 0, 0, out)) return;
    const int64_t es = bf16 ? 2 : 4;
    float *totals = malloc(sizeof(float) * rows);
    // each row's mask row, found once: `r % mask_rows` is an integer division, which per
    // (row, slot) cost more than the row's dot product with the key
    const uint8_t **masks = malloc(sizeof(*masks) * rows);
    if (!totals || !masks) {  // no memory: NaN rows, which no caller can miss
        for (int64_t i = 0; i < rows * dim; i++) out[i] = __builtin_nanf("");
        free(totals);
        free(masks);
        return;
    }
    for (int64_t r = 0; r < rows; r++) masks[r] = mask + (r % mask_rows) * mstride;
    const int64_t groups = (rows + VALUE_ROWS - 1) / VALUE_ROWS, wide = dim / 16;
#pragma omp parallel num_threads(threads)
    {
        // a group of rows against every slot in turn: the group's queries stay in L1 while
        // the keys stream past (with the slots outer, every group's queries, 32 KB at 8 rows
        // of 4 query heads, were reread for each key)
        // A few groups (a verify's rows) go the other way round, each slot against every
        // group: each thread then reads its share of the keys once, where split by group each
        // read them all (the keys, not the queries, are what a decoding step waits for).
        const int64_t kgroups = (rows + ATTEND_ROWS - 1) / ATTEND_ROWS;
        const int slots_outer = kgroups <= FEW_GROUPS;
#pragma omp for schedule(static) collapse(2)
        for (int64_t a = 0; a < (slots_outer ? slots : kgroups); a++)
            for (int64_t b = 0; b < (slots_outer ? kgroups : slots); b++) {
                const int64_t j = slots_outer ? a : b, r0 = (slots_outer ? b : a) * ATTEND_ROWS;
                const char *kj = (const char *)k + j * kstride * es;
                const int nr = rows - r0 < ATTEND_ROWS ? (int)(rows - r0) : ATTEND_ROWS;
                int seen = 0;
                for (int i = 0; i < nr; i++) seen |= masks[r0 + i][j];
                if (!seen) continue;
#define SCORES(NR, BF16) \
    scores_of(NR, BF16, q, r0, dim, kj, masks, j, scale, softcap, scores, slots)
                switch (nr) {
                    ATTEND_CASE(1, SCORES) ATTEND_CASE(2, SCORES) ATTEND_CASE(3, SCORES)
                    ATTEND_CASE(4, SCORES) ATTEND_CASE(5, SCORES) ATTEND_CASE(6, SCORES)
                    ATTEND_CASE(7, SCORES) ATTEND_CASE(8, SCORES)
                }
#undef SCORES
            }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            totals[r] = softmax8(scores + r * slots, masks[r], slots);
        // A verify's groups go dimensions outer: each thread takes a share of the dimensions
        // for every group, so it reads its share of the values once, a group after another
        // from its cache (split by group, each thread read every value). A prompt's many
        // groups stay split by group, each group's probabilities in the L1.
        const int dims_outer = groups <= FEW_VALUE_GROUPS;
#pragma omp for schedule(static) collapse(2)
        for (int64_t a = 0; a < (dims_outer ? wide : groups); a++)
            for (int64_t b = 0; b < (dims_outer ? groups : wide); b++) {
                const int64_t g = dims_outer ? b : a, w = dims_outer ? a : b;
                const int64_t r0 = g * VALUE_ROWS, c = 16 * w;
                const int nr = rows - r0 < VALUE_ROWS ? (int)(rows - r0) : VALUE_ROWS;
#define VALUES(NR, BF16) \
    values_of(NR, BF16, v, vstride, slots, c, r0, masks, scores, totals, dim, out)
                switch (nr) {
                    ATTEND_CASE(1, VALUES) ATTEND_CASE(2, VALUES) ATTEND_CASE(3, VALUES)
                    ATTEND_CASE(4, VALUES)
                }
#undef VALUES
            }
        if (dim % 16) {  // the last 8 dimensions
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                values_of8(bf16, v, vstride, slots, dim - 8, masks[r], scores + r * slots,
                           totals[r], out + r * dim);
        }
    }
    free(totals);
    free(masks);
}
#undef ATTEND_CASE
#endif  // SPECCHAT_SIMD
