// specchat's C ABI: every function the kernels library exports and every struct it shares with
// Python, declared once. Each source includes it (through common.h), so the compiler checks each
// definition against its declaration; `kernels/__init__.py` binds these names with ctypes
// (`_ARGTYPES`), `runners/cpu/runner.py` mirrors the structs, and tests/test_kernels.py checks
// both against this file.
//
// A kernel `name` has its plain-C reference `name_ref` (the same bits); a 16-lane twin
// `name_avx512` has its reference `name16_ref` (`name_i8_16_ref` for the integer Q8_0 product).
// The SIMD names are defined in the SIMD build only, the references in both builds.
#ifndef SPECCHAT_ABI_H
#define SPECCHAT_ABI_H

#include <stdint.h>

// ---- the decoder stack's model (csrc/decoder.c, `runners.cpu.runner._Model`) -------------------

// One NF4 weight [out, in]: bitsandbytes' packed codes and one float32 scale per block, and
// the layer's float32 bias [out] (NULL: none; Qwen 2's q, k and v have one).
typedef struct {
    const uint8_t *codes;
    const float *absmax;
    int64_t out, in;
    const float *bias;
} nf4_weight;

// One layer, as its family declares it (`runners.family`). The norms' float32 weights are
// what norms.c multiplies by: Gemma's 1 + the module's weight, Llama's the weight itself. A norm
// a family lacks is NULL: Llama, Qwen and Mistral have no post-attention or post-MLP norm (their
// `post_attention_layernorm` is the norm before the MLP, `mlp_norm` here), and only Gemma 3 and
// Qwen 3 norm each head's queries and keys.
typedef struct {
    nf4_weight q, k, v, o, gate, up, down;
    const float *attn_norm, *post_attn_norm, *mlp_norm, *post_mlp_norm, *q_norm, *k_norm;
    int64_t window;  // a sliding-window layer's window; 0: full attention
    int64_t rope;    // which of the forward's RoPE tables the layer takes (0 or 1)
} decoder_layer;

// The MLP's activation of its gate, times up: gelu with tanh's approximation (Gemma), SiLU (the
// Llama family: Llama, Mistral, Qwen, SmolLM)
enum { ACT_GELU_TANH = 0, ACT_SILU = 1 };

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, blocksize;
    float eps, scale;    // the norms' epsilon; the attention scores' scale
    int64_t act;         // ACT_GELU_TANH or ACT_SILU
    const float *table;  // the NF4 codebook, 16 values
    const decoder_layer *layer;
    const float *final_norm;
    float softcap;       // the attention scores' tanh cap (`softcap_of`; 0: none, Gemma 2's)
    // The residual stream entering layers aux[0..n_aux) (index `layers`: the last layer's
    // output, before the final norm), copied into aux_out [n, n_aux * hidden], row by row in
    // aux's order: the hidden states an EAGLE-3 head fuses. n_aux 0: none.
    int64_t n_aux;
    const int64_t *aux;
    float *aux_out;
} decoder_model;

// ---- products: y [n, out] = x [n, in] @ W.T --------------------------------------------------

// NF4 (nf4.c): 8 lanes, 16 lanes
void nf4_matmul(const float *x, int64_t n, int64_t in, const uint8_t *codes, const float *absmax,
                int64_t blocksize, const float *table, float *y, int64_t out, int threads);
void nf4_matmul_ref(const float *x, int64_t n, int64_t in, const uint8_t *codes,
                    const float *absmax, int64_t blocksize, const float *table, float *y,
                    int64_t out, int threads);
void nf4_matmul_avx512(const float *x, int64_t n, int64_t in, const uint8_t *codes,
                       const float *absmax, int64_t blocksize, const float *table, float *y,
                       int64_t out, int threads);
void nf4_matmul16_ref(const float *x, int64_t n, int64_t in, const uint8_t *codes,
                      const float *absmax, int64_t blocksize, const float *table, float *y,
                      int64_t out, int threads);

// NF4 by integer dot products (nf4_i8.c): the codes repacked at load (`nf4_i8_pack`: packed
// codes and per-block scales dw in place of codes and absmax), activations quantized to int8
// per block of 32; the reference, AVX2, AVX-VNNI, AVX-512 VNNI and AMX give the same bits
int64_t nf4_i8_packed_bytes(int64_t out, int64_t in);
int nf4_i8_pack(const uint8_t *codes, const float *absmax, int64_t out, int64_t in,
                int64_t blocksize, uint8_t *packed, float *dw);
