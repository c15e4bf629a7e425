"""The one check of user-given settings (`core.settings`) and text (`core.inputs`): page, CLI
and API share them."""

import math

import pytest

from specchat.core.inputs import InputError, clean_text
from specchat.core.penalties import Penalties
from specchat.core.settings import SEED_MAX, build_config, check, flag_names, values_from_body
from specchat.drafters import preferred

GOOD = dict(max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=40, seed=1, draft_len=4)


def test_good_values_are_normalized():
    out = check({**GOOD, "max_new_tokens": "64", "seed": 3.0, "top_k": 40.0})
    assert out == dict(max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=40, seed=3,
                       draft_len=4)
    assert check({"seed": SEED_MAX})["seed"] == SEED_MAX
    assert check({"seed": -1})["seed"] is None  # a fresh random seed
    assert check({"seed": None})["seed"] is None  # not given: the default, -1
    assert check({"tree_nodes": 10})["tree_nodes"] == 10
    assert check({"top_p": 1})["top_p"] == 1.0
    assert check({"min_p": None, "repeat_penalty": None}) == {"min_p": 0.0, "repeat_penalty": 1.0}


@pytest.mark.parametrize(("key", "value", "message"), [
    ("temperature", math.nan, "Temperature must be a finite number (got nan)."),
    ("temperature", math.inf, "Temperature must be a finite number (got inf)."),
    ("temperature", "nan", "Temperature must be a finite number"),
    ("temperature", -0.1, "Temperature must be a number >= 0"),
    ("top_p", 0, "Top-p must be a number in (0, 1]"),
    ("top_p", 1.5, "Top-p must be a number in (0, 1]"),
    ("top_p", -math.inf, "Top-p must be a finite number"),
    ("top_k", -1, "Top-k must be a whole number between 0 and 1000000"),
    ("min_p", 1.5, "Min-p must be a number between 0 and 1"),
    ("repeat_penalty", 0, "Repeat penalty must be a number > 0"),
    ("frequency_penalty", 3, "Frequency penalty must be a number between -2 and 2"),
    ("dry_base", 0.5, "DRY base must be a number between 1 and 10"),
    ("dry_allowed_length", 0, "DRY allowed length must be a whole number between 1 and 64"),
    ("max_new_tokens", 0, "Max new tokens must be a whole number >= 1"),
    ("max_new_tokens", 2.5, "Max new tokens must be a whole number"),
    ("draft_len", 17, "Draft length k must be a whole number between 1 and 16"),
    ("seed", SEED_MAX + 1, f"Seed must be a whole number between 0 and {SEED_MAX}"),
    ("seed", -5, "or -1 for a random seed (got -5)"),
    ("seed", 1.5, "or -1 for a random seed (got 1.5)"),
    ("seed", "x", "or -1 for a random seed (got 'x')"),
    ("seed", True, "or -1 for a random seed (got True)"),
])
def test_bad_values_name_the_setting_and_what_is_allowed(key, value, message):
    with pytest.raises(InputError) as error:
        check({**GOOD, key: value})
    assert message in str(error.value)


def test_the_cli_and_the_api_name_their_own_fields():
    with pytest.raises(InputError, match=r"^--temperature must be a finite number"):
        check({"temperature": math.nan}, flag_names())
    with pytest.raises(InputError, match="Tree nodes must be"):
        check({"tree_nodes": 65})
    values, names = values_from_body({"max_completion_tokens": 0, "temperature": None,
                                      "repetition_penalty": 1.2})
    assert values == {"max_new_tokens": 0, "repeat_penalty": 1.2}
    with pytest.raises(InputError, match=r"^max_completion_tokens must be a whole number >= 1"):
        check(values, names)


def test_one_builder_gives_every_front_end_the_same_request():
    cfg, notes = build_config({"temperature": "3", "max_new_tokens": 900, "min_p": "0.05",
                               "dry_multiplier": 0.8}, ["ngram", "head"], max_new_cap=512)
    assert (cfg.temperature, cfg.max_new_tokens, cfg.min_p, cfg.dry_multiplier) == \
        (2.0, 512, 0.05, 0.8)
    assert len(notes) == 2 and "Temperature capped" in notes[1]
    assert cfg.drafter == preferred(["ngram", "head"]) and cfg.speculation and cfg.seed is None
    assert "DRY 0.8 (base 1.75, allowed length 2)" in cfg.samplers()
    defaults, _ = build_config({}, ["ngram"])
    assert defaults.temperature == 0.0 and defaults.max_new_tokens == 256
    assert defaults.tree_nodes == 0 and defaults.penalties == Penalties()
    plain, notes = build_config({}, [])
    assert not plain.speculation and notes == ["No drafter is loaded: plain decoding."]
    with pytest.raises(InputError, match=r"Drafter 'server' is not loaded \(it needs a serving "
                                         r"engine as --backend URL\); loaded: ngram"):
        build_config({"drafter": "server"}, ["ngram"])
    with pytest.raises(InputError, match="DRY sequence breakers must be a list"):
        build_config({"dry_sequence_breakers": "\n"}, ["ngram"])


def test_clean_text_replaces_lone_surrogates_only():
    assert clean_text(None) == ""
    assert clean_text("bad \ud800 and \udfff end") == "bad \ufffd and \ufffd end"
    assert clean_text("emoji 😀, accents é, CJK 中") == "emoji 😀, accents é, CJK 中"
    clean_text("x\ud83d").encode("utf-8")  # encodable now


def test_the_engines_defaults_are_the_settings_tables():
    """GenerateConfig (core) cannot import the table above it, so its field defaults are
    written twice: they must agree. The seed is the one exception: code gets a fixed seed 0,
    the front ends a fresh random one (-1)."""
    from specchat.core.request import GenerateConfig
    from specchat.core.settings import SETTINGS
    from specchat.ui.state import Settings
    cfg, page = GenerateConfig(), Settings()
    for name, row in SETTINGS.items():
        if name in ("seed", "tree_nodes", "max_new_tokens"):
            continue
        assert getattr(cfg, name) == row.default, name
        assert getattr(page, name, row.default) == row.default, name
    assert page.seed == SETTINGS["seed"].default and page.max_new_tokens == 256
