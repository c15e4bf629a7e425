// specchat's draft head (models/eagle.py, `DraftHead`) for a few rows in one call: what its
// torch modules compute, without the hundred torch calls around a one-token draft step that
// cost more than its arithmetic (a head draft is a tenth of the target's step or less):
//
//   x = fc([norm_e(embed), norm_f(feats)]) + bias;
//   a = norm_a(x); q, k, v = a Wqkv; RoPE on q and k at the row's position; k, v to the cache;
//   x += attention(q, the cache) Wo;   m = norm_m(x); g, u = m Wgu; x += (silu(g) u) Wd;
//   pred = norm(x) * norm_scale;   logits = pred Wlm (the target's LM rows of the reduced
//   vocabulary), tanh-capped where the head has a softcap.
//
// Only the last `out_rows` rows go past the cache: a row's keys and values need no more than
// fc and the qkv product, and a catch-up over the tokens a verify accepted reads only its last
// row's prediction, so the earlier rows skip attention, the MLP and the logits (the rows that
// go on get the same bits either way: every product is row-exact).
//
// Each norm is F.rms_norm's: x * rsqrt(mean(x^2) + eps) * w. Every product is Q8_0 by integer
// dot products, through the function the head's torch modules call (`product`), so the same
// values a step of those modules gives; the rest is plain float C (RoPE's cos and sin from
// libm, the softmax's and SiLU's exp specchat's own, `exp_or_zero`), within rounding of
// torch's. Drafts only: verification stays exact whatever they are. The attention runs a
// (row, head) pair a task on the threads: over a chat's history of 600 slots a one-row step
// took 0.32 ms, 0.18 so (warm, 2 threads, Zen 4), 0.52 and 0.24 over 1,200.
//
// Rows are a chain: row r (at position pos[r], cache slot start + r) attends to slots
// 0 .. start + r. The cache: keys and values [heads, cap, head_dim] float32 each (torch's
// [1, heads, cap, head_dim] buffer), slots 0 .. start - 1 filled.
#include "common.h"

// x [n, d] -> y: F.rms_norm with weight w (NULL: none)
static void head_norm(const float *x, int64_t n, int64_t d, const float *w, float eps,
                      float *y) {
    for (int64_t r = 0; r < n; r++) {
        const float *v = x + r * d;
        float sum = 0.0f;
        for (int64_t c = 0; c < d; c++) sum += v[c] * v[c];
        const float scale = 1.0f / sqrtf(sum / (float)d + eps);
        for (int64_t c = 0; c < d; c++) y[r * d + c] = w ? v[c] * scale * w[c] : v[c] * scale;
    }
}

// q or k of one row's head, in place: rotate-half RoPE at position p
static void head_rope(float *v, int64_t hd, const float *inv_freq, int64_t p) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float angle = (float)p * inv_freq[i], c = cosf(angle), s = sinf(angle);
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c - x2 * s;
        v[i + half] = x2 * c + x1 * s;
    }
}

static void q8(const draft_head *m, const q8_weight *w, const float *x, int64_t n, float *y,
               int threads) {
    m->product(x, n, w->in, w->q, w->d, y, w->out, NULL, threads);
}

