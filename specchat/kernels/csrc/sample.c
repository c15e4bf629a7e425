// The sampler's work on a forward's logits, one call for all its rows: mask the ids no reply
// holds, apply the request's penalties, and pick each row's token (the argmax, or min-p's draw).
// The Python definitions are specchat/core/penalties.py (`Shaper`) and specchat/core/sampling.py
// (`argmax`, `min_p_draw`); this computes the same bits (tests/test_native_sampler.py), in one
// call instead of a few dozen array calls, each slow right after a forward with cold caches.
//
// Row r continues seq[0 .. lengths[r]): plain decoding's one row, or a chain verify's rows
// (the context, then the drafts before the row). `breaks[i]` is 1 where seq[i]'s text holds one
// of DRY's sequence breakers.
//
// Exactness: float32 arithmetic where the Python definition uses float32 scalars, with no fused
// multiply-adds (-ffp-contract=off); exp, log and pow are the C library's, the functions
// Python's math module and float powers call.
#include "common.h"

#define DRY_MAX_MATCH 64

typedef struct {
    float repeat, frequency, presence;  // 1, 0, 0: off
    int64_t last_n;                     // the window of the three (0: off)
    double dry_multiplier, dry_base;    // multiplier 0: DRY off
    int64_t dry_allowed;
} penalties_t;

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

// Where token t lies in a row: at t, or with `places` (a drafter's reduced vocabulary: n_places
// ids) at places[t], -1 for tokens the row does not hold
static inline int64_t place_of(int64_t t, const int64_t *places, int64_t n_places) {
    if (!places) return t;
    return t >= 0 && t < n_places ? places[t] : -1;
}

// The repeat, frequency and presence penalties over the window's distinct tokens.
static void windowed(float *v, int64_t width, const int64_t *seq, int64_t n,
                     const penalties_t *p, int64_t *scratch, uint8_t *dirty,
                     const int64_t *places, int64_t n_places) {
    int64_t w = n < p->last_n ? n : p->last_n;
    memcpy(scratch, seq + n - w, w * sizeof(int64_t));
    qsort(scratch, w, sizeof(int64_t), cmp_i64);
    for (int64_t i = 0; i < w;) {
        int64_t t = scratch[i], j = i;
        while (j < w && scratch[j] == t) j++;
        float count = (float)(j - i);
        i = j;
        t = place_of(t, places, n_places);
        if (t < 0 || t >= width) continue;
        float value = v[t];
        if (p->repeat != 1.0f) value = value > 0 ? value / p->repeat : value * p->repeat;
        if (p->frequency != 0.0f) value = value - count * p->frequency;
        if (p->presence != 0.0f) value = value - p->presence;
        v[t] = value;
        if (dirty) dirty[t / HEAD_BLOCK] = 1;
    }
}

// DRY: where seq[0..n) ends with a sequence that occurred earlier followed by token t, t's logit
// drops by multiplier * base ** (length - allowed) (`Shaper.dry_matches`: the longest such
// sequence per t, breakers ending sequences, at most DRY_MAX_MATCH tokens).
static void dry(float *v, int64_t width, const int64_t *seq, const uint8_t *breaks, int64_t n,
                const penalties_t *p, int64_t *tokens, int64_t *lengths, uint8_t *dirty,
                const int64_t *places, int64_t n_places) {
    if (n < 2 || breaks[n - 1]) return;
    int64_t last = seq[n - 1];
    int64_t limit = (DRY_MAX_MATCH < n - 1 ? DRY_MAX_MATCH : n - 1) - 1;
    int64_t reach = 0;  // the tail's run of tokens without a breaker: seq[n - 2], seq[n - 3], ...
    while (reach < limit && !breaks[n - 2 - reach]) reach++;
    int64_t m = 0;
    for (int64_t s = 0; s < n - 1; s++) {
        if (seq[s] != last || breaks[s + 1]) continue;
        int64_t length = 1;
        for (int64_t j = 1; j <= reach && s - j >= 0 && seq[s - j] == seq[n - 1 - j]; j++)
            length++;
        tokens[m] = seq[s + 1];
        lengths[m++] = length;
    }
    for (int64_t i = 0; i < m; i++) {
        int64_t t = tokens[i], best = lengths[i], first = 1;
        for (int64_t j = 0; j < m && first; j++)
            if (j < i && tokens[j] == t) first = 0;
        if (!first) continue;  // the token's first occurrence applies its longest match
        for (int64_t j = i + 1; j < m; j++)
            if (tokens[j] == t && lengths[j] > best) best = lengths[j];
        t = place_of(t, places, n_places);
        if (best >= p->dry_allowed && t >= 0 && t < width) {
            v[t] -= (float)(p->dry_multiplier * pow(p->dry_base, (double)(best - p->dry_allowed)));
            if (dirty) dirty[t / HEAD_BLOCK] = 1;
        }
    }
}

