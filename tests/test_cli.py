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


def generate_here(capsys, *args):
    """`generate` in this process (`cli.main`): for what is refused before a model is loaded,
    where a subprocess would spend its time importing torch. -> (exit code, stderr)"""
    from specchat.cli import main
    capsys.readouterr()
    try:
        code = main(["generate", *args])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    return code, capsys.readouterr().err


def parse(stdout, with_steps=False):
    lines = [json.loads(line) for line in stdout.splitlines()]
    tokens = [x for x in lines if x["type"] == "token"]
    steps = [x for x in lines if x["type"] == "step"]
    assert lines[-1]["type"] == "stats"
    assert all(x["type"] in ("token", "step") for x in lines[:-1])
    return (tokens, steps, lines[-1]) if with_steps else (tokens, lines[-1])


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


def test_bad_input_gets_a_clear_message(tiny_dirs, tmp_path, capsys):
    code, err = generate_here(capsys, "--target", str(tmp_path / "nope"), "--prompt", "hi")
    assert code == 1 and "no such directory" in err
    code, err = generate_here(capsys, "--target", str(tmp_path), "--prompt", "hi")
    assert code == 1 and "holds no model: it has no config.json" in err
    (tmp_path / "model.bin").write_bytes(b"\x00" * 64)
    code, err = generate_here(capsys, "--target", str(tmp_path / "model.bin"), "--prompt", "hi")
    assert code == 1 and "model.bin is a file but not a GGUF" in err and "a GGUF file" in err
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    code, err = generate_here(capsys, "--target", str(tmp_path / "model.gguf"), "--prompt", "hi")
    assert code == 1 and "model.gguf is truncated" in err
    code, err = generate_here(capsys, "--target", tiny_dirs["target"], "--prompt", "   ")
    assert code == 2 and "prompt is empty" in err
    # a real process, offline as a user without a network is: the hub's refusal in one line
    proc = generate("--target", "no-such-org/no-such-model", "--prompt", "hi", check=False)
    assert proc.returncode == 1 and "could not be fetched" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_step_lines_explain_each_step_and_agree_with_the_tokens(tiny_dirs):
    proc = generate("--target", tiny_dirs["target"], "--draft-model", tiny_dirs["draft"],
                    "--quantization", "none", "--prompt", "the cat sat on the mat. the cat",
                    "--max-new-tokens", "24", "--json", "--raw", "--fixed-draft-len")
    tokens, steps, stats = parse(proc.stdout, with_steps=True)
    assert steps and [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    for record in steps:
        mine = [t for t in tokens if t["step"] == record["step"]]
        assert all(t["step_drafted"] == record["drafted"] for t in mine)
        if record["drafted"]:
            n = record["accepted"]
            assert [t["id"] for t in mine[:n]] == record["proposal"][:n]
            evidence = record["evidence"]
            if len(mine) == n + 1:
                assert mine[n]["id"] == evidence["token"]
            if n < record["drafted"]:
                assert evidence["rejected"] == record["proposal"][n]
                assert len(mine) <= n or mine[n]["kind"] == "resampled"
    assert sum(s["drafted"] for s in steps) == stats["drafted"]
    assert sum(s["accepted"] for s in steps) == stats["accepted"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--temperature", "nan"], "--temperature must be a finite number (got nan)."),
    (["--temperature", "inf"], "--temperature must be a finite number (got inf)."),
    (["--top-p", "nan"], "--top-p must be a finite number"),
    (["--seed", "9223372036854775808"], "--seed must be a whole number between 0 and "
                                        "9223372036854775807, or -1 for a random seed"),
])
def test_bad_numbers_get_one_clear_line_not_a_traceback(tiny_dirs, flags, message, capsys):
    code, err = generate_here(capsys, "--target", tiny_dirs["target"], "--prompt", "hi", *flags)
    assert code == 2 and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_lone_surrogate_in_the_prompt_is_replaced(tiny_dirs):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-m", "specchat", "generate", "--target", tiny_dirs["target"],
         "--quantization", "none", "--max-new-tokens", "4", "--json", "--raw"],
        input="bad \udc80 text".encode("utf-8", "surrogateescape"), capture_output=True,
        env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    _, stats = parse(proc.stdout.decode())
    assert stats["new_tokens"] == 4