int draft_head_forward(const draft_head *m, const float *feats, const float *embeds, int64_t n,
                       const int64_t *pos, float *k_cache, float *v_cache, int64_t cap,
                       int64_t start, float *pred, int64_t out_rows, float *logits,
                       int threads) {
    const int64_t d = m->hidden, H = m->heads, hd = d / H, I = m->inter, slots = start + n;
    if (n <= 0 || start < 0 || slots > cap || d % H || out_rows < 0 || out_rows > n)
        return -1;
    const int64_t first = n - out_rows;  // the first row that goes past the cache
    float *both = malloc(sizeof(float) * (size_t)(n * 2 * d));
    float *x = malloc(sizeof(float) * (size_t)(n * d));
    float *a = malloc(sizeof(float) * (size_t)(n * d));
    float *qkv = malloc(sizeof(float) * (size_t)(n * 3 * d));
    const int64_t mlp_rows = out_rows ? out_rows : 1;  // only the rows that go on take the MLP
    float *gu = malloc(sizeof(float) * (size_t)(mlp_rows * 2 * I));
    float *act = malloc(sizeof(float) * (size_t)(mlp_rows * I));
    float *scores = malloc(sizeof(float) * (size_t)((out_rows ? out_rows : 1) * H * slots));
    int done = -1;
    if (!both || !x || !a || !qkv || !gu || !act || !scores) goto out;

    for (int64_t r = 0; r < n; r++) {  // [norm_e(embed), norm_f(feats)]
        head_norm(embeds + r * d, 1, d, m->emb_norm, m->eps, both + r * 2 * d);
        head_norm(feats + r * d, 1, d, m->feat_norm, m->eps, both + r * 2 * d + d);
    }
    q8(m, &m->fc, both, n, x, threads);
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < d; c++) x[r * d + c] += m->fc_bias[c];

    head_norm(x, n, d, m->attn_norm, m->eps, a);
    q8(m, &m->qkv, a, n, qkv, threads);  // a row: q | k | v, each head by head
    for (int64_t r = 0; r < n; r++)
        for (int64_t h = 0; h < H; h++) {
            float *q = qkv + r * 3 * d + h * hd, *k = q + d, *v = q + 2 * d;
            head_rope(q, hd, m->inv_freq, pos[r]);
            head_rope(k, hd, m->inv_freq, pos[r]);
            memcpy(k_cache + (h * cap + start + r) * hd, k, sizeof(float) * (size_t)hd);
            memcpy(v_cache + (h * cap + start + r) * hd, v, sizeof(float) * (size_t)hd);
        }
    if (!out_rows) goto finished;
    const float scale = 1.0f / sqrtf((float)hd);
    // attention, into a (the o product's input): each (row, head) pair its own task and
    // scratch row, on the threads once the cache is long enough to be worth them (a chat's
    // history: hundreds of slots, ten heads)
    const int64_t pairs = out_rows * H;
#pragma omp parallel for schedule(static) num_threads(threads) if (pairs * slots >= 1024)
    for (int64_t t = 0; t < pairs; t++) {
        const int64_t r = first + t / H, h = t % H;
        float *s = scores + t * slots;
        const float *q = qkv + r * 3 * d + h * hd;
        const float *keys = k_cache + h * cap * hd, *values = v_cache + h * cap * hd;
        const int64_t seen = start + r + 1;
        float top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < seen; j++) {
            float acc[8] = {0};  // 8 partial sums: vectorized without reassociation
            const float *kj = keys + j * hd;
            if (hd % 8 == 0) {  // (the same sums without the tail's test, which stops SIMD)
                for (int64_t c = 0; c < hd; c += 8)
                    for (int l = 0; l < 8; l++) acc[l] += q[c + l] * kj[c + l];
            } else {
                for (int64_t c = 0; c < hd; c += 8)
                    for (int l = 0; l < 8 && c + l < hd; l++) acc[l] += q[c + l] * kj[c + l];
            }
            s[j] = sum_lanes8(acc) * scale;
            top = s[j] > top ? s[j] : top;
        }
        for (int64_t j = 0; j < seen; j++) s[j] = exp_or_zero(s[j] - top);  // specchat's exp
        for (int64_t j = 0; j < seen; j++) total += s[j];
        float *o = a + (r - first) * d + h * hd;
        for (int64_t c = 0; c < hd; c++) o[c] = 0.0f;
        for (int64_t j = 0; j < seen; j++)
            for (int64_t c = 0; c < hd; c++) o[c] += s[j] * values[j * hd + c];
        for (int64_t c = 0; c < hd; c++) o[c] /= total;
    }
    float *xo = x + first * d;  // the rows that go on, from here [out_rows, d]
    const int64_t n_out = out_rows;
    q8(m, &m->o, a, n_out, both, threads);
    for (int64_t i = 0; i < n_out * d; i++) xo[i] += both[i];

    head_norm(xo, n_out, d, m->mlp_norm, m->eps, a);
    q8(m, &m->gate_up, a, n_out, gu, threads);
    for (int64_t r = 0; r < n_out; r++)
        for (int64_t c = 0; c < I; c++) {
            const float g = gu[r * 2 * I + c], u = gu[r * 2 * I + I + c];
            act[r * I + c] = g / (1.0f + exp_or_zero(fminf(-g, 88.0f))) * u;  // silu(g) u
        }
    q8(m, &m->down, act, n_out, both, threads);
    for (int64_t i = 0; i < n_out * d; i++) xo[i] += both[i];

    head_norm(xo, n_out, d, NULL, m->eps, pred);
    for (int64_t r = 0; r < n_out; r++)
        for (int64_t c = 0; c < d; c++) pred[r * d + c] *= m->norm_scale[c];
    q8(m, &m->lm, pred, n_out, logits, threads);
    if (m->softcap > 0.0f)
        for (int64_t i = 0; i < n_out * m->lm.out; i++)
            logits[i] = tanhf(logits[i] / m->softcap) * m->softcap;
