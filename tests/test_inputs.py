"""The one check of user-given settings and text (`core.inputs`): page, CLI and API share it."""

import math

import pytest

from specchat.core.inputs import SEED_MAX, InputError, check_settings, clean_text

GOOD = dict(max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=40, seed=1, draft_len=4)


def test_good_values_are_normalized():
    out = check_settings(**{**GOOD, "max_new_tokens": "64", "seed": 3.0, "top_k": 40.0})
    assert out == dict(max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=40, seed=3,
                       draft_len=4, tree_nodes=None)
    assert check_settings(**{**GOOD, "seed": SEED_MAX})["seed"] == SEED_MAX
    assert check_settings(**{**GOOD, "seed": -1})["seed"] is None  # a fresh random seed
    assert check_settings(**{**GOOD, "seed": None})["seed"] is None
    assert check_settings(**GOOD, tree_nodes=10)["tree_nodes"] == 10
    assert check_settings(**{**GOOD, "top_p": 1})["top_p"] == 1.0


@pytest.mark.parametrize(("key", "value", "message"), [
    ("temperature", math.nan, "Temperature must be a finite number (got nan)."),
    ("temperature", math.inf, "Temperature must be a finite number (got inf)."),
    ("temperature", "nan", "Temperature must be a finite number"),
    ("temperature", -0.1, "Temperature must be a finite number >= 0"),
    ("top_p", 0, "Top-p must be in (0, 1]"),
    ("top_p", 1.5, "Top-p must be in (0, 1]"),
    ("top_p", -math.inf, "Top-p must be a finite number"),
    ("top_k", -1, "Top-k must be a whole number >= 0"),
    ("max_new_tokens", 0, "Max new tokens must be a whole number >= 1"),
    ("max_new_tokens", 2.5, "Max new tokens must be a whole number"),
    ("draft_len", 17, "Draft length k must be a whole number between 1 and 16"),
    ("seed", SEED_MAX + 1, f"Seed must be a whole number between 0 and {SEED_MAX}"),
    ("seed", 1.5, "or -1 for a random seed (got 1.5)"),
    ("seed", "x", "Seed must be a number (got 'x')"),
    ("seed", True, "Seed must be a finite number"),
])
def test_bad_values_name_the_setting_and_what_is_allowed(key, value, message):
    with pytest.raises(InputError) as error:
        check_settings(**{**GOOD, key: value})
    assert message in str(error.value)


def test_the_cli_names_its_flags():
    with pytest.raises(InputError, match=r"^--temperature must be a finite number"):
        check_settings(**{**GOOD, "temperature": math.nan}, names={"temperature": "--temperature"})
    with pytest.raises(InputError, match="Tree nodes must be"):
        check_settings(**GOOD, tree_nodes=65)


def test_clean_text_replaces_lone_surrogates_only():
    assert clean_text(None) == ""
    assert clean_text("bad \ud800 and \udfff end") == "bad \ufffd and \ufffd end"
    assert clean_text("emoji 😀, accents é, CJK 中") == "emoji 😀, accents é, CJK 中"
    clean_text("x\ud83d").encode("utf-8")  # encodable now
