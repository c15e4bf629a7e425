"""`train-draft --style eagle3` (train/eagle3.py): the training-time-test forward is the head's
own drafting, step for step; a tiny run lowers the loss, resumes, and saves a head in exactly
the public layout (the names, shapes and dtypes the public files have, the keys vLLM's and
SGLang's loaders read), which loads through `--head` and drafts replies equal to plain
decoding's. Nothing is downloaded."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from test_eagle3 import write_public_head
from tiny import byte_tokenizer, loaded, tiny_gemma3, tiny_llama

from specchat.core.engine import Engine
from specchat.core.events import GenerationStats, StepRecord, TokenEvent
from specchat.core.request import GenerateConfig
from specchat.drafters.ngram import NgramDrafter
from specchat.loader import head_drafters
from specchat.models.eagle3 import load_eagle3
from specchat.train import cli as train_cli
from specchat.train import config as train_config
from specchat.train import eagle3
from specchat.train import features as train_features
from specchat.train import fit as train_fit
from specchat.ui.inspector import step_charts

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = byte_tokenizer()
TEXT = "the cat sat on the mat. the dog sat on the log. the cat"
WORDS = ["cats", "dogs", "rain", "bread", "maps", "ships", "tea", "snow", "jazz", "owls",
         "sand", "kites"]


def llama7(seed=0):
    """A tiny Llama of 7 layers: an EAGLE-3 head reads the inputs of layers (2, 3, 4)."""
    model = tiny_llama(seed, layers=7)
    with torch.no_grad():  # a random model is nearly uniform: give it something to teach
        model.lm_head.weight.mul_(20)
    return model


def random_head(model, vocab=range(3, 60)) -> eagle3.Eagle3Head:
    torch.manual_seed(1)
    head, _ = eagle3.new_head(model, torch.tensor(list(vocab)))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head.eval()


@pytest.mark.parametrize("make", [llama7, tiny_gemma3])
@pytest.mark.parametrize("steps", [1, 3])
def test_training_time_test_is_the_heads_own_drafting_step_for_step(make, steps):
    """Unroll step s at array position t equals drafting s tokens after true position t: the
    head's forward over positions 0..t with its KV cache, then s forwards of one token each,
    each reading the hidden state before and the next true token, at positions t + 1 .. t + s.
    (Llama's grouped queries, 4 over 2; Gemma's head_dim apart from d / heads.)"""
    model = make(0)
    head = random_head(model)
    d = model.config.hidden_size
    assert head.fc.in_features == len(head.feature_layers) * d
    T = 9
    torch.manual_seed(2)
    aux = torch.randn(1, T, head.fc.in_features)
    embeds = torch.randn(1, T + steps - 1, d)
    with torch.no_grad():
        out = eagle3.unrolled(head, aux, embeds, steps)
        assert [h.shape[1] for h in out] == [T - s for s in range(steps)]
        for t in range(T - steps + 1):
            h, _, cache = head(aux[:, :t + 1], embeds[:, :t + 1], torch.arange(t + 1))
            torch.testing.assert_close(out[0][:, t], h[:, t], rtol=1e-4, atol=1e-4)
            h = h[:, -1:]
            for s in range(1, steps):
                h, _, cache = head(h, embeds[:, t + s:t + s + 1], torch.tensor([t + s]), cache)
                torch.testing.assert_close(out[s][:, t], h[:, 0], rtol=1e-4, atol=1e-4)


def tiny_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"say something about {w}"}) for w in WORDS))
    return path


def tiny_config(tmp_path, **kw) -> train_config.TrainConfig:
    # seq_len: the byte tokenizer spends a token per character of the chat preamble
    return train_config.TrainConfig(**{
        "out": tmp_path / "run", "minutes": 5, "prompt_files": [tiny_prompts(tmp_path)],
        "max_new_tokens": 24, "gen_batch": 4, "seq_len": 1024, "draft_vocab": 48,
        "batch_tokens": 256, "lr": 3e-3, "warmup_steps": 5, "max_steps": 40, "noise": 0.0,
        "style": "eagle3", "unroll": 3, **kw})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(target, config, head directory, summary) of one tiny EAGLE-3 training run."""
    tmp_path = tmp_path_factory.mktemp("eagle3-train")
    torch.manual_seed(0)
    target = loaded(llama7(), TOK)
    cfg = tiny_config(tmp_path)
    path, summary = train_cli.run(target, cfg, progress=lambda m: None)
    return target, cfg, path, summary


