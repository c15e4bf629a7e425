"""Row-exact attention: a verify forward's logits equal one-token decoding's, bit for bit."""

import collections

import pytest
import torch
from test_engine import REPETITIVE, TOK, TopKTreeDrafter, run
from tiny import loaded, tiny_gemma3, tiny_llama

from specchat.core.engine import Engine
from specchat.drafters.ngram import NgramDrafter
from specchat.runners.hf.attention import (
    is_row_exact,
    padded,
    row_exact_sdpa,
    use_row_exact_attention,
)
from specchat.runners.hf.kvcache import PagedLayer, new_cache


class RowByRowHead(torch.nn.Module):
    """The LM head one row at a time. oneDNN's bf16 matmul for a 32-wide head is not exact per
    row at every width (the embedded target's 640-wide head is; test_real_model checks it), and
    these tests are about the attention."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x):
        return torch.cat([self.head(x[:, i:i + 1]) for i in range(x.shape[1])], 1)


def bf16(make, exact=True, lib=None):
    model = make(0).to(torch.bfloat16)
    model.lm_head = RowByRowHead(model.lm_head)
    model.config._attn_implementation = "sdpa"
    if exact:
        assert use_row_exact_attention(model, lib) and is_row_exact(model)
    return model


@torch.inference_mode()
def logits_by_widths(model, prompt, new, widths):
    """Encode `prompt`, then feed `new` in chunks of `widths` (cycled); logits of each new token."""
    cache = new_cache(model, paged=is_row_exact(model))
    model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    out, i, w = [], 0, 0
    while i < len(new):
        chunk = new[i:i + widths[w % len(widths)]]
        logits = model(torch.tensor([chunk]), past_key_values=cache, use_cache=True).logits[0]
        out += list(logits)
        i, w = i + len(chunk), w + 1
    return torch.stack(out)


def mismatches(model):
    """Positions whose logits differ between one-token steps and wider forwards, 44 tokens
    from position 20: well past tiny_gemma3's 16-token sliding window."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 259, (20,), generator=g).tolist()
    new = torch.randint(3, 259, (44,), generator=g).tolist()
    one = logits_by_widths(model, prompt, new, [1])
    wide = logits_by_widths(model, prompt, new, [5, 3, 11, 2, 7])
    return int((one != wide).any(-1).sum())


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_wide_forwards_give_one_token_logits_bit_for_bit(make):
    assert mismatches(bf16(make)) == 0


def test_the_check_catches_attention_whose_rows_depend_on_their_neighbours():
    """The comparison above can fail: an attention whose output for a row moves with the number
    of rows fed beside it (as a blocked product's rounding can) is caught."""
    from transformers import AttentionInterface

    def row_dependent(module, query, *args, **kwargs):
        out, weights = row_exact_sdpa(module, query, *args, **kwargs)
        return out + 1e-2 * (query.shape[2] - 1), weights

    AttentionInterface.register("row_dependent_test", row_dependent)
    model = bf16(tiny_llama, exact=False)
    model.set_attn_implementation("row_dependent_test")
    assert mismatches(model) > 0


def test_only_sdpa_models_on_cpu_are_switched():
    model = tiny_llama(0)
    model.config._attn_implementation = "eager"
    assert not use_row_exact_attention(model) and not is_row_exact(model)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_bf16_greedy_speculation_is_plain_greedy(make):
    """bf16 arithmetic, n-gram chains and draft trees: the same tokens as plain greedy."""
    target = bf16(make)
    engine = Engine(loaded(target, TOK), {"ngram": NgramDrafter()})
    engine.drafters["tree"] = TopKTreeDrafter(bf16(make))
    plain, _, _ = run(engine, REPETITIVE, speculation=False, max_new_tokens=64)
    for drafter in ("ngram", "tree"):
        spec, _, _ = run(engine, REPETITIVE, speculation=True, drafter=drafter, draft_len=5,
                         adaptive=False, tree_nodes=12, max_new_tokens=64)
        assert [t.id for t in spec] == [t.id for t in plain]
        assert collections.Counter(t.kind for t in spec)["accepted"] > 0