finished:
    done = 0;
out:
    free(both), free(x), free(a), free(qkv), free(gu), free(act), free(scores);
    return done;
}

// A draft chain in one call (`HeadDrafter.propose`): the catch-up over rows feats/embeds [n]
// (positions pos, cache slots start..), then drafts one at a time. Draft i takes row i of
// `rows` [k, lm.out]: the logits the head's step wrote there, with the request's penalties for
// the context seq[0 .. n_seq) and the drafts before it (`shape`, NULL: none; draft i's token
// and breaker flag are written at seq[n_seq + i] and breaks[n_seq + i]), then, greedy, its
// largest value (`top`, the first of equal ones) and that value's probability, in double, as
// Python's math.exp(value - log-sum-exp) gives it; sampled (`pick`), min-p's draw at the
// draft's position and the winner's probability among the candidates. The chain keeps draft i unless
// the product of the probabilities so far fell under min_gain (the first is always kept), and
// runs the head for the next one only while that product is at least lookahead * min_gain and
// i < k - 1: the next step embeds the draft (`embed`) and feeds it with the last prediction at
// position pos[n - 1] + 1 + i. What the Python loop does, the same calls on the same values,
// so the same bits. Returns the rows examined (the drafts kept: `*kept`), or -1.
#define HEAD_CHUNK 64  // catch-up rows a step takes at a time (`CATCH_UP_CHUNK` in Python)

int draft_head_chain(const draft_head *m, const head_chain *c, const float *feats,
                     const float *embeds, int64_t n, const int64_t *pos, float *k_cache,
                     float *v_cache, int64_t cap, int64_t start, int64_t k, int64_t *tokens,
                     float *rows, int64_t *kept, int threads) {
    const int64_t d = m->hidden, N = m->lm.out;
    if (k <= 0 || start + n + k - 1 > cap) return -1;
    float *pred = malloc(sizeof(float) * (size_t)d), *e = malloc(sizeof(float) * (size_t)d);
    int64_t examined = -1, drafted = 0;
    if (!pred || !e) goto out;
    for (int64_t at = 0; at < n; at += HEAD_CHUNK) {  // the catch-up, a chunk at a time
        const int64_t rows_now = n - at < HEAD_CHUNK ? n - at : HEAD_CHUNK;
        if (draft_head_forward(m, feats + at * d, embeds + at * d, rows_now, pos + at, k_cache,
                               v_cache, cap, start + at, pred, at + rows_now == n, rows,
                               threads))
            goto out;
    }
    double p_all = 1.0;
    for (int64_t i = 0;; i++) {
        float *row = rows + i * N;
        examined = i + 1;
        if (c->shape && c->shape(row, N, c->places, c->n_places, c->seq, c->breaks,
                                 c->n_seq + i, c->repeat, c->frequency, c->presence, c->last_n,
                                 c->dry_multiplier, c->dry_base, c->dry_allowed)) {
            examined = -1;
            goto out;
        }
        int64_t id, found = 0;
        if (c->pick) {
            double prob;
            id = c->pick(row, N, c->vocab, c->t, c->min_p, (uint32_t)c->keys[2 * i],
                         (uint32_t)c->keys[2 * i + 1], &prob);
            if (id < 0) break;  // no finite logit: nothing to draft
            p_all *= prob;
        } else {
            float value;
            const float lse = c->top(row, N, 1, &id, &value, &found, threads);
            if (!found) break;
            p_all *= exp((double)value - (double)lse);
        }
        if (p_all < c->min_gain && i) break;
        const int64_t token = c->vocab[id];
        tokens[drafted++] = token;
        if (i == k - 1 || p_all < c->lookahead * c->min_gain) break;
        if (c->seq) {
            c->seq[c->n_seq + i] = token;
            c->breaks[c->n_seq + i] = c->vocab_breaks ? c->vocab_breaks[id] : 0;
        }
        const int64_t at = pos[n - 1] + 1 + i;
        c->embed(c->table, (int)c->kind, d, &token, 1, c->scale, e);
        if (draft_head_forward(m, pred, e, 1, &at, k_cache, v_cache, cap, start + n + i, pred,
                               1, rows + (i + 1) * N, threads)) {
            examined = -1;
            goto out;
        }
    }
out:
    free(pred), free(e);
    *kept = drafted;
    return (int)examined;
}
