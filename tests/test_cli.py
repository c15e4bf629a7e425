"""The headless contract (docs/design.md): `python -m specchat generate ... --json`."""

import json
import os
import subprocess
import sys

import pytest
from tiny import byte_tokenizer, tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """A tiny target, a compatible draft and an incompatible one, saved as HF checkpoints."""
    base = tmp_path_factory.mktemp("models")
    out = {}
    for name, seed, extra in (("target", 0, None), ("draft", 1, None), ("other", 2, ["<x>"])):
        tok = byte_tokenizer(extra)
        model = tiny_llama(seed, vocab=len(tok))
        model.save_pretrained(base / name)
        tok.save_pretrained(base / name)
        out[name] = str(base / name)
    return out


def generate(*args, check=True):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "specchat", "generate", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def parse(stdout):
    lines = [json.loads(line) for line in stdout.splitlines()]
    tokens = [x for x in lines if x["type"] == "token"]
    assert lines[-1]["type"] == "stats" and all(x["type"] == "token" for x in lines[:-1])
    return tokens, lines[-1]


def test_generate_json_contract(tiny_dirs):
    proc = generate("--target", tiny_dirs["target"], "--draft-model", tiny_dirs["draft"],
                    "--quantization", "none", "--prompt", "the cat sat on the mat. the cat",
                    "--max-new-tokens", "20", "--json", "--raw")
    tokens, stats = parse(proc.stdout)
    assert len(tokens) == stats["new_tokens"] == 20
    assert {t["kind"] for t in tokens} <= {"accepted", "resampled", "bonus", "target"}
    for key in ("new_tokens", "seconds", "tokens_per_s", "target_calls", "drafted", "accepted",
                "acceptance_rate", "mean_accepted_len", "speculation", "drafter", "draft_len",
                "alpha"):
        assert key in stats
    assert stats["drafter"] == "model" and stats["speculation"] is True
    if stats["drafted"]:
        assert stats["acceptance_rate"] == pytest.approx(stats["accepted"] / stats["drafted"])


def test_greedy_cli_speculation_on_and_off_agree(tiny_dirs):
    common = ["--target", tiny_dirs["target"], "--quantization", "none", "--raw", "--json",
              "--prompt", "abc abc abc abc", "--max-new-tokens", "24"]
    on, _ = parse(generate(*common, "--drafter", "ngram").stdout)
    off, stats = parse(generate(*common, "--speculation", "off").stdout)
    assert [t["id"] for t in on] == [t["id"] for t in off]
    assert stats["speculation"] is False and {t["kind"] for t in off} == {"target"}


def test_incompatible_draft_is_refused_with_the_difference(tiny_dirs):
    proc = generate("--target", tiny_dirs["target"], "--draft-model", tiny_dirs["other"],
                    "--quantization", "none", "--prompt", "hello", "--max-new-tokens", "4",
                    "--json", "--raw")
    assert "refused" in proc.stderr and "tokenizer size 259 vs 260" in proc.stderr
    _, stats = parse(proc.stdout)
    assert stats["drafter"] == "ngram"


def test_bad_input_gets_a_clear_message(tiny_dirs, tmp_path):
    proc = generate("--target", str(tmp_path / "nope"), "--prompt", "hi", check=False)
    assert proc.returncode == 1 and "no such directory" in proc.stderr
    proc = generate("--target", str(tmp_path), "--prompt", "hi", check=False)
    assert proc.returncode == 1 and "holds no model: it has no config.json" in proc.stderr
    proc = generate("--target", tiny_dirs["target"], "--prompt", "   ", check=False)
    assert proc.returncode == 2 and "prompt is empty" in proc.stderr
    proc = generate("--target", "no-such-org/no-such-model", "--prompt", "hi", check=False)
    assert proc.returncode == 1 and "could not be fetched" in proc.stderr