// The row's largest value; NaN if it holds one (then `first_at` finds the first NaN).
static float row_max_ref(const float *v, int64_t width) {
    float best = -INFINITY;
    for (int64_t i = 0; i < width; i++) {
        if (v[i] != v[i]) return v[i];
        if (v[i] > best) best = v[i];
    }
    return best;
}

// The first index whose value is >= `at_least` (or NaN when `at_least` is NaN); -1 if none.
static int64_t first_at_ref(const float *v, int64_t width, float at_least) {
    int nan = at_least != at_least;
    for (int64_t i = 0; i < width; i++)
        if (nan ? v[i] != v[i] : v[i] >= at_least) return i;
    return -1;
}

static int64_t argmax_ref(const float *v, int64_t width) {
    return first_at_ref(v, width, row_max_ref(v, width));
}

#if SPECCHAT_SIMD
// The SIMD scans keep 4 accumulators of 8 lanes (32 values a step), so that no step waits on
// the one before.
static float row_max_simd(const float *v, int64_t width) {
    __m256 best[4], nan = _mm256_setzero_ps();
    for (int a = 0; a < 4; a++) best[a] = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 32 <= width; i += 32)
        for (int a = 0; a < 4; a++) {
            __m256 x = _mm256_loadu_ps(v + i + 8 * a);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            best[a] = _mm256_max_ps(best[a], x);
        }
    if (_mm256_movemask_ps(nan)) return row_max_ref(v, width);
    float lanes[32];
    for (int a = 0; a < 4; a++) _mm256_storeu_ps(lanes + 8 * a, best[a]);
    float m = row_max_ref(v + i, width - i);  // the last width % 32
    if (m != m) return m;
    for (int k = 0; k < 32; k++) m = lanes[k] > m ? lanes[k] : m;
    return m;
}

// The first index of the row's largest value (of its first NaN, if any), in one pass: each lane
// keeps its largest value and the first index holding it; then the largest of the lanes, and the
// smallest index among the lanes holding it.
static int64_t argmax_simd(const float *v, int64_t width) {
    if (width < 32 || width > INT32_MAX) return argmax_ref(v, width);
    __m256 best[4], nan = _mm256_setzero_ps();
    __m256i at[4], here[4], step = _mm256_set1_epi32(32);
    for (int a = 0; a < 4; a++) {
        best[a] = _mm256_set1_ps(-INFINITY);
        here[a] = _mm256_setr_epi32(8 * a, 8 * a + 1, 8 * a + 2, 8 * a + 3, 8 * a + 4, 8 * a + 5,
                                    8 * a + 6, 8 * a + 7);
        at[a] = here[a];
    }
    int64_t i = 0;
    for (; i + 32 <= width; i += 32) {
        for (int a = 0; a < 4; a++) {
            __m256 x = _mm256_loadu_ps(v + i + 8 * a);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            __m256 more = _mm256_cmp_ps(x, best[a], _CMP_GT_OQ);
            best[a] = _mm256_blendv_ps(best[a], x, more);
            at[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at[a]),
                                                         _mm256_castsi256_ps(here[a]), more));
            here[a] = _mm256_add_epi32(here[a], step);
        }
    }
    if (_mm256_movemask_ps(nan)) return argmax_ref(v, width);
    float lanes[32];
    int32_t index[32];
    for (int a = 0; a < 4; a++) {
        _mm256_storeu_ps(lanes + 8 * a, best[a]);
        _mm256_storeu_si256((__m256i *)(index + 8 * a), at[a]);
    }
    // A lane still at -inf never passed its start: its index is its first, which holds -inf.
    int64_t found = index[0];
    float m = lanes[0];
    for (int k = 1; k < 32; k++)
        if (lanes[k] > m || (lanes[k] == m && index[k] < found)) m = lanes[k], found = index[k];
    for (; i < width; i++) {  // the rest, past every index above
        if (v[i] != v[i]) return argmax_ref(v, width);
        if (v[i] > m) m = v[i], found = i;
    }
    return found;
}

static int64_t first_at_simd(const float *v, int64_t width, float at_least) {
    if (at_least != at_least) return first_at_ref(v, width, at_least);
    __m256 floor = _mm256_set1_ps(at_least);
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), floor, _CMP_GE_OQ));
        if (mask) return i + __builtin_ctz(mask);
    }
    int64_t rest = first_at_ref(v + i, width - i, at_least);
    return rest < 0 ? -1 : i + rest;
}
#endif

