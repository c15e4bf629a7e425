"""Public EAGLE-3 heads (models/eagle3.py): random heads written in exactly the public file layout
(config.json naming LlamaForCausalLMEagle3, fc, midlayer.*, norm, lm_head, d2t, t2d in
safetensors) at tiny shapes, loaded through the path `--head` takes, draft replies equal to plain
decoding's, greedy and seeded; the layers they read; and heads of another shape or layout
refused with what differs. Nothing is downloaded."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from tiny import byte_tokenizer, loaded, tiny_gemma3, tiny_llama

from specchat.core.engine import Engine
from specchat.core.events import StepRecord, TokenEvent
from specchat.core.request import GenerateConfig
from specchat.drafters.ngram import NgramDrafter
from specchat.loader import head_drafters, load_engine
from specchat.models.eagle import target_features
from specchat.models.eagle3 import aux_layers, is_eagle3, load_eagle3
from specchat.models.eagle_files import HeadMismatchError
from specchat.runners.hf.runner import HFRunner

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = byte_tokenizer()
TEXT = "the cat sat on the mat. the dog sat on the log. the cat"
HEADS, KV_HEADS = 4, 2  # the head's attention: grouped queries, as Llama 3's heads have


def ids_of(text):
    return TOK(text)["input_ids"]


def llama7(seed=0):
    """A tiny Llama of 7 layers: the head reads the inputs of layers (2, 3, 4)."""
    return tiny_llama(seed, layers=7)


def write_public_head(directory, target, vocab_ids=range(40, 104), seed=0, config=None,
                      tensors=None, drop=()):
    """A random EAGLE-3 head for `target` written as the public heads are: config.json and
    model.safetensors with their names, shapes and dtypes (bf16 weights, int64 d2t, bool t2d).
    `config` and `tensors` override entries; `drop` leaves tensors out."""
    from safetensors.torch import save_file

    cfg = target.config.get_text_config()
    d, vocab, inter = cfg.hidden_size, cfg.vocab_size, 2 * cfg.hidden_size
    hd = d // HEADS
    draft = torch.tensor(list(vocab_ids))
    n = len(draft)
    gen = torch.Generator().manual_seed(seed)

    def linear(rows, cols):
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    def norm():
        return 1 + 0.1 * torch.randn(d, generator=gen)

    weights = {
        "fc.weight": linear(d, 3 * d),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": linear(HEADS * hd, 2 * d),
        "midlayer.self_attn.k_proj.weight": linear(KV_HEADS * hd, 2 * d),
        "midlayer.self_attn.v_proj.weight": linear(KV_HEADS * hd, 2 * d),
        "midlayer.self_attn.o_proj.weight": linear(d, HEADS * hd),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": linear(inter, d),
        "midlayer.mlp.up_proj.weight": linear(inter, d),
        "midlayer.mlp.down_proj.weight": linear(d, inter),
        "norm.weight": norm(),
        "lm_head.weight": 4 * linear(n, d),
    }
    weights = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft] = True
    weights.update({"d2t": draft - torch.arange(n), "t2d": t2d})
    weights.update(tensors or {})
    for key in drop:
        del weights[key]
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()},
              str(directory / "model.safetensors"))
    config_json = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                   "hidden_size": d, "intermediate_size": inter, "num_attention_heads": HEADS,
                   "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1,
                   "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                   "max_position_embeddings": 2048, "vocab_size": vocab,
                   "draft_vocab_size": n, "tie_word_embeddings": False,
                   "torch_dtype": "bfloat16", **(config or {})}
    (directory / "config.json").write_text(json.dumps(config_json))
    return directory


def plain_reply(target, prompt, **cfg):
    engine = Engine(loaded(target, TOK), {"ngram": NgramDrafter()})
    return [e.id for e in engine.stream(prompt, GenerateConfig(max_new_tokens=30,
                                                               speculation=False, **cfg))
            if isinstance(e, TokenEvent)]


# -- the layers it reads -----------------------------------------------------------------------


def test_the_layers_read_are_vllms_and_sglangs():
    assert aux_layers({}, 32) == (2, 16, 29)  # Llama 3.1 8B: (2, L // 2, L - 3)
    assert aux_layers({}, 3) == (0, 1, 2)  # in layer order, as the engines' loops append them
    assert aux_layers({"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}, 32) == (1, 5, 9)
    assert aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}},
                      32) == (2, 6, 10)


@pytest.mark.parametrize("make", [llama7, tiny_gemma3])
def test_layer_features_are_the_hidden_states_entering_those_layers(make):
    """The hooks keep what transformers' output_hidden_states[i] holds for i < L: the input of
    layer i (the earlier layer's output). Index L is the last layer's output, before the final
    norm (transformers' last entry is after it)."""
    target = make(0)
    ids = ids_of(TEXT)
    L = target.config.num_hidden_layers
    with torch.no_grad():
        states = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in (2, 1, 0)], dim=-1)
    assert torch.allclose(target_features(target, ids, (2, 1, 0)), want, atol=1e-6)
    last = target_features(target, ids, (L,))
    with torch.no_grad():
        assert torch.allclose(target.get_decoder().norm(last), states[L][0], atol=1e-6)


