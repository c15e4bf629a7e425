"""train-draft's prompts stay apart from the questions the bench measures the head on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import byte_tokenizer

from specchat.bench.questions import default_questions_path, load_questions
from specchat.train.cli import apart_from_bench
from specchat.core.text import PLAIN_PREAMBLE, PLAIN_STOPS, chat_prompt, raw_prompt
from specchat.train.data import (FORMATS, SYSTEM_PROMPTS, _prompts, load_prompts, prompt_format,
                                 question_overlap)

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared/benchmarks/spec_bench/question.jsonl"


def turns(path) -> list[str]:
    return [t for q in load_questions(path) for t in q["turns"]]


def test_a_shared_run_of_words_or_a_whole_short_question_ties_a_prompt():
    questions = ["Write a short story about a retired clockmaker who repairs the church clock.",
                 "Why is the sky blue?"]
    prompts = ["Please write a short story about a retired clockmaker who repairs clocks.",
               "Tell me: why is the SKY blue? And why are sunsets red?",
               "Write a story about a clock.",
               "Why is the sea salty?"]
    found = question_overlap(prompts, questions)
    assert [i for i, _ in found] == [0, 1]
    assert found[0][1] == "write a short story about a retired clockmaker"
    assert found[1][1] == "why is the sky blue"


def test_the_shipped_prompts_share_no_text_with_the_bench_questions():
    prompts = [p["prompt"] for p in load_prompts([])]
    assert len(prompts) >= 500
    assert question_overlap(prompts, turns(default_questions_path())) == []
    if not SPEC_BENCH.is_file():
        pytest.skip("Spec-Bench's question.jsonl is not beside the project")
    assert question_overlap(prompts, turns(SPEC_BENCH)) == []


def test_train_draft_leaves_out_prompts_tied_to_the_bench(tmp_path):
    question = turns(default_questions_path())[0]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in
                              ["Say something kind about rain.", "Please: " + question]))
    said = []
    kept = apart_from_bench(load_prompts([path]), "prompt", said.append)
    assert [p["prompt"] for p in kept] == ["Say something kind about rain."]
    assert "left out 1 prompt(s)" in said[0] and "mine:1" in said[0]


def test_prompts_are_asked_in_each_of_the_apps_formats():
    """The chat format, the chat format under a system prompt, and plain text to continue (the
    page's Completion mode, which has no stop strings): each prompt in one, fixed by its key."""
    tok = byte_tokenizer()
    todo = [{"key": f"chat:{i}", "prompt": f"Name a color, {i}."} for i in range(30)]
    todo += [{"key": "chat:3#1", "prompt": "Name a color, 3."}]
    ids, stops = _prompts(tok, todo, FORMATS)
    kinds = {p["key"]: prompt_format(p["key"], FORMATS) for p in todo}
    assert set(kinds.values()) == set(FORMATS)
    assert kinds["chat:3#1"] == kinds["chat:3"]  # a prompt's samples share its format
    for p in todo:
        text = tok.decode(ids[p["key"]])
        if kinds[p["key"]] == "completion":
            assert ids[p["key"]] == raw_prompt(tok, p["prompt"]) and stops[p["key"]] == ()
        elif kinds[p["key"]] == "system":
            assert any(s in text for s in SYSTEM_PROMPTS) and PLAIN_PREAMBLE not in text
            assert text.rstrip().endswith("Assistant:") and stops[p["key"]] == PLAIN_STOPS
        else:
            user = [{"role": "user", "content": p["prompt"]}]
            assert ids[p["key"]] == chat_prompt(tok, user)[0]
            assert stops[p["key"]] == PLAIN_STOPS
    only_chat, _ = _prompts(tok, todo, ("chat",))
    assert all(only_chat[k] == chat_prompt(tok, [{"role": "user", "content": p["prompt"]}])[0]
               for k, p in zip(only_chat, todo))