def test_a_bad_database_is_reported_once_and_the_row_exists_before_the_stats_line(tiny_dirs,
                                                                                tmp_path):
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"not a database" * 100)
    proc = generate("--target", tiny_dirs["target"], "--quantization", "none", "--prompt", "hi",
                    "--max-new-tokens", "4", "--json", "--db", str(corrupt))
    assert proc.stderr.count("is corrupt") == 1

    # Read the database the moment the stats line appears: the turn is already there.
    from specchat.stats.store import StatsStore
    good = tmp_path / "good.db"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    with subprocess.Popen([sys.executable, "-m", "specchat", "generate", "--target",
                           tiny_dirs["target"], "--quantization", "none", "--prompt", "hi",
                           "--max-new-tokens", "4", "--json", "--db", str(good)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                          cwd=ROOT) as proc:
        for line in proc.stdout:
            if json.loads(line)["type"] == "stats":
                store = StatsStore(good)
                (conversation,) = store.conversations()
                assert len(store.turns(conversation["id"])) == 1
                store.close()
                break


# -- --help: one metavar per flag, every default said ------------------------------------------

def commands() -> dict:
    """Every command's parser: `python -m specchat`'s subcommands and `python app.py`."""
    from specchat.app import build_parser as app_parser
    from specchat.cli import build_parser
    (sub,) = [a for a in build_parser()._actions if a.choices and "generate" in a.choices]
    return {**sub.choices, "app": app_parser()}


def options(parser, own_only=False):
    """(option, how --help writes its value: 'N', '{nf4,none}', ...; None for a switch, and
    the option's entry in --help) for each option of `parser`; with `own_only`, only those in
    its own group, not the shared groups (models, decoding, sampling, ...)."""
    formatter = parser._get_formatter()
    actions = parser._optionals._group_actions if own_only else parser._actions
    for action in actions:
        if not action.option_strings or action.nargs == 0 and action.dest == "help":
            continue
        value = None if action.nargs == 0 else formatter._format_args(
            action, formatter._get_default_metavar_for_optional(action))
        entry = " ".join(formatter._format_action(action).split())  # unwrapped
        for option in action.option_strings:
            yield option, value, entry


MINE = ("generate", "stats", "train-draft", "bench")  # the commands checked against all of these
PEERS = (*MINE, "serve", "app")


def test_a_flag_writes_its_value_the_same_way_in_every_command():
    parsers = commands()
    seen = {}  # option -> {value as --help writes it: [commands]}
    for name in PEERS:
        for option, value, _ in options(parsers[name]):
            if value is not None:
                seen.setdefault(option, {}).setdefault(value, []).append(name)
    for name in MINE:
        for option, value, _ in options(parsers[name]):
            if value is not None:
                assert len(seen[option]) == 1, f"{option}: {seen[option]}"
    assert {*seen["--threads"]} == {"N"} and {*seen["--db"]} == {"PATH"}


def test_every_option_says_its_default():
    """Each option these commands define (the shared model and sampling flags come from
    `args` and `core.settings`) says its default, or what happens when it is not given."""
    parsers = commands()
    for name in MINE:
        for option, value, entry in options(parsers[name], own_only=True):
            if value is not None:  # a switch is off unless given
                assert "default: " in entry and "(default: )" not in entry, (name, option)


def test_bitsandbytes_kernels_hub_note_is_dropped_and_its_other_messages_kept(caplog):
    """bitsandbytes on an AVX512-BF16 CPU warns at import that it cannot fetch a kernel from a
    hub: specchat is offline by design, so that note is dropped; its other messages stay."""
    import logging

    import specchat  # noqa: F401  (installs the filter)
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=log.name):
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s", "no")
        log.warning("a real problem")
    assert [r.getMessage() for r in caplog.records] == ["a real problem"]