// Keyed uniforms (`Noise.uniforms` in sampling.py): lowbias32, keyed twice per half.
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

static inline double keyed_uniform(uint32_t x, uint32_t k1, uint32_t k2) {
    uint32_t hi = mix32(mix32(x ^ k1) ^ k1) >> 11, lo = mix32(mix32(x ^ k2) ^ k2);
    return ((double)hi * 4294967296.0 + (double)lo + 0.5) * 0x1p-53;
}

// A build's scans of a row: the SIMD ones, or their plain-C references (the same answers).
typedef struct {
    float (*max)(const float *, int64_t);
    int64_t (*first_at)(const float *, int64_t, float);
    int64_t (*argmax)(const float *, int64_t);
} scans_t;

// A row's scans run in `parts` pieces on as many threads, each piece the part of the row its
// thread wrote in the LM head's product (both split the row evenly, in order), so each reads
// from its own core's cache; the pieces' answers are combined as one pass in order gives them.
#define MAX_PARTS 64
#define MIN_PART 16384  // values: below this a piece is not worth a thread

static int parts_for(int64_t width, int threads) {
    int64_t parts = width / MIN_PART;
    parts = parts < threads ? parts : threads;
    parts = parts < MAX_PARTS ? parts : MAX_PARTS;
    return parts < 1 ? 1 : (int)parts;
}

static inline int64_t part_start(int64_t width, int parts, int k) {
    return width * k / parts;
}

static int64_t argmax_parts(const float *v, int64_t width, const scans_t *scan, int threads) {
    int parts = parts_for(width, threads);
    if (parts == 1) return scan->argmax(v, width);
    int64_t at[MAX_PARTS];
#pragma omp parallel for schedule(static) num_threads(parts)
    for (int k = 0; k < parts; k++) {
        int64_t lo = part_start(width, parts, k), hi = part_start(width, parts, k + 1);
        at[k] = lo + scan->argmax(v + lo, hi - lo);
    }
    int64_t best = at[0];  // the first NaN, else the first place of the largest value
    for (int k = 1; k < parts && v[best] == v[best]; k++)
        if (v[at[k]] != v[at[k]] || v[at[k]] > v[best]) best = at[k];
    return best;
}

static float max_parts(const float *v, int64_t width, const scans_t *scan, int threads) {
    int parts = parts_for(width, threads);
    if (parts == 1) return scan->max(v, width);
    float m[MAX_PARTS];
#pragma omp parallel for schedule(static) num_threads(parts)
    for (int k = 0; k < parts; k++) {
        int64_t lo = part_start(width, parts, k), hi = part_start(width, parts, k + 1);
        m[k] = scan->max(v + lo, hi - lo);
    }
    float top = m[0];  // NaN if any piece holds one
    for (int k = 1; k < parts && top == top; k++) top = m[k] != m[k] || m[k] > top ? m[k] : top;
    return top;
}

// The race among v[lo, hi)'s candidates (v >= low): its winner, and its time in *time_out
// (-1 and +inf when none).
// `ids`: each place's token id, which keys its uniform (NULL: the place is the id).
static int64_t race_range(const float *v, int64_t lo, int64_t hi, float low, float t, float top,
                          uint32_t k1, uint32_t k2, const int64_t *ids, const scans_t *scan,
                          double *time_out) {
    int64_t best = -1;
    double best_time = INFINITY;
    for (int64_t i = lo + scan->first_at(v + lo, hi - lo, low); i >= lo && i < hi;) {
        float x = v[i] / t;
        double z = exp((double)(x - top));
        double time = -log(keyed_uniform((uint32_t)(ids ? ids[i] : i), k1, k2)) / z;
        if (best < 0 || time < best_time) best = i, best_time = time;
        int64_t next = scan->first_at(v + i + 1, hi - i - 1, low);
        i = next < 0 ? -1 : i + 1 + next;
    }
    *time_out = best_time;
    return best;
}

// min-p's floor: top = the row's largest value v_max / t; candidates are x = v / t >= top +
// log(min_p). v / t rounds monotonically in v, so they are v >= the least v that passes (*low):
// one compare per logit, not a division.
static float min_p_floor(float v_max, float t, double log_min_p, float *low_out) {
    float top = v_max / t;
    float floor = (float)((double)top + log_min_p);
    float low = floor * t;
    while (low / t >= floor && low > -INFINITY) low = nextafterf(low, -INFINITY);
    while (low / t < floor) low = nextafterf(low, INFINITY);
    *low_out = low;
    return top;
}

