// A decoder stack in one call: every layer of the model for n rows (tokens), from their
// embeddings to the final norm's output, writing each row's keys and values into the KV cache.
// It is the model's forward as transformers computes it, layer for layer, for the families that
// `runners.family` declares (Gemma 2 and 3; Llama, Mistral, Qwen 2 and 3, SmolLM):
//
//   x = norm(h); q, k, v = x Wq (+ bq), x Wk (+ bk), x Wv (+ bv); [q, k normed per head];
//   RoPE at the row's position; k, v written at the row's slot; a = attention(q, the cache);
//   h += [norm](a Wo); x = norm(h); h += [norm]((act(x Wg) * x Wu) Wd);   then norm(h).
//
// The bracketed steps are a family's: a NULL norm or bias is skipped (Gemma 3 has every norm,
// Qwen 3 the per-head ones, Llama none of them), the attention's scores are soft-capped where
// `softcap` is set (Gemma 2), and `act` is gelu with tanh's approximation
// (Gemma) or SiLU (the Llama family). NF4 weights are bitsandbytes' codes and block scales
// (nf4.c, nf4_i8.c), the norms RMSNorm's (norms.c), the attention attention.c's. The Python
// around a forward of transformers' modules costs more than the arithmetic for one token of a
// small model (hundreds of torch calls a step); here a step is one call.
//
// Row-exact: every product, norm and attention computes a row alone (see the kernels), and the
// elementwise steps (biases, RoPE, the activation, the residual adds) are per value. So a row's
// features, keys and values are the same bits whatever rows were fed with it, and a prompt's
// page, a verify's chain, a draft tree's node and a one-token step give a token the same logits.
//
// The cache: keys and values [layers, kv_heads, slots, head_dim] in float32; the fed rows go to
// slots start .. start + n - 1. A cached slot j (j < start) holds the token at position j. Row
// r, at position pos[r], attends to the cached slots its layer's window holds (pos[r] - j <
// window; every slot in full-attention layers) and to the fed rows `visible` allows (row-major
// [n, n] bytes, 1: attend; NULL: rows 0..r, a chain), within the window too.
//
// `clock`, where not NULL, gains the seconds spent in each part of the forward (`CLOCK_ROWS`):
// `bench --profile` reads it.
//
// Two functions over the same code: `decoder_forward` on the SIMD kernels (SIMD build) and
// `decoder_forward_ref` on their references, which compute the same bits.
#include "common.h"

#include <time.h>

// the parts `clock` times: products, attention (RoPE, cache writes and masks included), norms,
// the MLP's activation, and the rest (residual adds, buffers)
enum { CLOCK_PRODUCTS, CLOCK_ATTENTION, CLOCK_NORMS, CLOCK_ACTIVATION, CLOCK_REST, CLOCK_ROWS };

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// Charges the time since the last mark to part `row` (when timing).
#define MARK(row)                            \
    do {                                     \
        if (clock) {                         \
            const double t_ = seconds();     \
            clock[row] += t_ - last;         \
            last = t_;                       \
        }                                    \
    } while (0)

typedef void (*nf4_fn)(const float *, int64_t, int64_t, const uint8_t *, const float *, int64_t,
                       const float *, float *, int64_t, int);
typedef void (*attend_fn)(const float *, int64_t, int64_t, const void *, const void *, int64_t,
                          int64_t, int64_t, int, const uint8_t *, int64_t, int64_t, float,
                          float, float *, float *, int);
typedef void (*norm_fn)(const void *, int64_t, int64_t, int, const float *, float, void *);

typedef struct {
    nf4_fn nf4;
    attend_fn attend;
    norm_fn norm;
    void (*gelu_mul)(float *, const float *, int64_t);
    void (*silu_mul)(float *, const float *, int64_t);
} kernels;

// nf4_weight, decoder_layer and decoder_model: specchat.h (the ABI shared with Python)