def test_paged_cache_pads_keys_without_copying():
    model = bf16(tiny_gemma3)
    cache = new_cache(model, paged=is_row_exact(model))
    with torch.inference_mode():
        model(torch.arange(3, 73)[None], past_key_values=cache, use_cache=True)  # 70 tokens
        model(torch.tensor([[5]]), past_key_values=cache, use_cache=True)
    layer = cache.layers[0]  # a sliding-window layer, holding every token all the same
    assert isinstance(layer, PagedLayer) and layer.get_seq_length() == 71
    keys = layer.keys
    view = padded(keys, 128)
    assert view.data_ptr() == keys.data_ptr() and view.shape[2] == 128
    assert torch.equal(view[:, :, :71], keys) and not view[:, :, 71:].any()
    copy = padded(keys.clone(), 128)  # not a paged layer's: padded by a copy, with zeros
    assert copy.data_ptr() != keys.data_ptr() and torch.equal(copy, view)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_kernel_is_attention_and_row_exact(dtype):
    """`kernels.attend` against float64 attention (grouped heads, a sliding-window mask, keys
    and values read from a wider cache buffer), and each query row the same bits alone or
    among up to 11 rows."""
    from specchat import kernels
    lib = kernels.load()
    if lib is None:
        pytest.skip("specchat's kernels cannot be built here")
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, slots, rows = 4, 2, 72, 150, 11
    buffer = torch.randn(1, kv_heads, 256, dim, generator=g).to(dtype)
    key, value = buffer[:, :, :slots], buffer.flip(-1).contiguous()[:, :, :slots]
    query = torch.randn(1, heads, rows, dim, generator=g).to(dtype)
    position = torch.arange(slots - rows, slots)[:, None]
    slot = torch.arange(slots)[None, :]
    mask = ((slot <= position) & (position - slot < 40))[None, None]  # causal, window of 40
    got = kernels.attend(lib, query, key, value, mask, 0.125)

    rep = heads // kv_heads
    want = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double().repeat_interleave(rep, 1),
        value.double().repeat_interleave(rep, 1), attn_mask=mask, scale=0.125)
    assert (got.double() - want).abs().max() < 1e-5
    for n in range(1, rows):
        alone = kernels.attend(lib, query[:, :, n - 1:n], key, value, mask[:, :, n - 1:n], 0.125)
        assert torch.equal(alone[:, :, 0], got[:, :, n - 1])
        first = kernels.attend(lib, query[:, :, :n], key, value, mask[:, :, :n], 0.125)
        assert torch.equal(first, got[:, :, :n])


def test_narrow_forwards_attend_through_the_kernel(monkeypatch):
    """Where the kernels build, a decoding step and a verify go through `kernels.attend` (and
    give the one-token logits, as above); a prompt of 64 rows or more takes sdpa."""
    from specchat import kernels
    if kernels.load() is None:
        pytest.skip("specchat's kernels cannot be built here")
    calls = []
    attend = kernels.attend
    monkeypatch.setattr(kernels, "attend", lambda *a: calls.append(a[1].shape[2]) or attend(*a))
    model = bf16(tiny_gemma3, lib=kernels.load())
    cache = new_cache(model, paged=is_row_exact(model))
    with torch.inference_mode():
        model(torch.arange(3, 73)[None], past_key_values=cache, use_cache=True)  # 70 rows
        assert calls == []
        model(torch.tensor([[5]]), past_key_values=cache, use_cache=True)
        model(torch.tensor([[6, 7, 8, 9, 10]]), past_key_values=cache, use_cache=True)
    assert calls == [1] * 3 + [5] * 3  # three layers a forward


def test_wide_forwards_skip_keys_outside_every_rows_window():
    """`attended_keys` drops the leading whole pages of keys no row of a wide forward attends to
    (a sliding layer's keys older than its window) and nothing a row does attend to."""
    from specchat.runners.hf.attention import PAGE, attended_keys

    slots, rows, window = 5 * PAGE, PAGE, 40
    key = torch.randn(1, 2, slots, 8)
    value = torch.randn(1, 2, slots, 8)
    position = torch.arange(slots - rows, slots)[:, None]  # the rows: the last PAGE slots
    slot = torch.arange(slots + 16)[None, :]  # the mask is wider than the keys (padding)
    sliding = ((slot <= position) & (slot > position - window))[None, None]
    k, v, m = attended_keys(key, value, sliding)
    first = (slots - rows - window + 1) // PAGE * PAGE  # 192: the page holding the first kept key
    assert first == 3 * PAGE and k.shape[2] == v.shape[2] == slots - first
    assert torch.equal(k, key[:, :, first:]) and torch.equal(m, sliding[..., first:])
    assert not sliding[..., :first].any()  # only keys no row attends to went
    full = (slot <= position)[None, None]  # a full-attention layer: every key kept
    assert attended_keys(key, value, full)[0] is key
    assert attended_keys(key, value, None)[2] is None


def test_a_long_prompt_attends_to_its_window_in_sliding_layers(monkeypatch):
    """A prompt of several pages on a model with a 16-token window: the wide pages' sliding
    layers get the cut keys, and the logits stay those of attention over every key (within
    float32 rounding: fewer masked keys change the kernel's blocking, not what it computes)."""
    import specchat.runners.hf.attention as attention

    model = tiny_gemma3(0)
    model.config._attn_implementation = "sdpa"
    assert use_row_exact_attention(model, None)
    prompt = torch.randint(3, 259, (4 * attention.PAGE + 5,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    cut = []
    real = attention.attended_keys

    def spy(key, value, mask):
        out = real(key, value, mask)
        cut.append(key.shape[2] - out[0].shape[2])
        return out

    def encode():
        cache = new_cache(model, paged=True)
        with torch.inference_mode():
            return torch.cat([model(torch.tensor([prompt[i:i + attention.PAGE]]),
                                    past_key_values=cache, use_cache=True).logits[0]
                              for i in range(0, len(prompt), attention.PAGE)])

    monkeypatch.setattr(attention, "attended_keys", spy)
    got = encode()
    assert max(cut) == 2 * attention.PAGE  # the last whole page (from 192) needs keys from 177
    monkeypatch.setattr(attention, "attended_keys", lambda k, v, m: (k, v, m))
    want = encode()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    monkeypatch.setattr(attention, "attended_keys", real)
    assert torch.equal(encode(), got)  # the same prompt, the same bits