// min-p's draw (`sampling.min_p_draw`): x = v / t; the tokens whose x is within -log(min_p) of
// the largest race with weights z = exp(x - top) in double, each time -log(u) / z from the
// position's keyed uniforms; the least time wins, the smallest id on a tie.
static int64_t min_p_draw(const float *v, int64_t width, float t, double log_min_p, uint32_t k1,
                          uint32_t k2, const scans_t *scan, int threads) {
    float low, top = min_p_floor(max_parts(v, width, scan, threads), t, log_min_p, &low);
    int parts = parts_for(width, threads);
    int64_t at[MAX_PARTS];
    double times[MAX_PARTS];
#pragma omp parallel for schedule(static) num_threads(parts) if (parts > 1)
    for (int k = 0; k < parts; k++)
        at[k] = race_range(v, part_start(width, parts, k), part_start(width, parts, k + 1), low,
                           t, top, k1, k2, NULL, scan, &times[k]);
    int64_t best = at[0];
    double best_time = times[0];
    for (int k = 1; k < parts; k++)  // in order: the smallest id wins a tie
        if (at[k] >= 0 && (best < 0 || times[k] < best_time)) best = at[k], best_time = times[k];
    return best;
}

// The scans again, from the row's block maxima (`block_maxima`, common.h: mx[b] the largest of
// v[b * HEAD_BLOCK ..], nblk of them): the same answers, reading only the blocks that can hold
// them. A NaN maximum means the row holds a NaN: then the whole-row scans decide.
static int64_t argmax_blocks(const float *v, int64_t width, const float *mx, int64_t nblk,
                             const scans_t *scan) {
    int64_t best = 0;
    for (int64_t b = 0; b < nblk; b++) {
        if (mx[b] != mx[b]) return scan->argmax(v, width);
        if (mx[b] > mx[best]) best = b;  // the first block holding the largest value
    }
    int64_t lo = best * HEAD_BLOCK, hi = lo + HEAD_BLOCK < width ? lo + HEAD_BLOCK : width;
    return lo + scan->first_at(v + lo, hi - lo, mx[best]);  // its first place
}

// min-p's draw over the blocks whose maximum reaches the candidates' floor, in order (a block
// below it holds no candidate); -2 where the row holds a NaN (the whole-row draw decides).
static int64_t min_p_blocks(const float *v, int64_t width, const float *mx, int64_t nblk,
                            float t, double log_min_p, uint32_t k1, uint32_t k2,
                            const scans_t *scan) {
    float v_max = -INFINITY;
    for (int64_t b = 0; b < nblk; b++) {
        if (mx[b] != mx[b]) return -2;
        v_max = mx[b] > v_max ? mx[b] : v_max;
    }
    float low, top = min_p_floor(v_max, t, log_min_p, &low);
    int64_t best = -1;
    double best_time = INFINITY;
    for (int64_t b = 0; b < nblk; b++) {
        if (!(mx[b] >= low)) continue;
        int64_t lo = b * HEAD_BLOCK, hi = lo + HEAD_BLOCK < width ? lo + HEAD_BLOCK : width;
        double time;
        int64_t at = race_range(v, lo, hi, low, t, top, k1, k2, NULL, scan, &time);
        if (at >= 0 && (best < 0 || time < best_time)) best = at, best_time = time;
    }
    return best;
}

// min-p's draw over a drafter's reduced vocabulary (`sampling.min_p_place`): v[j] is the logit
// of token ids[j]. The race keys each candidate by its token id, as the target's draw keys it
// (`min_p_draw`), so the draft is the target's token whenever the two races agree. Returns the
// winner's place and its probability among the candidates (*prob: its weight over theirs,
// summed in place order), or -1 where the row holds no finite logit (or a NaN).
static int64_t min_p_place_impl(const float *v, int64_t width, const int64_t *ids, float t,
                                double min_p, uint32_t k1, uint32_t k2, double *prob,
                                const scans_t *scan) {
    const float v_max = scan->max(v, width);
    if (!(v_max > -INFINITY) || v_max != v_max || v_max == INFINITY) return -1;
    float low, top = min_p_floor(v_max, t, log(min_p), &low);
    double time, total = 0.0;
    const int64_t best = race_range(v, 0, width, low, t, top, k1, k2, ids, scan, &time);
    for (int64_t i = scan->first_at(v, width, low); i >= 0 && i < width;) {
        total += exp((double)(v[i] / t - top));
        const int64_t next = scan->first_at(v + i + 1, width - i - 1, low);
        i = next < 0 ? -1 : i + 1 + next;
    }
    *prob = exp((double)(v[best] / t - top)) / total;
    return best;
}