// x [n, d] in place: RoPE of each head of `heads` at its row's position, transformers' way
// (rotate_half): with c, s the tables' values, the first half x1 c - x2 s, the second x2 c + x1 s.
static void rope(float *x, int64_t n, int64_t heads, int64_t d, const int64_t *pos,
                 const float *cos, const float *sin) {
    const int64_t half = d / 2;
    for (int64_t r = 0; r < n; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + (r * heads + h) * d;
            const float *c = cos + pos[r] * d, *s = sin + pos[r] * d;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = v[i], x2 = v[i + half];
                v[i] = x1 * c[i] - x2 * s[i];
                v[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
}

// gelu with tanh's approximation times up, into g: g = 0.5 g (1 + tanh(y)) u, y = 0.7978845608
// (g + 0.044715 g^3), with tanh(y) = 1 - 2 / (e^2y + 1) and e^z specchat's own (`exp_core`,
// common.h). libm's tanhf alone took a
// tenth of a step (36,864 values a token on the embedded target); the SIMD build computes 8 at
// once with the same operations in the same order as `gelu_mul_ref`, so the same bits.
#define GELU_CLAMP 9.0f  // |2y| beyond this: tanh is +-1 in float32 (e^18 > 2^24 / 2)
static inline float gelu_ref(float x, float u) {
    float y2 = 2.0f * (0.7978845608028654f * (x + 0.044715f * (x * x * x)));
    y2 = y2 > 2.0f * GELU_CLAMP ? 2.0f * GELU_CLAMP : y2 < -2.0f * GELU_CLAMP ? -2.0f * GELU_CLAMP
                                                                              : y2;
    const float t = 1.0f - 2.0f / (exp_core(y2) + 1.0f);
    return 0.5f * x * (1.0f + t) * u;
}

static void gelu_mul_ref(float *g, const float *u, int64_t count) {
    for (int64_t i = 0; i < count; i++) g[i] = gelu_ref(g[i], u[i]);
}

#if SPECCHAT_SIMD
static void gelu_mul(float *g, const float *u, int64_t count) {
    const __m256 lim = _mm256_set1_ps(2.0f * GELU_CLAMP), one = _mm256_set1_ps(1.0f);
    const __m256 two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        __m256 y2 = _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube));
        y2 = _mm256_mul_ps(two, _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), y2));
        y2 = _mm256_max_ps(_mm256_min_ps(y2, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
        const __m256 e = exp_core8(y2);
        const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
        const __m256 out = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(half, x),
                                                       _mm256_add_ps(one, t)),
                                         _mm256_loadu_ps(u + i));
        _mm256_storeu_ps(g + i, out);
    }
    for (; i < count; i++) g[i] = gelu_ref(g[i], u[i]);
}
#endif

// SiLU of g times up, into g: g = g / (1 + e^-g) u, with e^z specchat's own (`exp_core`, z
// clamped to its range: beyond it the quotient is g or 0 in float32 alike). The SIMD build
// computes 8 at once by the same operations in the same order as `silu_mul_ref`: the same bits.
#define SILU_HIGH 88.0f
static inline float silu_ref(float x, float u) {
    float z = -x;
    z = z > SILU_HIGH ? SILU_HIGH : z < EXP_MIN ? EXP_MIN : z;
    return x / (1.0f + exp_core(z)) * u;
}

static void silu_mul_ref(float *g, const float *u, int64_t count) {
    for (int64_t i = 0; i < count; i++) g[i] = silu_ref(g[i], u[i]);
}

#if SPECCHAT_SIMD
static void silu_mul(float *g, const float *u, int64_t count) {
    const __m256 high = _mm256_set1_ps(SILU_HIGH), low = _mm256_set1_ps(EXP_MIN);
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        __m256 z = _mm256_sub_ps(_mm256_setzero_ps(), x);
        z = _mm256_max_ps(_mm256_min_ps(z, high), low);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp_core8(z)));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < count; i++) g[i] = silu_ref(g[i], u[i]);
}
#endif

// The rows of the residual stream h [n, hidden] entering layer `l` into their places in
// m->aux_out, for each aux entry that names it
static void keep_aux(const decoder_model *m, const float *h, int64_t n, int64_t l) {
    const int64_t hd = m->hidden, stride = m->n_aux * hd;
    for (int64_t a = 0; a < m->n_aux; a++)
        if (m->aux[a] == l)
            for (int64_t r = 0; r < n; r++)
                memcpy(m->aux_out + r * stride + a * hd, h + r * hd, sizeof(float) * hd);
}

