"""Batched sampling with features (train-draft's phase 1): left-padded rows of different lengths
give each prompt's own greedy reply, the teacher-forced features and top-1 tokens of it, and
sampled rows draw from softmax(top-k / T)."""

import pytest
import torch
from tiny import byte_tokenizer, tiny_gemma3, tiny_llama

from specchat.models.eagle import target_features
from specchat.train.batched import sample_with_features

TOK = byte_tokenizer()
PROMPTS = ["the cat sat on the mat", "a", "hello there, general kenobi. the dog sat on"]


pytestmark = pytest.mark.usefixtures("one_thread")


def greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])  # gemma3: sliding window 16
def test_greedy_rows_are_each_prompts_own_greedy_reply_with_its_features(make):
    model = make(0).eval()
    with torch.no_grad():  # a random model is nearly uniform: sharper, so no near-ties
        model.lm_head.weight.mul_(20)
    prompts = [TOK(p)["input_ids"] for p in PROMPTS]
    out = sample_with_features(model, prompts, [False] * 3, max_new_tokens=24, temperature=1.0,
                               top_k=8, stop=set(), pad=0)
    for p, r in zip(prompts, out):
        assert r.prompt_len == len(p) and r.ids[:len(p)] == p
        assert r.ids[len(p):] == greedy(model, p, 24)[:23]  # the 24th token was not fed
        assert r.feats.shape == (len(r.ids), model.config.hidden_size)
        assert r.top1.shape == (len(r.ids),)
        # The features are the teacher-forced ones (bf16-rounded).
        teacher = target_features(model, r.ids)
        assert torch.allclose(r.feats.float(), teacher, atol=0.05 * teacher.abs().max())
        # top-1 is known from the reply's first decision on, and is the next greedy token.
        assert (r.top1[:len(p) - 1] == -1).all()
        assert r.top1[len(p) - 1:-1].tolist() == r.ids[len(p):]


def test_rows_leave_at_a_stop_token_and_keep_every_fed_position():
    model = tiny_llama(1).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    prompts = [TOK(p)["input_ids"] for p in PROMPTS]
    ref = [greedy(model, p, 12) for p in prompts]
    stop = {ref[0][3]}  # the first row writes it as its 4th token
    out = sample_with_features(model, prompts, [False] * 3, 12, 1.0, 8, stop, pad=0)
    first = out[0]
    assert first.ids[len(prompts[0]):] == ref[0][:3]
    assert len(first.feats) == len(first.ids) and len(first.top1) == len(first.ids)
    assert first.top1[-1] == ref[0][3]  # the stop token was the target's choice
    for p, r, want in zip(prompts[1:], out[1:], ref[1:]):
        cut = next((i for i, t in enumerate(want) if t in stop), len(want) - 1)
        assert r.ids[len(p):] == want[:cut]


def test_rows_leave_where_a_stop_string_is_complete():
    """A base model's plain chat format ends a turn with a stop string ("\nUser:"), not a
    token: the row leaves when its reply's text contains one."""
    from specchat.core.text import stop_check
    model = tiny_llama(0).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    prompts = [TOK(p)["input_ids"] for p in PROMPTS]
    ref = [greedy(model, p, 12) for p in prompts]
    text = TOK.decode(ref[0][1:3])  # the first row completes it with its 3rd token
    assert len(text) == 2 and text not in TOK.decode(ref[0][:2])
    ends = stop_check(TOK, [text])
    out = sample_with_features(model, prompts, [False] * 3, 12, 1.0, 8, set(), 0,
                               ends=[ends, None, ends])  # row 1: plain text, no stop strings
    assert out[0].ids[len(prompts[0]):] == ref[0][:2]  # the 3rd was written, never fed
    assert len(out[0].feats) == len(out[0].ids)
    assert out[1].ids[len(prompts[1]):] == ref[1][:11]  # to the cap (the 12th never fed)
    cut = next((i for i in range(1, 12) if text in TOK.decode(ref[2][:i])), 12)
    assert out[2].ids[len(prompts[2]):] == ref[2][:cut - 1]


def test_sampled_rows_draw_from_the_tempered_top_k():
    model = tiny_llama(2).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4)
    prompt = TOK("the cat")["input_ids"]
    rows = 3000
    gen = torch.Generator().manual_seed(0)
    out = sample_with_features(model, [prompt] * rows, [True] * rows, 2, 0.7, 5, set(), 0, gen)
    firsts = torch.tensor([r.ids[len(prompt)] for r in out])
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    top = logits.topk(5)
    want = torch.softmax(top.values / 0.7, -1)
    assert torch.isin(firsts, top.indices).all()  # nothing outside the top 5
    freq = torch.stack([(firsts == i).float().mean() for i in top.indices])
    assert 0.5 * (freq - want).abs().sum() < 0.03


def test_stock_attention_is_restored_to_row_exact_afterwards():
    from specchat.runners.hf.attention import (
        is_row_exact,
        stock_attention,
        use_row_exact_attention,
    )
    model = tiny_gemma3(3).eval()
    assert use_row_exact_attention(model) and is_row_exact(model)
    with stock_attention(model):
        assert not is_row_exact(model)
    assert is_row_exact(model)
