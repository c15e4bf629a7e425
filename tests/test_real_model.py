"""The embedded Gemma 3 270M, for real (slow: ~1-2 min; the first run converts the GGUF)."""

import pytest

from specchat.engine import GenerateConfig, load_engine
from specchat.events import KINDS, GenerationStats, TokenEvent
from specchat.text import chat_prompt

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "List the days of the week, then list them again."}]


def collect(engine, cfg):
    ids, stops = chat_prompt(engine.tokenizer, PROMPT)
    cfg.stop = stops
    events = list(engine.stream(ids, cfg))
    return [e for e in events if isinstance(e, TokenEvent)], events[-1]


@pytest.mark.ci
def test_embedded_nf4_ngram_speculation_and_fp32_greedy_equivalence():
    nf4 = load_engine("embedded", quantization="nf4").engine
    assert nf4.target.quantization == "nf4"
    tokens, stats = collect(nf4, GenerateConfig(max_new_tokens=48, drafter="ngram"))
    assert isinstance(stats, GenerationStats) and stats.new_tokens > 0
    assert all(t.kind in KINDS for t in tokens)
    reply = "".join(t.text for t in tokens)
    assert reply.strip()
    assert reply == nf4.tokenizer.decode([t.id for t in tokens], skip_special_tokens=False)

    fp32 = load_engine("embedded", quantization="none").engine
    cfg = dict(max_new_tokens=48, adaptive=False, draft_len=4)
    plain, _ = collect(fp32, GenerateConfig(speculation=False, **cfg))
    spec, s = collect(fp32, GenerateConfig(speculation=True, drafter="ngram", **cfg))
    assert [t.id for t in spec] == [t.id for t in plain]
    assert s.drafted > 0