static void add(float *h, const float *x, int64_t count) {
    for (int64_t i = 0; i < count; i++) h[i] += x[i];
}

// y [n, out] = x W.T (+ the bias, added to each row's sums as torch's addition of it does)
static void product(const kernels *f, const decoder_model *m, const nf4_weight *w,
                    const float *x, int64_t n, float *y, int threads) {
    f->nf4(x, n, w->in, w->codes, w->absmax, m->blocksize, m->table, y, w->out, threads);
    if (w->bias)
        for (int64_t r = 0; r < n; r++) add(y + r * w->out, w->bias, w->out);
}

// The attention mask of one window for the n fed rows over slots lo .. start + n - 1:
// mask[r * width + (j - lo)], width = start + n - lo.
static void fill_mask(uint8_t *mask, int64_t lo, int64_t width, int64_t n, int64_t start,
                      const int64_t *pos, const uint8_t *visible, int64_t window) {
    for (int64_t r = 0; r < n; r++) {
        uint8_t *row = mask + r * width;
        for (int64_t j = lo; j < start; j++) row[j - lo] = !window || pos[r] - j < window;
        for (int64_t i = 0; i < n; i++) {
            const int seen = visible ? visible[r * n + i] != 0 : i <= r;
            row[start + i - lo] = seen && (!window || pos[r] - pos[i] < window);
        }
    }
}

// Norms and the activation over a forward's rows, split by row between the threads where the
// rows are many enough to pay for the split (a verify's, a prompt's; one token's stay on one
// thread). Each row is computed alone, so the split changes no bit.
#define SPLIT_VALUES 4096  // values a call must hold to be split (4096 beat 8192 at 4-16 rows)

static void norm_rows(const kernels *f, const float *x, int64_t n, int64_t dim, const float *w,
                      float eps, float *y, int threads) {
    if (n * dim < SPLIT_VALUES || threads < 2) {
        f->norm(x, n, dim, 0, w, eps, y);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) f->norm(x + r * dim, 1, dim, 0, w, eps, y + r * dim);
}

static void act_rows(const kernels *f, int64_t act, float *g, const float *u, int64_t n,
                     int64_t inter, int threads) {
    void (*mul)(float *, const float *, int64_t) = act == ACT_SILU ? f->silu_mul : f->gelu_mul;
    if (n * inter < SPLIT_VALUES || threads < 2) {
        mul(g, u, n * inter);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) mul(g + r * inter, u + r * inter, inter);
}