int nf4_i8_unpack(const uint8_t *packed, int64_t out, int64_t in, uint8_t *codes);
void nf4_matmul_i8_ref(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                       const float *dw, int64_t blocksize, const float *table, float *y,
                       int64_t out, int threads);
void nf4_matmul_i8_avx2(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                        const float *dw, int64_t blocksize, const float *table, float *y,
                        int64_t out, int threads);
void nf4_matmul_i8_avxvnni(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                           const float *dw, int64_t blocksize, const float *table, float *y,
                           int64_t out, int threads);
void nf4_matmul_i8_vnni(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                        const float *dw, int64_t blocksize, const float *table, float *y,
                        int64_t out, int threads);
void nf4_matmul_i8_amx(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                       const float *dw, int64_t blocksize, const float *table, float *y,
                       int64_t out, int threads);
// AMX's tile state granted to this process (Linux asks once): 1, else 0 (the AMX kernels then
// run the VNNI ones)
int amx_ready(void);

// the Q8_0 LM head by the same arithmetic (nf4_i8.c): repacked in place, the same bits from
// the reference and the AVX2, AVX-VNNI, VNNI and AMX kernels
int q8_0_i8_pack(int8_t *q, const uint16_t *d, int64_t out, int64_t in, uint16_t *dw);
void q8_0_rows_matmul_i8_ref(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                             const uint16_t *dw, float *y, int64_t out, float *maxima,
                             int threads);
void q8_0_rows_matmul_i8_avx2(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                              const uint16_t *dw, float *y, int64_t out, float *maxima,
                              int threads);
void q8_0_rows_matmul_i8_avxvnni(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                                 const uint16_t *dw, float *y, int64_t out, float *maxima,
                                 int threads);
void q8_0_rows_matmul_i8_vnni(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                              const uint16_t *dw, float *y, int64_t out, float *maxima,
                              int threads);
void q8_0_rows_matmul_i8_amx(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                             const uint16_t *dw, float *y, int64_t out, float *maxima,
                             int threads);

// bf16 weights (bf16.c); the longest weight row the products take
void bf16_matmul(const float *x, int64_t n, int64_t in, const uint16_t *weight, float *y,
                 int64_t out, int threads);
void bf16_matmul_ref(const float *x, int64_t n, int64_t in, const uint16_t *weight, float *y,
                     int64_t out, int threads);
int max_in(void);

// Q8_0 (q8_0.c): float products 8 and 16 lanes wide; integer products (x quantized per block,
// `maxima` the block maxima of the logits or NULL) 8 and 16 lanes wide, by AVX512BW or VNNI
void q8_0_matmul(const float *x, int64_t n, int64_t in, const int8_t *q, const uint16_t *d,
                 float *y, int64_t out, int threads);
void q8_0_matmul_ref(const float *x, int64_t n, int64_t in, const int8_t *q, const uint16_t *d,
                     float *y, int64_t out, int threads);
void q8_0_matmul_avx512(const float *x, int64_t n, int64_t in, const int8_t *q,
                        const uint16_t *d, float *y, int64_t out, int threads);
void q8_0_matmul16_ref(const float *x, int64_t n, int64_t in, const int8_t *q,
                       const uint16_t *d, float *y, int64_t out, int threads);
void q8_0_matmul_i8(const float *x, int64_t n, int64_t in, const int8_t *q, const uint16_t *d,
                    float *y, int64_t out, float *maxima, int threads);
void q8_0_matmul_i8_ref(const float *x, int64_t n, int64_t in, const int8_t *q,
                        const uint16_t *d, float *y, int64_t out, float *maxima, int threads);
void q8_0_matmul_i8_avx512(const float *x, int64_t n, int64_t in, const int8_t *q,
                           const uint16_t *d, float *y, int64_t out, float *maxima,
                           int threads);
void q8_0_matmul_i8_vnni(const float *x, int64_t n, int64_t in, const int8_t *q,
                         const uint16_t *d, float *y, int64_t out, float *maxima, int threads);
