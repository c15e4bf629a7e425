// llama-specchat-profile: where a plain decoding token of llama.cpp goes, on the race's GGUF,
// prompts and samplers (`bench --profile`, specchat/backends/llama_profile.py).
//
// Reads one JSON object on stdin:
//   {"model": PATH, "threads": N, "context": N, "swa_full": BOOL, "max_new_tokens": N,
//    "prompts": [[token ids], ...], "stop": [strings that end a reply, as the server's "stop"],
//    "sampling": {llama-server's request fields: "temperature", "top_k", "top_p", "min_p",
//                 "repeat_penalty", "repeat_last_n", "frequency_penalty", "presence_penalty",
//                 "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
//                 "dry_sequence_breakers", "seed"}}
// and decodes every prompt twice with llama.cpp's own code (libllama, and the server's sampler
// chain from libcommon, `common_sampler`):
//
//   1. as the server decodes: each token one `llama_decode` and one `common_sampler_sample`,
//      each timed; the prompt's own forwards are not counted;
//   2. with an eval callback that has the scheduler compute the graph one node at a time, each
//      node timed alone: the share of each operation (by its op, its name and its weight's
//      name) in a token's forward. Splitting the graph costs time of its own (a compute call
//      per node), so the shares are of the split forward's time; the caller scales them to
//      pass 1's forward.
//
// Writes one JSON object on stdout:
//   {"tokens": N, "forward_s": S, "sample_s": S, "split_tokens": N, "split_forward_s": S,
//    "nodes": [{"op": OP, "name": NAME, "weight": WEIGHT, "seconds": S, "count": N}, ...]}
// NAME and WEIGHT without their layer numbers ("attn_norm", "blk.attn_q.weight").
#include "common.h"
#include "llama.h"
#include "sampling.h"
#include "ggml.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

using json = nlohmann::json;

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// "attn_norm-3" -> "attn_norm"; "blk.3.attn_q.weight" -> "blk.attn_q.weight"
static std::string without_layer(const char *name) {
    std::string s(name);
    const size_t dash = s.rfind('-');
    if (dash != std::string::npos && dash + 1 < s.size() &&
        s.find_first_not_of("0123456789", dash + 1) == std::string::npos)
        s.erase(dash);
    if (s.rfind("blk.", 0) == 0) {
        const size_t dot = s.find('.', 4);
        if (dot != std::string::npos) s.erase(4, dot - 3);
    }
    return s;
}

struct node_clock {
    bool on = false;       // timing (the decode steps of pass 2, not the prompts)
    double started = 0.0;  // when the scheduler was told to compute the node asked about
    std::map<std::string, std::pair<double, long>> seconds;  // key -> (seconds, nodes)
    std::map<std::string, json> keys;
};

// The scheduler asks about every node (ask = true); saying yes has it compute the graph up to
// that node and call again (ask = false) once the node is done.
static bool each_node(struct ggml_tensor *t, bool ask, void *user_data) {
    node_clock *c = (node_clock *)user_data;
    if (ask) {
        c->started = now();
        return true;
    }
    const double spent = now() - c->started;
    if (!c->on) return true;
    const char *weight = t->src[0] && t->src[0]->name[0] ? t->src[0]->name : "";
    const std::string name = without_layer(t->name), src = without_layer(weight),
                      op = ggml_op_desc(t);
    const std::string key = op + "|" + name + "|" + src;
    auto &slot = c->seconds[key];
    slot.first += spent;
    slot.second += 1;
    if (!c->keys.count(key)) c->keys[key] = json{{"op", op}, {"name", name}, {"weight", src}};
    return true;
}

static common_params_sampling sampling_of(const json &s, int context) {
    common_params_sampling p;  // the server's defaults, then the request's fields
    p.temp = s.value("temperature", p.temp);
    p.top_k = s.value("top_k", p.top_k);
    p.top_p = s.value("top_p", p.top_p);
    p.min_p = s.value("min_p", p.min_p);
    p.penalty_repeat = s.value("repeat_penalty", p.penalty_repeat);
    p.penalty_last_n = s.value("repeat_last_n", p.penalty_last_n);
    p.penalty_freq = s.value("frequency_penalty", p.penalty_freq);
    p.penalty_present = s.value("presence_penalty", p.penalty_present);
    p.dry_multiplier = s.value("dry_multiplier", p.dry_multiplier);
    const float base = s.value("dry_base", p.dry_base);
    p.dry_base = base < 1.0f ? p.dry_base : base;
    p.dry_allowed_length = s.value("dry_allowed_length", p.dry_allowed_length);
    p.dry_penalty_last_n = s.value("dry_penalty_last_n", p.dry_penalty_last_n);
    if (s.contains("dry_sequence_breakers"))
        p.dry_sequence_breakers = s["dry_sequence_breakers"].get<std::vector<std::string>>();
    if (s.contains("seed")) p.seed = s["seed"].get<uint32_t>();
    if (p.penalty_last_n == -1) p.penalty_last_n = context;
    if (p.dry_penalty_last_n == -1) p.dry_penalty_last_n = context;
    return p;
}