def test_a_tiny_run_lowers_the_loss_and_resumes(trained, tmp_path):
    target, cfg, path, summary = trained
    assert summary["steps"] == 40 and summary["train_positions"] > 200
    assert {"holdout_top1@1", "holdout_top1@2", "holdout_top1@3"} <= set(summary)
    head = load_eagle3(path, target.model)
    records = train_features.load_features(cfg.out)
    d = target.model.config.hidden_size
    assert records and all(r["aux"].shape == (len(r["ids"]), 3 * d) for r in records)
    batch = train_fit.collate([r for r in records if not r["heldout"]][:8], target.device)
    fresh, _ = eagle3.new_head(target.model, head.vocab_ids)
    embed = head.embedder(target.model)
    losses = []
    for h in (fresh, head):
        h = eagle3.attach_target(h, target.model)
        h.aux_std = torch.ones(1)
        with torch.no_grad():
            losses.append(float(eagle3.head_loss(h, embed, batch, cfg, train=False)[0]))
    assert losses[1] < 0.7 * losses[0], losses
    # Resumable: the same command again continues from the checkpoint (in a copy of the work
    # directory, which the other tests read).
    shutil.copytree(cfg.out, tmp_path / "copy")
    again = train_config.TrainConfig(**{**cfg.__dict__, "out": tmp_path / "copy",
                                        "max_steps": 43})
    _, summary2 = train_cli.run(target, again, progress=lambda m: None)
    assert summary2["steps"] == 43


def test_the_saved_head_has_exactly_the_public_layout(trained, tmp_path):
    """Names, shapes and dtypes as a public head's files (test_eagle3.write_public_head), the
    config keys vLLM and SGLang read, and d2t/t2d describing one draft vocabulary."""
    target, cfg, path, _ = trained
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == cfg.draft_vocab
    assert config["vocab_size"] == target.model.config.vocab_size
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # the public default
    public = write_public_head(tmp_path / "public", target.model,
                               vocab_ids=range(cfg.draft_vocab))
    with safe_open(str(path / "model.safetensors"), "pt") as ours, \
            safe_open(str(public / "model.safetensors"), "pt") as theirs:
        assert set(ours.keys()) == set(theirs.keys())
        for key in ours.keys():
            a, b = ours.get_slice(key), theirs.get_slice(key)
            assert a.get_dtype() == b.get_dtype(), key
            if key.startswith(("d2t", "t2d", "lm_head", "norm", "fc")):
                assert a.get_shape() == b.get_shape(), key
        d2t, t2d = ours.get_tensor("d2t"), ours.get_tensor("t2d")
        meta = json.loads(ours.metadata()["specchat"])
    ids = torch.arange(len(d2t)) + d2t
    assert torch.equal(torch.nonzero(t2d)[:, 0], ids)  # sorted, each target id once
    assert meta["steps"] == 40 and meta["target"]["vocab"]
    assert meta["config"]["out"] == "run"  # the directory's name, not this machine's path