void q8_0_matmul_i8_16_ref(const float *x, int64_t n, int64_t in, const int8_t *q,
                           const uint16_t *d, float *y, int64_t out, float *maxima,
                           int threads);
// Q6_K (q6_k.c): a GGUF's Q6_K rows repacked 16 a group, and the integer product on them: the
// reference, 8 lanes (AVX2, AVX-VNNI) and 16 (AVX512BW, VNNI), all the same bits
int q6_k_pack(const uint8_t *rows, int64_t out, int64_t in, uint8_t *packed);
void q6_k_matmul_i8_ref(const float *x, int64_t n, int64_t in, const uint8_t *packed, float *y,
                        int64_t out, float *maxima, int threads);
void q6_k_matmul_i8_avx2(const float *x, int64_t n, int64_t in, const uint8_t *packed, float *y,
                         int64_t out, float *maxima, int threads);
void q6_k_matmul_i8_avxvnni(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                            float *y, int64_t out, float *maxima, int threads);
void q6_k_matmul_i8_avx512(const float *x, int64_t n, int64_t in, const uint8_t *packed,
                           float *y, int64_t out, float *maxima, int threads);
void q6_k_matmul_i8_vnni(const float *x, int64_t n, int64_t in, const uint8_t *packed, float *y,
                         int64_t out, float *maxima, int threads);
// an LM head's logits past the sampled ids set to -inf, their block maxima mended
void logits_cut(float *y, int64_t n, int64_t out, int64_t upto, int64_t computed,
                float *maxima);
void logits_cut_ref(float *y, int64_t n, int64_t out, int64_t upto, int64_t computed,
                    float *maxima);
// the block maxima of logits a head computed without them
void logits_maxima(const float *y, int64_t n, int64_t out, float *maxima, int threads);
void logits_softcap(float *y, int64_t count, float cap, int threads);

// ---- attention and norms (attention.c, norms.c) -----------------------------------------------

void attend(const float *q, int64_t rows, int64_t dim, const void *k, const void *v,
            int64_t slots, int64_t kstride, int64_t vstride, int bf16, const uint8_t *mask,
            int64_t mask_rows, int64_t mstride, float scale, float softcap, float *scores,
            float *out, int threads);
void attend_ref(const float *q, int64_t rows, int64_t dim, const void *k, const void *v,
                int64_t slots, int64_t kstride, int64_t vstride, int bf16, const uint8_t *mask,
                int64_t mask_rows, int64_t mstride, float scale, float softcap, float *scores,
                float *out, int threads);
void rms_norm(const void *x, int64_t n, int64_t dim, int bf16, const float *w1, float eps,
              void *y);
void rms_norm_ref(const void *x, int64_t n, int64_t dim, int bf16, const float *w1, float eps,
                  void *y);

// ---- the decoder stack (decoder.c): 0, or -1 out of memory ------------------------------------

int decoder_forward(const decoder_model *m, const float *embeddings, int64_t n,
                    const int64_t *pos, int64_t start, const uint8_t *visible, float *k_cache,
                    float *v_cache, int64_t slots, const float *const *rope_tables, float *out,
                    double *clock, int threads);
int decoder_forward_ref(const decoder_model *m, const float *embeddings, int64_t n,
                        const int64_t *pos, int64_t start, const uint8_t *visible,
                        float *k_cache, float *v_cache, int64_t slots,
                        const float *const *rope_tables, float *out, double *clock,
                        int threads);
int decoder_forward_avx512(const decoder_model *m, const float *embeddings, int64_t n,
                           const int64_t *pos, int64_t start, const uint8_t *visible,
                           float *k_cache, float *v_cache, int64_t slots,
                           const float *const *rope_tables, float *out, double *clock,
                           int threads);
int decoder_forward16_ref(const decoder_model *m, const float *embeddings, int64_t n,
                          const int64_t *pos, int64_t start, const uint8_t *visible,
                          float *k_cache, float *v_cache, int64_t slots,
                          const float *const *rope_tables, float *out, double *clock,
                          int threads);