#define MIN_P_PLACE_ARGS                                                                       \
    const float *v, int64_t width, const int64_t *ids, float t, double min_p, uint32_t k1,    \
        uint32_t k2, double *prob

int64_t min_p_place_ref(MIN_P_PLACE_ARGS) {
    static const scans_t scan = {row_max_ref, first_at_ref, argmax_ref};
    return min_p_place_impl(v, width, ids, t, min_p, k1, k2, prob, &scan);
}

#if SPECCHAT_SIMD
int64_t min_p_place(MIN_P_PLACE_ARGS) {
    static const scans_t scan = {row_max_simd, first_at_simd, argmax_simd};
    return min_p_place_impl(v, width, ids, t, min_p, k1, k2, prob, &scan);
}
#endif

// The exported call. `args` holds, as int64: the runs' [start, end) pairs (n_runs of them),
// each row's prefix length (rows), each row's two noise keys (2 * rows, for mode 2), and room
// for each row's pick (rows), which it writes. mode: 0 shape only, 1 greedy (the argmax), 2
// min-p's draw. `maxima` (or NULL): the LM head's block maxima of these logits, `stride` a row
// (`block_maxima`); the picks are the same with or without them. Returns 0, or -1 out of memory.
static int shape_pick_impl(float *logits, int64_t rows, int64_t width, int64_t *args,
                           int64_t n_runs, const int64_t *seq, const uint8_t *breaks,
                           const penalties_t *p, int mode, float t, double min_p,
                           const float *maxima, int64_t stride, const scans_t *scan,
                           int threads) {
    const int64_t *runs = args, *lengths = args + 2 * n_runs, *keys = lengths + rows;
    int64_t *picks = args + 2 * n_runs + 3 * rows;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) longest = lengths[r] > longest ? lengths[r] : longest;
    const int64_t nblk = (width + HEAD_BLOCK - 1) / HEAD_BLOCK;
    if (!mode || stride < nblk) maxima = NULL;  // nothing to pick, or not this row's maxima
    int64_t *scratch = malloc(3 * (longest + 1) * sizeof(int64_t));
    float *mx = maxima ? malloc(nblk * sizeof(float)) : NULL;
    uint8_t *dirty = maxima ? malloc(nblk) : NULL;
    if (!scratch || (maxima && (!mx || !dirty))) {
        free(scratch);
        free(mx);
        free(dirty);
        return -1;
    }
    double log_min_p = mode == 2 ? log(min_p) : 0.0;
    for (int64_t r = 0; r < rows; r++) {
        float *v = logits + r * width;
        if (maxima) {  // this row's maxima, and which blocks the mask and penalties change
            memcpy(mx, maxima + r * stride, nblk * sizeof(float));
            memset(dirty, 0, nblk);
            if (width % HEAD_BLOCK) dirty[nblk - 1] = 1;  // the head's block runs past the row
        }
        for (int64_t i = 0; i < n_runs; i++) {
            int64_t lo = runs[2 * i], hi = runs[2 * i + 1] < width ? runs[2 * i + 1] : width;
            for (int64_t j = lo; j < hi; j++) v[j] = -INFINITY;
            for (int64_t b = lo / HEAD_BLOCK; maxima && lo < hi && b <= (hi - 1) / HEAD_BLOCK;
                 b++) {
                if (b * HEAD_BLOCK >= lo && (b + 1) * HEAD_BLOCK <= hi)
                    mx[b] = -INFINITY;  // all masked
                else
                    dirty[b] = 1;
            }
        }
        int64_t n = lengths[r];
        if (p->last_n > 0 && (p->repeat != 1.0f || p->frequency != 0.0f || p->presence != 0.0f))
            windowed(v, width, seq, n, p, scratch, dirty, NULL, 0);
        if (p->dry_multiplier > 0)
            dry(v, width, seq, breaks, n, p, scratch + longest + 1, scratch + 2 * (longest + 1),
                dirty, NULL, 0);
        if (maxima)
            for (int64_t b = 0; b < nblk; b++)
                if (dirty[b]) {
                    int64_t lo = b * HEAD_BLOCK;
                    mx[b] = scan->max(v + lo, lo + HEAD_BLOCK < width ? HEAD_BLOCK : width - lo);
                }
        if (mode == 1)
            picks[r] = maxima ? argmax_blocks(v, width, mx, nblk, scan)
                              : argmax_parts(v, width, scan, threads);
        else if (mode == 2) {
            uint32_t k1 = (uint32_t)keys[2 * r], k2 = (uint32_t)keys[2 * r + 1];
            picks[r] = maxima ? min_p_blocks(v, width, mx, nblk, t, log_min_p, k1, k2, scan) : -2;
            if (picks[r] == -2)
                picks[r] = min_p_draw(v, width, t, log_min_p, k1, k2, scan, threads);
        }
    }
    free(scratch);
    free(mx);
    free(dirty);
    return 0;
}

