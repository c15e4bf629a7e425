"""A prompt longer than the target's context window is refused before any work, in words."""

import pytest

from specchat.engine import Engine, GenerateConfig
from tests.tiny import loaded, tiny_gemma3


def test_prompt_past_the_context_window_is_refused_and_replies_stop_at_it():
    model = tiny_gemma3(0)
    model.config.max_position_embeddings = 40
    engine = Engine(loaded(model))
    with pytest.raises(ValueError, match="the prompt is 40 tokens; tiny reads at most 40"):
        list(engine.stream([5] * 40, GenerateConfig(max_new_tokens=8, speculation=False)))
    events = list(engine.stream([5] * 36, GenerateConfig(max_new_tokens=50, speculation=False)))
    stats = events[-1]
    assert stats.new_tokens <= 4 and stats.stop_reason in ("length", "eos")