// The same stack on the integer NF4 product (`cpu-int8`): the model's weights packed by
// `nf4_i8_pack`; the reference and the AVX2, AVX-VNNI, VNNI and AMX kernels give the same bits
int decoder_forward_i8_ref(const decoder_model *m, const float *embeddings, int64_t n,
                           const int64_t *pos, int64_t start, const uint8_t *visible,
                           float *k_cache, float *v_cache, int64_t slots,
                           const float *const *rope_tables, float *out, double *clock,
                           int threads);
int decoder_forward_i8_avx2(const decoder_model *m, const float *embeddings, int64_t n,
                            const int64_t *pos, int64_t start, const uint8_t *visible,
                            float *k_cache, float *v_cache, int64_t slots,
                            const float *const *rope_tables, float *out, double *clock,
                            int threads);
int decoder_forward_i8_avxvnni(const decoder_model *m, const float *embeddings, int64_t n,
                               const int64_t *pos, int64_t start, const uint8_t *visible,
                               float *k_cache, float *v_cache, int64_t slots,
                               const float *const *rope_tables, float *out, double *clock,
                               int threads);
int decoder_forward_i8_vnni(const decoder_model *m, const float *embeddings, int64_t n,
                            const int64_t *pos, int64_t start, const uint8_t *visible,
                            float *k_cache, float *v_cache, int64_t slots,
                            const float *const *rope_tables, float *out, double *clock,
                            int threads);
int decoder_forward_i8_amx(const decoder_model *m, const float *embeddings, int64_t n,
                           const int64_t *pos, int64_t start, const uint8_t *visible,
                           float *k_cache, float *v_cache, int64_t slots,
                           const float *const *rope_tables, float *out, double *clock,
                           int threads);
// an embedding table's rows for n ids, each value times `scale` (`kind`: EMBED_* in decoder.c)
void embed_rows(const void *table, int kind, int64_t dim, const int64_t *ids, int64_t n,
                float scale, float *out);
void embed_rows_ref(const void *table, int kind, int64_t dim, const int64_t *ids, int64_t n,
                    float scale, float *out);

// ---- the draft head (head.c): a step of `models.eagle.DraftHead` in one call; 0, or -1 ----------

// One Q8_0 weight [out, in]: int8 values and one fp16 scale per 32 (GGUF's Q8_0 blocks)
typedef struct {
    const int8_t *q;
    const uint16_t *d;
    int64_t out, in;
} q8_weight;

// the Q8_0 integer product the head's modules call (`q8_0_matmul_i8` or a twin of it, or
// `q8_0_rows_matmul_i8` on weights `q8_0_i8_pack` repacked)
typedef void (*q8_product)(const float *x, int64_t n, int64_t in, const int8_t *q,
                           const uint16_t *d, float *y, int64_t out, float *maxima, int threads);

typedef struct {
    int64_t hidden, heads, inter;
    float eps, softcap;  // the norms' epsilon; the logits' tanh cap (0: none)
    const float *emb_norm, *feat_norm, *attn_norm, *mlp_norm;  // the norms' weights
    const float *norm_scale, *fc_bias, *inv_freq;  // inv_freq: RoPE's, head_dim / 2 values
    q8_weight fc, qkv, o, gate_up, down, lm;      // lm: the reduced vocabulary's LM rows
    q8_product product;
} draft_head;

typedef float (*top_fn)(const float *v, int64_t width, int64_t n, int64_t *ids, float *values,
                       int64_t *found, int threads);
typedef void (*embed_fn)(const void *table, int kind, int64_t dim, const int64_t *ids, int64_t n,
                         float scale, float *out);
typedef int (*shape_fn)(float *row, int64_t width, const int64_t *places, int64_t n_places,
                        const int64_t *seq, const uint8_t *breaks, int64_t n, float repeat,
                        float frequency, float presence, int64_t last_n, double dry_multiplier,
                        double dry_base, int64_t dry_allowed);
typedef int64_t (*pick_fn)(const float *v, int64_t width, const int64_t *ids, float t,
                          double min_p, uint32_t k1, uint32_t k2, double *prob);