def test_the_trained_head_drafts_replies_equal_to_plain_decoding(trained):
    target, _, path, _ = trained
    drafters, notes = head_drafters(target, NgramDrafter(), path, min_gain=0.0)
    assert set(drafters) == {"head", "combined"} and notes == []
    assert drafters["head"].label.startswith("draft head (EAGLE-3")
    engine = Engine(target, {"ngram": NgramDrafter(), **drafters})
    prompt = TOK(TEXT)["input_ids"]

    def run(**cfg):
        tokens, steps, stats = [], [], None
        for e in engine.stream(prompt, GenerateConfig(max_new_tokens=24, adaptive=False, **cfg)):
            if isinstance(e, TokenEvent):
                tokens.append(e.id)
            elif isinstance(e, StepRecord):
                steps.append(e)
            elif isinstance(e, GenerationStats):
                stats = e
        return tokens, steps, stats

    for sampling in ({}, {"temperature": 0.8, "seed": 3}):
        plain, _, stats = run(speculation=False, **sampling)
        assert stats.draft_head is None
        for name in ("head", "combined"):
            spec, steps, stats = run(drafter=name, draft_len=3, **sampling)
            assert spec == plain, (name, sampling)
            assert sum(s.drafted for s in steps) > 0
            # The inspector names the head's kind under the reply.
            assert stats.draft_head == "EAGLE-3 draft head"
            assert "drafts by the EAGLE-3 draft head" in step_charts(steps, stats)


def test_the_trained_head_on_a_bf16_target_keeps_replies_and_second_turns_plain(trained):
    """transformers' forward in bf16 hands the head bf16 layer features: a repeated request
    and a second turn still give plain decoding's text."""
    import copy
    target, _, path, _ = trained
    bf16 = loaded(copy.deepcopy(target.model).to(torch.bfloat16), TOK)
    drafters, notes = head_drafters(bf16, NgramDrafter(), path, min_gain=0.0)
    assert notes == []
    engine = Engine(bf16, {"ngram": NgramDrafter(), **drafters})
    first = TOK(TEXT)["input_ids"]

    def reply(prompt, **cfg):
        return [e.id for e in engine.stream(prompt, GenerateConfig(
            max_new_tokens=16, adaptive=False, **cfg)) if isinstance(e, TokenEvent)]

    plain = reply(first, speculation=False)
    second = first + plain + TOK(" and then")["input_ids"]
    plain2 = reply(second, speculation=False)
    for name in ("head", "combined"):
        for _ in range(2):  # the same request again, whatever ran before
            assert reply(first, drafter=name, draft_len=3) == plain, name
        assert reply(second, drafter=name, draft_len=3) == plain2, name


def test_init_fine_tunes_an_eagle3_head_and_refuses_what_is_not_one(trained, tmp_path):
    """--init with --style eagle3 starts from an EAGLE-3 head directory (its vocabulary and
    weights) in a new work directory; a path that holds none is refused with what it takes."""
    target, cfg, path, _ = trained
    tuned_cfg = train_config.TrainConfig(**{**cfg.__dict__, "out": tmp_path / "tuned",
                                            "init": path, "max_steps": 3, "lr": 1e-3,
                                            "generate": False, "data": []})
    shutil.copytree(cfg.out / "features", tuned_cfg.out / "features")
    tuned_path, summary = train_cli.run(target, tuned_cfg, progress=lambda m: None)
    assert summary["steps"] == 3
    before, after = load_eagle3(path, target.model), load_eagle3(tuned_path, target.model)
    assert torch.equal(before.vocab_ids, after.vocab_ids)
    assert not torch.equal(before.fc.weight, after.fc.weight)
    wrong = train_config.TrainConfig(**{**tuned_cfg.__dict__, "out": tmp_path / "wrong",
                                        "init": tmp_path / "no-head"})
    shutil.copytree(cfg.out / "features", wrong.out / "features")
    with pytest.raises(SystemExit, match="takes an EAGLE-3 head directory"):
        train_cli.run(target, wrong, progress=lambda m: None)


def test_a_work_directory_keeps_one_style(trained, tmp_path):
    target, cfg, _, _ = trained
    eagle1 = train_config.TrainConfig(**{**cfg.__dict__, "style": "eagle1",
                                         "feature_layers": None, "unroll": 1})
    with pytest.raises(SystemExit, match="--style eagle3, not --style eagle1"):
        train_cli.run(target, eagle1, progress=lambda m: None)


def test_the_command_line_takes_the_style_and_its_unroll():
    import argparse

    from specchat.train.cli import add_cli
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["train-draft", "--style", "eagle3"])
    assert (args.style, args.unroll) == ("eagle3", 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["train-draft", "--style", "eagle2"])