// The request's penalties on one row of a drafter's reduced vocabulary (token t at row[places[t]],
// n_places ids, -1 where the row does not hold t) for the prefix seq[0 .. n): what
// `Shaper.shape_row` computes with an index, the same bits, in one call (with the tensors
// around it, 0.07 ms a head's draft against Python's 0.13-0.16). 0, or -1 out of memory.
int shape_reduced(float *row, int64_t width, const int64_t *places, int64_t n_places,
                  const int64_t *seq, const uint8_t *breaks, int64_t n, float repeat,
                  float frequency, float presence, int64_t last_n, double dry_multiplier,
                  double dry_base, int64_t dry_allowed) {
    const penalties_t p = {repeat, frequency, presence, last_n, dry_multiplier, dry_base,
                           dry_allowed};
    int64_t *scratch = malloc(3 * (n + 1) * sizeof(int64_t));
    if (!scratch) return -1;
    if (p.last_n > 0 && (p.repeat != 1.0f || p.frequency != 0.0f || p.presence != 0.0f))
        windowed(row, width, seq, n, &p, scratch, NULL, places, n_places);
    if (p.dry_multiplier > 0)
        dry(row, width, seq, breaks, n, &p, scratch + n + 1, scratch + 2 * (n + 1), NULL, places,
            n_places);
    free(scratch);
    return 0;
}

#define SHAPE_PICK_ARGS                                                                        \
    float *logits, int64_t rows, int64_t width, int64_t *args, int64_t n_runs,               \
        const int64_t *seq, const uint8_t *breaks, float repeat, float frequency,             \
        float presence, int64_t last_n, double dry_multiplier, double dry_base,               \
        int64_t dry_allowed, int mode, float t, double min_p, const float *maxima,            \
        int64_t stride, int threads

#define PENALTIES {repeat, frequency, presence, last_n, dry_multiplier, dry_base, dry_allowed}

int shape_pick_ref(SHAPE_PICK_ARGS) {
    static const scans_t scan = {row_max_ref, first_at_ref, argmax_ref};
    penalties_t p = PENALTIES;
    return shape_pick_impl(logits, rows, width, args, n_runs, seq, breaks, &p, mode, t, min_p,
                           maxima, stride, &scan, threads);
}

#if SPECCHAT_SIMD
int shape_pick(SHAPE_PICK_ARGS) {
    static const scans_t scan = {row_max_simd, first_at_simd, argmax_simd};
    penalties_t p = PENALTIES;
    return shape_pick_impl(logits, rows, width, args, n_runs, seq, breaks, &p, mode, t, min_p,
                           maxima, stride, &scan, threads);
}
#endif

// What the inspector shows of a step's distribution, in one call over one row (torch's topk
// by blocks and logsumexp over 262,144 logits took 0.4 ms a step): the row's n largest values
// (largest first, the first index among equal values, NaN and -inf never), and log(sum_j
// e^v[j]): the row's max, then e^(v[j] - max) by specchat's own exp (`exp_or_zero`: -inf adds 0)
// in the scans' parts, each part's values into 8 lane sums in double (value i of the part into
// lane i % 8) joined in `hsum`'s order, the parts added in order. Returns the log-sum-exp (-inf
// where no value is above -inf, else NaN where one is NaN) and writes the count found to *found.
#define TOP_MAX 16

typedef struct {
    int count;
    float v[TOP_MAX];
    int64_t at[TOP_MAX];
} top_t;

// v[i] joins the list where it beats its last (a list of n, largest first; equal values keep
// the earlier index first)
static inline void top_offer(top_t *t, int n, float x, int64_t at) {
    if (!(x > -INFINITY) || (t->count == n && !(x > t->v[n - 1]))) return;
    int k = t->count < n ? t->count++ : n - 1;
    while (k > 0 && (x > t->v[k - 1] || (x == t->v[k - 1] && at < t->at[k - 1]))) {
        t->v[k] = t->v[k - 1], t->at[k] = t->at[k - 1];
        k--;
    }
    t->v[k] = x, t->at[k] = at;
}

static inline double sum_lanes8d(const double v[8]) {  // `sum_lanes8`'s order
    const double s0 = v[0] + v[4], s1 = v[1] + v[5], s2 = v[2] + v[6], s3 = v[3] + v[7];
    return (s0 + s2) + (s1 + s3);
}