# -- the network -------------------------------------------------------------------------------


def rms(x, weight, eps=1e-5):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference(w, hidden, embeds, theta=500000.0):
    """The public head's forward over positions 0..T-1 from its tensors, written from SGLang's
    llama_eagle3.py with plain torch: hidden [T, d] after fc (or the head's own h), embeds
    [T, d] -> (h [T, d], logits [T, N])."""
    w = {k: v.float() for k, v in w.items()}
    T, d = hidden.shape
    hd = d // HEADS
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]),
                   rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(T, HEADS, hd).transpose(0, 1)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(T, KV_HEADS, hd).transpose(0, 1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(T, KV_HEADS, hd).transpose(0, 1)
    angles = torch.arange(T)[:, None] / theta ** (torch.arange(0, hd, 2) / hd)[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(t):
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat([-t2, t1], -1) * sin

    q, k = rope(q), rope(k).repeat_interleave(HEADS // KV_HEADS, 0)
    v = v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, d)
    residual = att @ w["midlayer.self_attn.o_proj.weight"].T + hidden
    x = rms(residual, w["midlayer.post_attention_layernorm.weight"])
    gate, up = x @ w["midlayer.mlp.gate_proj.weight"].T, x @ w["midlayer.mlp.up_proj.weight"].T
    mlp = (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    h = mlp + residual
    return h, rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


def test_the_head_computes_the_public_layouts_forward(tmp_path):
    """Fused target features through fc at true positions, then the head's own h fed back
    (fc skipped) at a draft position with the KV cache: the logits a plain-torch reading of
    the layout gives, and target ids = draft ids + d2t."""
    from safetensors.torch import load_file

    target = llama7(0)
    path = write_public_head(tmp_path / "head", target)
    head = load_eagle3(path, target)
    w = load_file(str(path / "model.safetensors"))
    assert torch.equal(head.vocab_ids, torch.arange(40, 104))
    T, d = 6, target.config.hidden_size
    feats, embeds = torch.randn(1, T, 3 * d), torch.randn(1, T + 1, d)
    with torch.no_grad():
        h, logits, cache = head(feats, embeds[:, :T], torch.arange(T))
        _, logits2, _ = head(h[:, -1:], embeds[:, T:], torch.tensor([T]), cache)
    hidden = torch.cat([feats[0] @ w["fc.weight"].float().T, h[0, -1:]])
    ref_h, ref_logits = reference(w, hidden, embeds[0])
    assert torch.allclose(logits[0], ref_logits[:T], atol=1e-4)
    assert torch.allclose(h[0], ref_h[:T], atol=1e-4)
    assert torch.allclose(logits2[0], ref_logits[T:], atol=1e-4)


# -- lossless drafting -------------------------------------------------------------------------


def draft_vocab(target, prompt) -> list[int]:
    """The tokens plain greedy emits, and a few others: a random head over this vocabulary
    drafts some tokens that pass."""
    return sorted(set(plain_reply(target, prompt)) | {40, 41, 42, 43})


@pytest.mark.parametrize("make", [llama7, tiny_gemma3])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_with_a_public_head_equals_plain_greedy(tmp_path, make, k):
    target = make(0)
    prompt = ids_of(TEXT)
    path = write_public_head(tmp_path / "head", target, draft_vocab(target, prompt))
    assert is_eagle3(path)
    drafters, notes = head_drafters(loaded(target, TOK), NgramDrafter(), path, min_gain=0.0)
    L = target.config.num_hidden_layers  # 7: layers (2, 3, 4); Gemma's 3: (0, 1, 2)
    assert notes == [] and drafters["head"].feature_layers == tuple(sorted({2, L // 2, L - 3}))
    engine = Engine(loaded(target, TOK), {"ngram": NgramDrafter(), **drafters})
    accepted = 0

    def run(**cfg):
        nonlocal accepted
        out = []
        for e in engine.stream(prompt, GenerateConfig(max_new_tokens=30, adaptive=False, **cfg)):
            if isinstance(e, TokenEvent):
                out.append(e.id)
            elif isinstance(e, StepRecord):
                accepted += e.accepted
        return out

    plain = run(speculation=False)
    for name in ("head", "combined"):
        for tree_nodes in (0, 6):
            assert run(drafter=name, draft_len=k, tree_nodes=tree_nodes) == plain, name
    assert accepted > 0
    # The engine hands the verify forwards' layer features over: the drafter never ran the
    # target itself.
    assert drafters["head"].computed == 0


@pytest.mark.parametrize("make", [llama7, tiny_gemma3])
def test_seeded_sampled_speculation_with_a_public_head_replays_plain_sampling(tmp_path, make):
    target = make(0)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(4)  # sharper: drafts sometimes pass
    prompt = ids_of(TEXT)
    path = write_public_head(tmp_path / "head", target, draft_vocab(target, prompt))
    drafters, _ = head_drafters(loaded(target, TOK), NgramDrafter(), path, min_gain=0.0)
    engine = Engine(loaded(target, TOK), {"ngram": NgramDrafter(), **drafters})

    def run(**cfg):
        return [e.id for e in engine.stream(prompt, GenerateConfig(max_new_tokens=30, seed=11,
                                                                     **cfg))
                if isinstance(e, TokenEvent)]

    for sampling in ({"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}):
        plain = run(speculation=False, **sampling)
        for name in ("head", "combined"):
            for tree_nodes in (0, 6):
                assert run(drafter=name, draft_len=3, tree_nodes=tree_nodes, adaptive=False,
                           **sampling) == plain, (name, tree_nodes, sampling)


def test_a_prompt_from_the_prefix_store_brings_the_layers_features(tmp_path):
    """Pages taken from the prefix store hand the head the three layers' features a fresh
    encoding gives: the head never runs the target itself."""
    target = llama7(0)
    path = write_public_head(tmp_path / "head", target)

    def engine_with_head():
        drafters, _ = head_drafters(loaded(target, TOK), NgramDrafter(), path)
        return Engine(loaded(target, TOK), drafters), drafters["head"]

    def reply(engine, ids):
        list(engine.stream(ids, GenerateConfig(max_new_tokens=6, drafter="head", draft_len=2,
                                               adaptive=False)))

    preamble = ids_of(TEXT * 3)  # two pages of 64 and 41 tokens
    first, other, last = preamble + ids_of(" one"), ids_of("something else " * 5), \
        preamble + ids_of(" two")
    engine, drafter = engine_with_head()
    for ids in (first, other, last):
        reply(engine, ids)
    assert engine.prefixes.hits == 1 and drafter.computed == 0
    fresh_engine, fresh = engine_with_head()
    reply(fresh_engine, last)
    drafter._flush()
    fresh._flush()
    assert drafter.feats.shape[1] == 3 * target.config.hidden_size
    assert torch.equal(drafter.feats[:len(last)], fresh.feats[:len(last)])


def test_t2d_is_optional_and_d2t_too_over_the_whole_vocabulary(tmp_path):
    """vLLM and SGLang skip t2d, and vLLM reads no d2t as draft id = target id."""
    target = llama7(0)
    head = load_eagle3(write_public_head(tmp_path / "a", target, drop=("t2d",)), target)
    assert torch.equal(torch.nonzero(head.t2d)[:, 0], torch.arange(40, 104))
    whole = write_public_head(tmp_path / "b", target, vocab_ids=range(259), drop=("d2t", "t2d"))
    assert torch.equal(load_eagle3(whole, target).vocab_ids, torch.arange(259))


def test_a_public_head_on_a_pytorch_bin_loads_the_same(tmp_path):
    from safetensors.torch import load_file

    target = llama7(0)
    path = write_public_head(tmp_path / "head", target)
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    torch.save(tensors, path / "pytorch_model.bin")
    head = load_eagle3(path, target)
    assert torch.equal(head.lm_head.weight, tensors["lm_head.weight"].float())


# -- through load_engine, the CLI's path -------------------------------------------------------


def generate_json(capsys, *args) -> tuple[list[int], dict, str]:
    """`python -m specchat generate --json` in this process -> (token ids, stats, stderr)."""
    from specchat.cli import main

    capsys.readouterr()
    assert main(["generate", "--quantization", "none", "--device", "cpu", "--raw", "--json",
                 "--db", "off", "--max-new-tokens", "24", "--prompt", TEXT, *args]) == 0
    out = capsys.readouterr()
    lines = [json.loads(line) for line in out.out.splitlines()]
    return [x["id"] for x in lines if x["type"] == "token"], lines[-1], out.err


def test_generate_takes_a_public_head_directory_with_head(tmp_path, capsys):
    """The CLI's path: --head DIR loads the head (load_engine, head_drafters), and the
    reply is plain decoding's; a head for another shape is refused on stderr and lookup
    drafts instead."""
    from specchat.models.synthetic import save

    target = llama7(0)
    checkpoint = str(save(target, TOK, tmp_path / "target"))
    path = write_public_head(tmp_path / "head", target, draft_vocab(target, ids_of(TEXT)))
    plain, _, _ = generate_json(capsys, "--target", checkpoint, "--speculation", "off")
    ids, stats, _ = generate_json(capsys, "--target", checkpoint, "--head", str(path),
                                  "--drafter", "head", "--draft-len", "3", "--fixed-draft-len")
    assert ids == plain and stats["drafter"] == "head" and stats["drafted"] > 0
    again, stats, _ = generate_json(capsys, "--target", checkpoint, "--draft-head", str(path),
                                    "--drafter", "head", "--draft-len", "3", "--fixed-draft-len")
    assert again == plain and stats["drafter"] == "head"  # the name vLLM's users look for
    other = write_public_head(tmp_path / "other", tiny_llama(0, layers=7, hidden=64))
    ids, stats, err = generate_json(capsys, "--target", checkpoint, "--head", str(other))
    assert "Draft head refused" in err and "hidden states 64 wide, the target's are 32" in err
    assert ids == plain and stats["drafter"] != "head"


@pytest.fixture(scope="module")
def gemma_nf4(tmp_path_factory):
    """A Gemma 3 checkpoint whose every layer specchat's NF4 kernel takes (as in
    test_every_runner.py), and an EAGLE-3 head for it: (checkpoint, head directory)."""
    pytest.importorskip("bitsandbytes")
    from specchat.models.synthetic import save

    base = tmp_path_factory.mktemp("gemma3")
    model = tiny_gemma3(0, hidden=128, head_dim=64)
    for m in model.modules():
        if type(m).__name__ == "Gemma3RMSNorm":
            torch.nn.init.normal_(m.weight, std=0.5)
    checkpoint = save(model.to(torch.bfloat16), TOK, base / "target")
    return str(checkpoint), str(write_public_head(base / "head", model))


def kernel_paths() -> list[str]:
    from specchat.models import runtime
    from specchat import kernels

    return [p.name for p in runtime.candidates(forced="")
            if p.kernels and not p.fused_nf4 and kernels.load(p.kernels) is not None]


def load_on(path: str, checkpoint: str, **kw):
    from specchat.models import runtime

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(runtime.ENV, path)
        return load_engine(checkpoint, quantization="nf4", device="cpu",
                           progress=lambda *a: None, prefix_tokens=0, **kw)


def tokens(engine, **cfg):
    return [e.id for e in engine.stream(ids_of(TEXT), GenerateConfig(max_new_tokens=24, **cfg))
            if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("path", kernel_paths())
def test_specchats_cpu_forward_gives_the_layers_and_drafts_plain_replies(gemma_nf4, path):
    """CpuRunner's C forward copies the residual stream entering the head's layers: the target
    stays on it, the features are transformers' hooks' (same weights and kernels), and greedy
    and seeded replies are plain decoding's."""
    from specchat.runners.cpu.runner import CpuRunner

    checkpoint, head = gemma_nf4
    report = load_on(path, checkpoint, head=head)
    engine = report.engine
    assert isinstance(engine.runner, CpuRunner) and report.notes == []
    layers = engine.drafters["head"].feature_layers
    ids = ids_of(TEXT)
    engine.runner.watch_features(layers)
    engine.runner.forward(engine.runner.new_cache(), ids, 0, 1)
    hooked = target_features(engine.target.model, ids, layers)
    got = engine.runner.features(len(ids))
    if engine.runner.int8:  # integer products: within their int8 roundings (docs/cpu.md)
        assert (got - hooked).norm() <= 0.03 * hooked.norm()
    else:
        assert torch.allclose(got, hooked, rtol=1e-3, atol=1e-3)
    for sampling in ({}, {"temperature": 0.8, "seed": 5}):
        plain = tokens(engine, speculation=False, **sampling)
        for name in ("head", "combined"):
            for tree_nodes in (0, 6):
                assert tokens(engine, drafter=name, draft_len=3, adaptive=False,
                              tree_nodes=tree_nodes, **sampling) == plain, (name, sampling)


def test_a_runner_without_layer_features_gives_way_to_transformers_forward(gemma_nf4,
                                                                           monkeypatch):
    """Where the target's runner keeps only the final norm's output (`layer_features` False:
    specchat's CUDA runtime), the target moves to transformers' forward over the same weights
    and kernels, proved row-exact again, and the load says so. (On a float path: transformers'
    forward has no integer product, so `cpu-int8`'s own replies are not its to give.)"""
    from specchat.models import runtime
    from specchat.runners.cpu.runner import CpuRunner

    integer = {p.name for p in runtime.PATHS if p.int8}
    paths = [p for p in kernel_paths() if p not in integer]
    if not paths:
        pytest.skip("no float kernels path builds here")
    checkpoint, head = gemma_nf4
    plain = load_on(paths[0], checkpoint)
    monkeypatch.setattr(CpuRunner, "layer_features", False)
    report = load_on(paths[0], checkpoint, head=head)
    engine = report.engine
    assert isinstance(engine.runner, HFRunner) and engine.target.row_exact
    assert any("EAGLE-3" in n and "CpuRunner" in n and "transformers' forward" in n
               for n in report.notes), report.notes
    want = tokens(plain.engine, speculation=False)
    assert tokens(engine, speculation=False) == want
    assert tokens(engine, drafter="head", draft_len=3, adaptive=False) == want


def test_a_runner_without_layer_features_is_refused_by_the_engine(tmp_path):
    target = llama7(0)
    drafters, _ = head_drafters(loaded(target, TOK), NgramDrafter(),
                                write_public_head(tmp_path / "head", target))
    model = loaded(target, TOK)
    model.runner.layer_features = False  # as specchat's CPU and CUDA forwards declare
    engine = Engine(model, {"ngram": NgramDrafter(), **drafters})
    with pytest.raises(ValueError, match="gives no decoder layer's hidden states"):
        list(engine.stream(ids_of(TEXT), GenerateConfig(max_new_tokens=4, drafter="head")))


def test_a_hub_id_is_fetched_into_the_hubs_cache_and_loaded(tmp_path, monkeypatch):
    """--head owner/name: config.json and the weights through the hub's client (here a stand-in:
    tests download nothing); a fetch that fails is refused with why."""
    import huggingface_hub

    target = llama7(0)
    local = write_public_head(tmp_path / "cache" / "snapshot", target)
    asked = []

    def snapshot_download(repo_id, allow_patterns):
        asked.append((repo_id, allow_patterns))
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    drafters, notes = head_drafters(loaded(target, TOK), NgramDrafter(), "someone/EAGLE3-tiny")
    assert notes == [] and set(drafters) == {"head", "combined"}
    assert asked == [("someone/EAGLE3-tiny",
                      ["config.json", "model.safetensors", "pytorch_model.bin"])]

    def offline(repo_id, allow_patterns):
        raise OSError("offline, and not in the cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    drafters, notes = head_drafters(loaded(target, TOK), NgramDrafter(), "someone/EAGLE3-tiny")
    assert drafters == {} and "could not fetch the head someone/EAGLE3-tiny" in notes[0]
    assert "offline, and not in the cache" in notes[0]


def test_the_layout_at_llama_3_1_8b_shapes():
    """The public layout at Llama 3.1 8B's sizes (4096 wide, 32 query heads over 8 KV heads,
    MLP 14336, 32 layers, vocabulary 128256) with a 32000-token draft vocabulary: fc reads
    three 4096-wide layers, q, k and v read 8192."""
    from transformers import LlamaConfig

    from specchat.models.eagle3 import expected_shapes

    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256)
    config.draft_vocab_size = 32000
    assert expected_shapes(config, 3 * 4096, 128256) == {
        "fc.weight": (4096, 12288), "norm.weight": (4096,), "lm_head.weight": (32000, 4096),
        "d2t": (32000,), "t2d": (128256,),
        "midlayer.input_layernorm.weight": (4096,), "midlayer.hidden_norm.weight": (4096,),
        "midlayer.post_attention_layernorm.weight": (4096,),
        "midlayer.self_attn.q_proj.weight": (4096, 8192),
        "midlayer.self_attn.k_proj.weight": (1024, 8192),
        "midlayer.self_attn.v_proj.weight": (1024, 8192),
        "midlayer.self_attn.o_proj.weight": (4096, 4096),
        "midlayer.mlp.gate_proj.weight": (14336, 4096),
        "midlayer.mlp.up_proj.weight": (14336, 4096),
        "midlayer.mlp.down_proj.weight": (4096, 14336)}


# -- refused heads -----------------------------------------------------------------------------


def refusal(tmp_path, target, **head):
    """The note head_drafters gives for a head written with `head`'s changes."""
    path = write_public_head(tmp_path / "head", target, **head)
    drafters, notes = head_drafters(loaded(target, TOK), NgramDrafter(), path)
    assert drafters == {} and len(notes) == 1
    return notes[0]


def test_a_head_for_another_targets_shape_is_refused_with_what_differs(tmp_path):
    small = llama7(0)
    wide = tiny_llama(0, layers=7, hidden=64)
    write_public_head(tmp_path / "small", small)
    with pytest.raises(HeadMismatchError, match="hidden states 32 wide, the target's are 64"):
        load_eagle3(tmp_path / "small", wide)
    note = refusal(tmp_path, small, config={"vocab_size": 300})
    assert "its vocabulary is 300 tokens, the target's 259" in note
    note = refusal(tmp_path, small, config={"eagle_aux_hidden_state_layer_ids": [1, 3, 12]})
    assert "it reads the target's layers [1, 3, 12], the target has 7" in note
    two_layers = tiny_llama(0, layers=2)  # the default (2, L // 2, L - 3) falls outside it
    assert "the target has 2" in refusal(tmp_path, two_layers)


def test_a_head_whose_layout_differs_is_refused_with_what_differs(tmp_path):
    target = llama7(0)
    d = target.config.hidden_size
    # EAGLE-1's attention reads d, not the 2d-wide [embedding, hidden state]
    note = refusal(tmp_path, target, tensors={
        "midlayer.self_attn.q_proj.weight": torch.zeros(d, d, dtype=torch.bfloat16)})
    assert "does not have the public layout" in note
    assert f"midlayer.self_attn.q_proj.weight is [{d}, {d}], expected [{d}, {2 * d}]" in note
    note = refusal(tmp_path, target, drop=("d2t",))  # a draft vocabulary needs its map
    assert "d2t missing" in note
    note = refusal(tmp_path, target, tensors={"layers.0.mlp.up_proj.weight": torch.zeros(2)})
    assert "layers.0.mlp.up_proj.weight is not in the EAGLE-3 layout" in note
    note = refusal(tmp_path, target, config={"num_hidden_layers": 2})
    assert "2 decoder layers" in note
    note = refusal(tmp_path, target, tensors={"d2t": torch.full((64,), 1000)})
    assert "d2t maps draft ids outside the target's 259 tokens" in note
    # A directory whose config names another architecture is not taken for an EAGLE-3 head.
    path = write_public_head(tmp_path / "other", target,
                             config={"architectures": ["LlamaForCausalLM"]})
    assert not is_eagle3(path)
    with pytest.raises(HeadMismatchError, match="not an EAGLE-3 head"):
        load_eagle3(path, target)


def test_the_page_names_the_heads_kind_and_where_an_eagle3_head_came_from(tmp_path):
    from specchat.drafters.ngram import NgramDrafter
    from specchat.loader import head_drafters
    from specchat.models.load import load_model
    from specchat.models.synthetic import save

    target = llama7(0)
    checkpoint = str(save(target, TOK, tmp_path / "target"))
    path = write_public_head(tmp_path / "head", target)
    loaded = load_model(checkpoint, "none", "cpu", progress=lambda *_: None)
    drafters, _ = head_drafters(loaded, NgramDrafter(), path)
    assert drafters["head"].label == f"draft head (EAGLE-3: {path})"


def test_the_llama_preset_drafts_with_the_public_eagle3_head_unless_head_says_otherwise():
    """A preset names the public EAGLE-3 head for its target where one is published; --head
    overrides it, and a preset without one (or no preset) leaves the trained head's lookup."""
    from specchat.args import head_choice
    from specchat.cli import build_parser

    def choice(*argv):
        return head_choice(build_parser().parse_args(["generate", *argv, "--prompt", "hi"]))

    assert choice("--preset", "llama3.1-8b") == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert choice("--preset", "llama3.1-8b", "--head", "some/head") == "some/head"
    assert choice("--preset", "qwen2.5-7b") is None
    assert choice() is None