// Whether the reply so far holds one of the stop strings (the server ends a reply there).
static bool ends(const std::string &text, const std::vector<std::string> &stops) {
    for (const auto &s : stops)
        if (!s.empty() && text.find(s, text.size() > 64 + s.size() ? text.size() - 64 - s.size()
                                                                     : 0) != std::string::npos)
            return true;
    return false;
}

// Every prompt decoded plain; returns (tokens, forward seconds, sampling seconds) of the
// decode steps.
static bool decode_all(llama_model *model, llama_context *ctx, const json &in,
                       common_params_sampling &sp, node_clock *clock, long &tokens,
                       double &forward_s, double &sample_s) {
    const llama_vocab *vocab = llama_model_get_vocab(model);
    const int max_new = in.value("max_new_tokens", 128);
    const std::vector<std::string> stops = in.value("stop", std::vector<std::string>());
    tokens = 0, forward_s = 0.0, sample_s = 0.0;
    for (const auto &ids : in["prompts"]) {
        std::vector<llama_token> prompt = ids.get<std::vector<llama_token>>();
        if (prompt.empty()) continue;
        llama_memory_clear(llama_get_memory(ctx), true);
        common_sampler *smpl = common_sampler_init(model, sp);
        if (!smpl) return false;
        for (llama_token t : prompt) common_sampler_accept(smpl, t, false);
        if (clock) clock->on = false;
        if (llama_decode(ctx, llama_batch_get_one(prompt.data(), (int32_t)prompt.size())) != 0)
            return false;
        llama_token token = common_sampler_sample(smpl, ctx, -1);
        common_sampler_accept(smpl, token, true);
        if (clock) clock->on = true;
        std::string text = common_token_to_piece(ctx, token);
        for (int i = 1; i < max_new && !llama_vocab_is_eog(vocab, token) && !ends(text, stops);
             i++) {
            double t0 = now();
            if (llama_decode(ctx, llama_batch_get_one(&token, 1)) != 0) return false;
            double t1 = now();
            token = common_sampler_sample(smpl, ctx, -1);
            common_sampler_accept(smpl, token, true);
            forward_s += t1 - t0;
            sample_s += now() - t1;
            tokens++;
            text += common_token_to_piece(ctx, token);
        }
        common_sampler_free(smpl);
    }
    if (clock) clock->on = false;
    return true;
}

int main() {
    json in;
    try {
        in = json::parse(std::cin);
    } catch (const std::exception &e) {
        fprintf(stderr, "llama-specchat-profile: bad input: %s\n", e.what());
        return 2;
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    const int threads = in.value("threads", 2), context = in.value("context", 4096);
    llama_model_params mp = llama_model_default_params();
    llama_model *model = llama_model_load_from_file(in.value("model", "").c_str(), mp);
    if (!model) {
        fprintf(stderr, "llama-specchat-profile: cannot load %s\n",
                in.value("model", "").c_str());
        return 1;
    }
    common_params_sampling sp = sampling_of(in.value("sampling", json::object()), context);
    json out;
    node_clock clock;
    for (int pass = 0; pass < 2; pass++) {
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = context;
        cp.n_threads = cp.n_threads_batch = threads;
        cp.swa_full = in.value("swa_full", false);  // as the bench's server runs (--swa-full)
        if (pass == 1) {
            cp.cb_eval = each_node;
            cp.cb_eval_user_data = &clock;
        }
        llama_context *ctx = llama_init_from_model(model, cp);
        long tokens;
        double forward_s, sample_s;
        if (!ctx || !decode_all(model, ctx, in, sp, pass == 1 ? &clock : nullptr, tokens,
                                forward_s, sample_s)) {
            fprintf(stderr, "llama-specchat-profile: decoding failed\n");
            return 1;
        }
        if (pass == 0) {
            out["tokens"] = tokens, out["forward_s"] = forward_s, out["sample_s"] = sample_s;
        } else {
            out["split_tokens"] = tokens, out["split_forward_s"] = forward_s;
        }
        llama_free(ctx);
    }
    json nodes = json::array();
    for (const auto &[key, v] : clock.seconds) {
        json node = clock.keys[key];
        node["seconds"] = v.first, node["count"] = v.second;
        nodes.push_back(node);
    }
    out["nodes"] = nodes;
    std::cout << out.dump() << std::endl;
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