// what a draft chain needs beside the head (`draft_head_chain`)
typedef struct {
    const void *table;  // the target's embedding table, `embed_rows`' kind and scale
    int64_t kind;
    float scale;
    embed_fn embed;
    top_fn top;                // `row_top`
    const int64_t *vocab;      // a place in the reduced vocabulary -> its token id
    const uint8_t *vocab_breaks;  // whether each place's text holds a DRY breaker (or NULL)
    double min_gain, lookahead;
    shape_fn shape;            // `shape_reduced`, NULL: no penalties; its arguments:
    const int64_t *places;     // token id -> place (-1: none), n_places of them
    int64_t n_places;
    int64_t *seq;              // the context's tokens, room for the drafts after them
    uint8_t *breaks;           // their breaker flags, likewise
    int64_t n_seq;
    float repeat, frequency, presence;
    int64_t last_n;
    double dry_multiplier, dry_base;
    int64_t dry_allowed;
    // a sampled chain: each draft min-p's draw (`pick`: `min_p_place`) at temperature t, keyed
    // by keys[2 i], keys[2 i + 1] for draft i; pick NULL: each the largest logit (`top`)
    pick_fn pick;
    float t;
    double min_p;
    const int64_t *keys;
} head_chain;

// n rows into the cache; pred [out_rows, hidden] and logits [out_rows, lm.out] of the last
// out_rows of them
int draft_head_forward(const draft_head *m, const float *feats, const float *embeds, int64_t n,
                       const int64_t *pos, float *k_cache, float *v_cache, int64_t cap,
                       int64_t start, float *pred, int64_t out_rows, float *logits,
                       int threads);
// a draft chain after a catch-up: the rows examined (-1: no memory), *kept drafts
int draft_head_chain(const draft_head *m, const head_chain *c, const float *feats,
                     const float *embeds, int64_t n, const int64_t *pos, float *k_cache,
                     float *v_cache, int64_t cap, int64_t start, int64_t k, int64_t *tokens,
                     float *rows, int64_t *kept, int threads);

// ---- the sampler (sample.c): the mask, penalties and pick over a forward's rows; 0, or -1 ----

int shape_pick(float *logits, int64_t rows, int64_t width, int64_t *args, int64_t n_runs,
               const int64_t *seq, const uint8_t *breaks, float repeat, float frequency,
               float presence, int64_t last_n, double dry_multiplier, double dry_base,
               int64_t dry_allowed, int mode, float t, double min_p, const float *maxima,
               int64_t stride, int threads);
int shape_pick_ref(float *logits, int64_t rows, int64_t width, int64_t *args, int64_t n_runs,
                   const int64_t *seq, const uint8_t *breaks, float repeat, float frequency,
                   float presence, int64_t last_n, double dry_multiplier, double dry_base,
                   int64_t dry_allowed, int mode, float t, double min_p, const float *maxima,
                   int64_t stride, int threads);

// the request's penalties on a row of a drafter's reduced vocabulary (csrc/sample.c)
int shape_reduced(float *row, int64_t width, const int64_t *places, int64_t n_places,
                  const int64_t *seq, const uint8_t *breaks, int64_t n, float repeat,
                  float frequency, float presence, int64_t last_n, double dry_multiplier,
                  double dry_base, int64_t dry_allowed);
// a row's n largest values and their ids, and its log-sum-exp (csrc/sample.c)
float row_top(const float *v, int64_t width, int64_t n, int64_t *ids, float *values,
              int64_t *found, int threads);
float row_top_ref(const float *v, int64_t width, int64_t n, int64_t *ids, float *values,
                  int64_t *found, int threads);
// `row_top` at a sampling temperature, with one token's probability at it and under min-p:
// what the inspector shows of a step (csrc/sample.c)
float row_evidence(const float *v, int64_t width, int64_t n, float t, double min_p, int64_t also,
                   int64_t *ids, float *values, int64_t *found, double *p_also, int threads);
float row_evidence_ref(const float *v, int64_t width, int64_t n, float t, double min_p,
                       int64_t also, int64_t *ids, float *values, int64_t *found,
                       double *p_also, int threads);
// min-p's draw over a reduced vocabulary, keyed by token id: the place, or -1 (csrc/sample.c)
int64_t min_p_place(const float *v, int64_t width, const int64_t *ids, float t, double min_p,
                    uint32_t k1, uint32_t k2, double *prob);
int64_t min_p_place_ref(const float *v, int64_t width, const int64_t *ids, float t,
                        double min_p, uint32_t k1, uint32_t k2, double *prob);

#endif  // SPECCHAT_ABI_H