// 0 when done; -1 when out of memory (nothing in `out` is then valid)
static int forward(const kernels *f, const decoder_model *m, const float *embeddings, int64_t n,
                   const int64_t *pos, int64_t start, const uint8_t *visible, float *k_cache,
                   float *v_cache, int64_t slots, const float *const *rope_tables, float *out,
                   double *clock, int threads) {
    double last = clock ? seconds() : 0.0;
    const int64_t d = m->head_dim, hd = m->hidden, nq = m->heads * d, nkv = m->kv_heads * d;
    const int64_t groups = m->heads / m->kv_heads, width = start + n;
    // a row of the model's width or the query heads', whichever is wider (Gemma 3 1B: 1152
    // against 4 x 256): x holds normed inputs and the attention's output, q the queries and the
    // outputs of the o and down products
    const int64_t row = hd > nq ? hd : nq;
    float *h = malloc(sizeof(float) * n * hd);  // the residual stream
    float *x = malloc(sizeof(float) * n * row);
    float *q = malloc(sizeof(float) * n * row), *k = malloc(sizeof(float) * n * nkv);
    float *v = malloc(sizeof(float) * n * nkv);
    float *packed = malloc(sizeof(float) * n * nq), *att = malloc(sizeof(float) * n * nq);
    float *g = malloc(sizeof(float) * n * m->inter), *u = malloc(sizeof(float) * n * m->inter);
    float *scores = malloc(sizeof(float) * groups * n * width);
    uint8_t *masks[2] = {malloc((size_t)(n * width)), malloc((size_t)(n * width))};
    int64_t lows[2] = {0, 0}, windows[2] = {0, 0};
    int failed = !h || !x || !q || !k || !v || !packed || !att || !g || !u || !scores
                 || !masks[0] || !masks[1];
    if (failed) goto done;
    MARK(CLOCK_REST);
    memcpy(h, embeddings, sizeof(float) * n * hd);
    // mask 0: full attention; mask 1: the sliding window (one size per model)
    for (int64_t l = 0; l < m->layers; l++)
        if (m->layer[l].window) windows[1] = m->layer[l].window;
    for (int w = 0; w < 2; w++) {
        int64_t lo = start;  // no row sees a cached slot below the lowest row's window
        for (int64_t r = 0; r < n && windows[w]; r++) {
            const int64_t first = pos[r] - windows[w] + 1;
            if (first < lo) lo = first < 0 ? 0 : first;
        }
        lows[w] = windows[w] ? lo : 0;
        fill_mask(masks[w], lows[w], width - lows[w], n, start, pos, visible, windows[w]);
    }
    MARK(CLOCK_ATTENTION);
    for (int64_t l = 0; l < m->layers; l++) {
        const decoder_layer *L = m->layer + l;
        const int w = L->window ? 1 : 0;
        keep_aux(m, h, n, l);
        norm_rows(f, h, n, hd, L->attn_norm, m->eps, x, threads);
        MARK(CLOCK_NORMS);
        product(f, m, &L->q, x, n, q, threads);
        product(f, m, &L->k, x, n, k, threads);
        product(f, m, &L->v, x, n, v, threads);
        MARK(CLOCK_PRODUCTS);
        if (L->q_norm) norm_rows(f, q, n * m->heads, d, L->q_norm, m->eps, q, threads);
        if (L->k_norm) norm_rows(f, k, n * m->kv_heads, d, L->k_norm, m->eps, k, threads);
        MARK(CLOCK_NORMS);
        rope(q, n, m->heads, d, pos, rope_tables[2 * L->rope], rope_tables[2 * L->rope + 1]);
        rope(k, n, m->kv_heads, d, pos, rope_tables[2 * L->rope], rope_tables[2 * L->rope + 1]);
        for (int64_t kh = 0; kh < m->kv_heads; kh++) {
            float *kc = k_cache + ((l * m->kv_heads + kh) * slots) * d;
            float *vc = v_cache + ((l * m->kv_heads + kh) * slots) * d;
            for (int64_t r = 0; r < n; r++) {
                memcpy(kc + (start + r) * d, k + (r * m->kv_heads + kh) * d, sizeof(float) * d);
                memcpy(vc + (start + r) * d, v + (r * m->kv_heads + kh) * d, sizeof(float) * d);
            }
            // this key/value head's query heads, packed head by head: [groups * n, d]
            for (int64_t gq = 0; gq < groups; gq++)
                for (int64_t r = 0; r < n; r++)
                    memcpy(packed + (gq * n + r) * d, q + (r * m->heads + kh * groups + gq) * d,
                           sizeof(float) * d);
            const int64_t lo = lows[w];
            f->attend(packed, groups * n, d, kc + lo * d, vc + lo * d, width - lo, d, d, 0,
                      masks[w], n, width - lo, m->scale, m->softcap, scores, att, threads);
            for (int64_t gq = 0; gq < groups; gq++)
                for (int64_t r = 0; r < n; r++)
                    memcpy(x + (r * m->heads + kh * groups + gq) * d, att + (gq * n + r) * d,
                           sizeof(float) * d);
        }
        MARK(CLOCK_ATTENTION);
        product(f, m, &L->o, x, n, q, threads);  // q's buffer is free again: [n, hidden]
        MARK(CLOCK_PRODUCTS);
        if (L->post_attn_norm) norm_rows(f, q, n, hd, L->post_attn_norm, m->eps, q, threads);
        MARK(CLOCK_NORMS);
        add(h, q, n * hd);
        MARK(CLOCK_REST);
        norm_rows(f, h, n, hd, L->mlp_norm, m->eps, x, threads);
        MARK(CLOCK_NORMS);
        product(f, m, &L->gate, x, n, g, threads);
        product(f, m, &L->up, x, n, u, threads);
        MARK(CLOCK_PRODUCTS);
        act_rows(f, m->act, g, u, n, m->inter, threads);
        MARK(CLOCK_ACTIVATION);
        product(f, m, &L->down, g, n, q, threads);
        MARK(CLOCK_PRODUCTS);
        if (L->post_mlp_norm) norm_rows(f, q, n, hd, L->post_mlp_norm, m->eps, q, threads);
        MARK(CLOCK_NORMS);
        add(h, q, n * hd);
        MARK(CLOCK_REST);
    }
    keep_aux(m, h, n, m->layers);
    norm_rows(f, h, n, hd, m->final_norm, m->eps, out, threads);
    MARK(CLOCK_NORMS);
done:
    free(h), free(x), free(q), free(k), free(v), free(packed), free(att), free(g), free(u);
    free(scores), free(masks[0]), free(masks[1]);
    MARK(CLOCK_REST);
    return failed ? -1 : 0;
}