// The scaled values x = v / t, e^(x - top) of each by specchat's own exp (`exp_or_zero`: -inf
// adds 0), value i into lane i % 8 of `lanes` and, where x is at least `floor` (min-p's
// candidates), of `in`: values from..n-1. Returns 1 at a NaN (the sums are then NaN), else 0.
static int exp_sums_add(const float *v, int64_t from, int64_t n, float t, float top,
                        float floor, double lanes[8], double in[8]) {
    for (int64_t i = from; i < n; i++) {
        if (v[i] != v[i]) return 1;
        const float x = v[i] / t;
        const float e = exp_or_zero(x - top);
        lanes[i % 8] += e;
        if (x >= floor) in[i % 8] += e;
    }
    return 0;
}

// a part's two sums (`exp_sums_add` from 0, the lanes joined): all values' and, in *kept,
// those at least floor
typedef double (*part_sums_fn)(const float *, int64_t, float, float, float, double *);
typedef void (*part_top_fn)(const float *, int64_t, int64_t, int, top_t *);

static double exp_sums_ref(const float *v, int64_t n, float t, float top, float floor,
                           double *kept) {
    double lanes[8] = {0}, in[8] = {0};
    if (exp_sums_add(v, 0, n, t, top, floor, lanes, in)) return *kept = __builtin_nan("");
    *kept = sum_lanes8d(in);
    return sum_lanes8d(lanes);
}

static void part_top_ref(const float *v, int64_t lo, int64_t hi, int n, top_t *t) {
    for (int64_t i = lo; i < hi; i++) top_offer(t, n, v[i], i);
}

// The above of the row as sampling at temperature t sees it, the scaled values x = v / t (the
// float32 division of torch's `logits / t`; t 1: the row itself): the n largest x and their
// ids, log(sum e^x), and of the value at `also` (-1: none) its probability at t (p_also[0])
// and among min-p's candidates (p_also[1]: the x at least float32(top + log(min_p)),
// `sampling._min_p_floor`; 0 where `also` is not one of them; min_p 0: p_also[0]). The
// inspector's evidence in one call (torch's division and min-p's candidates in numpy took
// 0.2 ms a step more); `row_top` is t = 1 without min-p or a token.
static float row_evidence_impl(const float *v, int64_t width, int64_t n, float t, double min_p,
                               int64_t also, int64_t *ids, float *values, int64_t *found,
                               double *p_also, part_sums_fn part_sums, part_top_fn part_top,
                               int threads) {
    *found = 0;
    p_also[0] = p_also[1] = 0.0;
    if (width <= 0) return -INFINITY;
    n = n < 0 ? 0 : n > TOP_MAX ? TOP_MAX : n;
    const int parts = parts_for(width, threads);
    top_t tops[MAX_PARTS];
    double sums[MAX_PARTS], kept[MAX_PARTS];
#pragma omp parallel for schedule(static) num_threads(parts)
    for (int k = 0; k < parts; k++) {
        const int64_t lo = part_start(width, parts, k), hi = part_start(width, parts, k + 1);
        tops[k].count = 0;
        part_top(v, lo, hi, n ? (int)n : 1, &tops[k]);
    }
    top_t all = {0};
    for (int k = 0; k < parts; k++)  // in index order: equal values keep the earlier index
        for (int i = 0; i < tops[k].count; i++) top_offer(&all, n ? (int)n : 1, tops[k].v[i],
                                                           tops[k].at[i]);
    if (!all.count) return -INFINITY;
    // v / t keeps v's order (t > 0), so the largest x are the largest v's, divided
    const float top = all.v[0] / t;
    if (top == INFINITY) return top;
    for (int i = 0; i < all.count && i < n; i++) ids[i] = all.at[i], values[i] = all.v[i] / t;
    *found = all.count < n ? all.count : n;
    const float floor = min_p > 0 ? (float)((double)top + log(min_p)) : -INFINITY;
#pragma omp parallel for schedule(static) num_threads(parts)
    for (int k = 0; k < parts; k++) {
        const int64_t lo = part_start(width, parts, k), hi = part_start(width, parts, k + 1);
        sums[k] = part_sums(v + lo, hi - lo, t, top, floor, &kept[k]);
    }
    double total = 0.0, in = 0.0;
    for (int k = 0; k < parts; k++) total += sums[k], in += kept[k];
    if (also >= 0 && also < width) {
        const float x = v[also] / t;
        const double e = exp_or_zero(x - top);
        p_also[0] = e / total;
        p_also[1] = min_p <= 0 ? p_also[0] : x >= floor && in > 0 ? e / in : 0.0;
    }
    return (float)(top + log(total));
}