int decoder_forward_ref(const decoder_model *m, const float *embeddings, int64_t n,
                        const int64_t *pos, int64_t start, const uint8_t *visible,
                        float *k_cache, float *v_cache, int64_t slots,
                        const float *const *rope_tables, float *out, double *clock,
                        int threads) {
    const kernels f = {nf4_matmul_ref, attend_ref, rms_norm_ref, gelu_mul_ref, silu_mul_ref};
    return forward(&f, m, embeddings, n, pos, start, visible, k_cache, v_cache, slots,
                   rope_tables, out, clock, threads);
}

// The same stack on the 16-wide NF4 product (nf4.c), the "avx512" variant's, and its reference
int decoder_forward16_ref(const decoder_model *m, const float *embeddings, int64_t n,
                          const int64_t *pos, int64_t start, const uint8_t *visible,
                          float *k_cache, float *v_cache, int64_t slots,
                          const float *const *rope_tables, float *out, double *clock,
                          int threads) {
    const kernels f = {nf4_matmul16_ref, attend_ref, rms_norm_ref, gelu_mul_ref, silu_mul_ref};
    return forward(&f, m, embeddings, n, pos, start, visible, k_cache, v_cache, slots,
                   rope_tables, out, clock, threads);
}

// The stack on the integer NF4 product (nf4_i8.c; the weights packed by `nf4_i8_pack`)
int decoder_forward_i8_ref(const decoder_model *m, const float *embeddings, int64_t n,
                           const int64_t *pos, int64_t start, const uint8_t *visible,
                           float *k_cache, float *v_cache, int64_t slots,
                           const float *const *rope_tables, float *out, double *clock,
                           int threads) {
    const kernels f = {nf4_matmul_i8_ref, attend_ref, rms_norm_ref, gelu_mul_ref, silu_mul_ref};
    return forward(&f, m, embeddings, n, pos, start, visible, k_cache, v_cache, slots,
                   rope_tables, out, clock, threads);
}

#if SPECCHAT_SIMD
int decoder_forward_i8_avx2(const decoder_model *m, const float *embeddings, int64_t n,
                            const int64_t *pos, int64_t start, const uint8_t *visible,
                            float *k_cache, float *v_cache, int64_t slots,
                            const float *const *rope_tables, float *out, double *clock,
                            int threads) {
    const kernels f = {nf4_matmul_i8_avx2, attend, rms_norm, gelu_mul, silu_mul};
    return forward(&f, m, embeddings, n, pos, start, visible, k_cache, v_cache, slots,
                   rope_tables, out, clock, threads);
}

int decoder_forward_i8_avxvnni(const decoder_model *m, const float *embeddings, int64_t n,
                               const int64_t *pos, int64_t start, const uint8_t *visible,
                               float *k_cache, float *v_cache, int64_t slots,
                               const float *const *rope_tables, float *out, double *clock,
                               int threads) {
    const kernels f = {nf4_matmul_i8_avxvnni, attend, rms_norm, gelu_mul, silu_mul};
    return forward(&f, m, embeddings, n, pos, start, visible, k_cache, v_cache, slots,
                   rope_tables, out, clock, threads);
}

int decoder_forward_i8_vnni(const decoder_model *m, const float *embeddings, int64_t n,
                            const int64_t *pos, int64_t start, const uint8_t *visible,
                            float *k_cache, float *v_cache, int64_t slots,
                            const float *const *rope_tables, float *out, double *clock,
                            int threads) {
    const kernels f = {nf4_matmul_i8_vnni, attend, rms_norm, gelu_mul, silu_mul};
    return forward(&f, m, embeddings, n, pos, start, visible, k_cache, v_cache, slots,
                   rope_tables, out, clock, threads);
}

int decoder_forward_i8_amx(const decoder_model *m, const float *embeddings, int64_t n,
                           const int64_t *pos, int64_t start, const uint8_t *visible,
                           float *k_cache, float *v_cache, int64_t slots,
                           const float *const *rope_tables, float *out, double *clock,
                           int threads) {
    const kernels f = {nf4_matmul_i8_amx, attend, rms_norm, gelu_mul, silu_mul};
    return forward(&f, m, embeddings, n, pos, start, visible, k_cache, v_cache, slots,
                   rope_tables, out, clock, threads);
}

int decoder_forward(const decoder_model *m, const float *embeddings, int64_t n,
                    const int64_t *pos, int64_t start, const uint8_t *visible, float *k_cache,
                    float *v_cache, int64_t slots, const float *const *rope_tables, float *out,
                    double *clock, int threads) {
    const kernels f = {nf4_matmul, attend, rms_norm, gelu_mul, silu_mul};
    return forward(&f, m, embeddings, n, pos, start, visible, k_cache, v_cache, slots,
                   rope_tables, out, clock, threads);
}

int decoder_forward_avx512(const decoder_model *m, const float *embeddings, int64_t n,
                           const int64_t *pos, int64_t start, const uint8_t *visible,
                           float *k_cache, float *v_cache, int64_t slots,
                           const float *const *rope_tables, float *out, double *clock,
                           int threads) {
    const kernels f = {nf4_matmul_avx512, attend, rms_norm, gelu_mul, silu_mul};
    return forward(&f, m, embeddings, n, pos, start, visible, k_cache, v_cache, slots,
                   rope_tables, out, clock, threads);
}
#endif

// The rows of an embedding table for n token ids, each value times `scale`, in float32: the
// decoder's input without a torch call (a one-token step's Python around its forward costs more
// than this copy). `kind` says how the model's embedding computes it:
//   EMBED_F32         a float32 table, one float32 product;
//   EMBED_BF16_WIDE   a bf16 table widened to float32 (exact), one float32 product (a float32
//                     model keeping its table in bf16: `runners.hf.cpu._WideEmbedding`);
//   EMBED_BF16        a bf16 table scaled as torch scales bf16 values: the product of two bf16
//                     values (exact in float32) rounded to bf16, to nearest even.
// `runners.cpu.runner` takes the kind that gives the model's embedding module's bits on ids
// across the table, at load. Ids are the caller's to check (0 <= id < the table's rows).
enum { EMBED_F32, EMBED_BF16_WIDE, EMBED_BF16 };

void embed_rows_ref(const void *table, int kind, int64_t dim, const int64_t *ids, int64_t n,
                    float scale, float *out) {
    for (int64_t j = 0; j < n; j++) {
        float *o = out + j * dim;
        const uint16_t *half = (const uint16_t *)table + ids[j] * dim;
        const float *row = (const float *)table + ids[j] * dim;
        if (kind == EMBED_BF16)
            for (int64_t c = 0; c < dim; c++)
                o[c] = bf16_to_float(to_bf16(bf16_to_float(half[c]) * scale));
        else if (kind == EMBED_BF16_WIDE)
            for (int64_t c = 0; c < dim; c++) o[c] = bf16_to_float(half[c]) * scale;
        else
            for (int64_t c = 0; c < dim; c++) o[c] = row[c] * scale;
    }
}

#if SPECCHAT_SIMD
void embed_rows(const void *table, int kind, int64_t dim, const int64_t *ids, int64_t n,
                float scale, float *out) {
    embed_rows_ref(table, kind, dim, ids, n, scale, out);  // a copy: the compiler's loop is it
}
#endif