float row_evidence_ref(const float *v, int64_t width, int64_t n, float t, double min_p,
                       int64_t also, int64_t *ids, float *values, int64_t *found,
                       double *p_also, int threads) {
    return row_evidence_impl(v, width, n, t, min_p, also, ids, values, found, p_also,
                             exp_sums_ref, part_top_ref, threads);
}

float row_top_ref(const float *v, int64_t width, int64_t n, int64_t *ids, float *values,
                  int64_t *found, int threads) {
    double unused[2];
    return row_evidence_impl(v, width, n, 1.0f, 0.0, -1, ids, values, found, unused,
                             exp_sums_ref, part_top_ref, threads);
}

#if SPECCHAT_SIMD
// `part_top_ref`, 8 values a compare: only those above the list's last are offered
static void part_top_simd(const float *v, int64_t lo, int64_t hi, int n, top_t *t) {
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        const float bar = t->count == n ? t->v[n - 1] : -INFINITY;
        int mask = _mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(bar), _CMP_GT_OQ));
        while (mask) {
            const int l = __builtin_ctz(mask);
            top_offer(t, n, v[i + l], i + l);
            mask &= mask - 1;
        }
    }
    part_top_ref(v, i, hi, n, t);
}


// SCALED: t is not 1 (the division); KEPT: a min-p floor (the kept sums); each combination
// its own loop, for the row's 262,144 values
static inline __attribute__((always_inline)) double exp_sums_simd_as(
    const float *v, int64_t n, float t, float top, float floor, double *kept, const int SCALED,
    const int KEPT) {
    const __m256 tv = _mm256_set1_ps(top), dv = _mm256_set1_ps(t), fv = _mm256_set1_ps(floor);
    const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    __m256 nan = _mm256_setzero_ps();
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();    // lanes 0-3, 4-7
    __m256d klo = _mm256_setzero_pd(), khi = _mm256_setzero_pd();  // the same, kept
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 raw = _mm256_loadu_ps(v + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(raw, raw, _CMP_UNORD_Q));
        const __m256 x = SCALED ? _mm256_div_ps(raw, dv) : raw;
        const __m256 e = exp_or_zero8(_mm256_sub_ps(x, tv), all);
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        if (KEPT) {
            const __m256 k = _mm256_and_ps(e, _mm256_cmp_ps(x, fv, _CMP_GE_OQ));
            klo = _mm256_add_pd(klo, _mm256_cvtps_pd(_mm256_castps256_ps128(k)));
            khi = _mm256_add_pd(khi, _mm256_cvtps_pd(_mm256_extractf128_ps(k, 1)));
        }
    }
    if (_mm256_movemask_ps(nan)) return *kept = __builtin_nan("");
    double lanes[8], in[8];  // the vectors' lanes, then the tail as the reference adds it
    _mm256_storeu_pd(lanes, lo);
    _mm256_storeu_pd(lanes + 4, hi);
    _mm256_storeu_pd(in, klo);
    _mm256_storeu_pd(in + 4, khi);
    if (exp_sums_add(v, i, n, t, top, floor, lanes, in)) return *kept = __builtin_nan("");
    *kept = sum_lanes8d(in);
    return sum_lanes8d(lanes);
}

// `exp_sums_ref`'s sums (v / 1 is v; without a floor *kept is not the kept sum: unread)
static double exp_sums_simd(const float *v, int64_t n, float t, float top, float floor,
                            double *kept) {
    const int scaled = t != 1.0f, with_floor = floor > -INFINITY;
    if (scaled)
        return with_floor ? exp_sums_simd_as(v, n, t, top, floor, kept, 1, 1)
                          : exp_sums_simd_as(v, n, t, top, floor, kept, 1, 0);
    return with_floor ? exp_sums_simd_as(v, n, t, top, floor, kept, 0, 1)
                      : exp_sums_simd_as(v, n, t, top, floor, kept, 0, 0);
}

float row_evidence(const float *v, int64_t width, int64_t n, float t, double min_p, int64_t also,
                   int64_t *ids, float *values, int64_t *found, double *p_also, int threads) {
    return row_evidence_impl(v, width, n, t, min_p, also, ids, values, found, p_also,
                             exp_sums_simd, part_top_simd, threads);
}

float row_top(const float *v, int64_t width, int64_t n, int64_t *ids, float *values,
              int64_t *found, int threads) {
    double unused[2];
    return row_evidence_impl(v, width, n, 1.0f, 0.0, -1, ids, values, found, unused,
                             exp_sums_simd, part_top_simd, threads);
}
#endif
