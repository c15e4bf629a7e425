"""Every setting a user can give a reply, in one table, and the one builder that turns them into
a `GenerateConfig`: the page, the HTTP API, the CLI and the bench all go through `build_config`,
requests made in code (the checks, the page's warm-up, a server probe) through `request`.

    SETTINGS["min_p"].default, .label, .flag, .api, .help   # one row: how each front end names it
    cfg, notes = build_config({"temperature": "0.7", "drafter": "ngram"}, engine.drafters)
    cfg = request(engine.drafters, max_new_tokens=6, speculation=False)

A row names the setting for each front end (the page's label, the CLI flag, the API field with
OpenAI's name where OpenAI has the setting and llama.cpp's otherwise) and holds its default, its
range and its help, so a new sampler setting is one row here, a control on the page and its use
in the engine. Values arrive raw (numbers, numeric strings, None for "not given") and are
checked here: a bad one raises `InputError` with a sentence naming the setting, the value and
what is allowed, the same on every front end.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from specchat.core.drafter import preferred
from specchat.core.inputs import InputError
from specchat.core.penalties import DRY_BREAKERS
from specchat.core.request import GenerateConfig, default_tree_nodes

SEED_MAX = 2**63 - 1  # SQLite INTEGER and torch generators hold up to this

# What the page's examples sample with (and the bench by default), what keeps a small base model
# out of loops without bending its text: DRY stops verbatim repeats of 3+ tokens, the repeat
# penalty discourages reusing the last 64 tokens' words, min-p drops the unlikely tail.
ANTI_LOOP = dict(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, repeat_penalty=1.1,
                 repeat_last_n=64, min_p=0.05)

MAX_DRAFT_LEN = 16
MAX_TOP_K = 1_000_000  # more than any vocabulary: as good as off, and a number SQLite can store
MAX_TREE_NODES = 64
MAX_TEMPERATURE = 2.0  # past it a sampled reply is noise: requests above are capped, with a note
MAX_BREAKERS, MAX_BREAKER_CHARS = 16, 16


@dataclass(frozen=True)
class Setting:
    name: str  # the GenerateConfig field
    label: str  # the page's label; messages name the setting by it (or by the caller's names)
    default: float | int | None
    help: str
    integer: bool = False
    low: float | None = None  # None: unbounded
    high: float | None = None
    low_open: bool = False  # low itself is not allowed
    api: tuple[str, ...] = ()  # the HTTP API's field names, first the documented one
    group: str = "sampling"  # sampling | penalties | speculation | length
    rule: str = ""  # what is allowed, when the range alone does not say it

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def api_name(self) -> str:
        return self.api[0] if self.api else self.name

    def allowed(self) -> str:
        if self.rule:
            return self.rule
        kind, num = ("a whole number", "{:d}") if self.integer else ("a number", "{:g}")
        low = None if self.low is None else num.format(int(self.low) if self.integer else self.low)
        high = None if self.high is None else num.format(
            int(self.high) if self.integer else self.high)
        if low is not None and high is not None:
            if self.low_open:
                return f"{kind} in ({low}, {high}]"
            return f"{kind} between {low} and {high}"
        if low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {low}"
        return f"a finite {kind.split()[-1]}"

# The defaults are GenerateConfig's own (one place), but for the seed (-1 here: a new random one
# each reply, where a GenerateConfig built in code keeps 0) and tree_nodes (None here: chosen by
# the drafter and temperature, `default_tree_nodes`).
_D = {f.name: f.default for f in fields(GenerateConfig)}

_ROWS = (
    Setting("max_new_tokens", "Max new tokens", _D["max_new_tokens"], "longest reply, in tokens", True, 1,
            api=("max_tokens", "max_completion_tokens", "n_predict"), group="length"),
    Setting("temperature", "Temperature", _D["temperature"],
            f"0 = greedy; above {MAX_TEMPERATURE:g} is capped", low=0,
            api=("temperature",)),
    Setting("top_p", "Top-p", _D["top_p"], "nucleus sampling: keep the likeliest tokens holding this "
            "much of the probability (1 = off)", low=0, high=1, low_open=True, api=("top_p",)),
    Setting("top_k", "Top-k", _D["top_k"], "sample among the k likeliest tokens (0 = off)", True, 0,
            MAX_TOP_K, api=("top_k",)),
    Setting("min_p", "Min-p", _D["min_p"], "drop tokens less than min_p times as likely as the "
            "likeliest (0 = off)", low=0, high=1, api=("min_p",)),
    Setting("repeat_penalty", "Repeat penalty", _D["repeat_penalty"], "divide the logits of tokens seen in the "
            "last repeat_last_n tokens by this (1 = off; 1.1-1.3 is typical)", low=0,
            low_open=True, api=("repeat_penalty", "repetition_penalty"), group="penalties"),
    Setting("repeat_last_n", "Penalty window", _D["repeat_last_n"], "the last tokens the repeat, frequency and "
            "presence penalties look at (0 = off)", True, 0, 65536, api=("repeat_last_n",),
            group="penalties"),
    Setting("frequency_penalty", "Frequency penalty", _D["frequency_penalty"], "lower a token's logit by this much "
            "per time it occurs in the window", low=-2, high=2, api=("frequency_penalty",),
            group="penalties"),
    Setting("presence_penalty", "Presence penalty", _D["presence_penalty"], "lower the logit of every token in the "
            "window by this much", low=-2, high=2, api=("presence_penalty",), group="penalties"),
    Setting("dry_multiplier", "DRY multiplier", _D["dry_multiplier"], "DRY: penalize a token that would extend "
            "a repeated sequence (0 = off; 0.8 is typical)", low=0, high=100,
            api=("dry_multiplier",), group="penalties"),
    Setting("dry_base", "DRY base", _D["dry_base"], "DRY: the penalty grows by this factor per repeated "
            "token", low=1, high=10, api=("dry_base",), group="penalties"),
    Setting("dry_allowed_length", "DRY allowed length", _D["dry_allowed_length"], "DRY: repeats this long go "
            "unpenalized", True, 1, 64, api=("dry_allowed_length",), group="penalties"),
    Setting("seed", "Seed", -1, f"0..{SEED_MAX} gives the same sampled reply each time; -1 a "
            "new random one each reply (recorded in its stats)", True, -1, SEED_MAX,
            api=("seed",), rule=f"a whole number between 0 and {SEED_MAX}, or -1 for a random "
                                "seed"),
    Setting("draft_len", "Draft length k", _D["draft_len"], "k: the most draft tokens per step", True, 1,
            MAX_DRAFT_LEN, api=("draft_len",), group="speculation"),
    Setting("tree_nodes", "Tree nodes", None, "the head drafts a tree of up to this many tokens, "
            "verified in one forward; 0: a chain (default: 10 when greedy where the head's "
            "trees pay, else 0)", True, 0, MAX_TREE_NODES, api=("tree_nodes",),
            group="speculation"),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in _ROWS}
PENALTIES = [s.name for s in _ROWS if s.group == "penalties"]

# Why a drafter may be missing, for the message that refuses it.
_DRAFTER_NEEDS = {"model": "a --draft-model sharing the target's tokenizer",
                  "head": "a draft head for this target (python -m specchat train-draft)",
                  "combined": "a draft head for this target (python -m specchat train-draft)",
                  "server": "a serving engine as --backend URL"}


def check(values: Mapping, names: Mapping[str, str] | None = None) -> dict:
    """Raw numeric settings -> checked values, for the keys given (None: the default). Seed -1
    means a fresh random seed and comes back None; tree_nodes None means the default.
    `names` relabels settings in messages (the CLI names its flags, the API its fields)."""
    out = {}
    for key, raw in values.items():
        row = SETTINGS[key]
        label = (names or {}).get(key, row.label)
        value = row.default if raw is None else _number(label, raw, row)
        out[key] = value
    if "seed" in out and out["seed"] is not None and out["seed"] < 0:
        out["seed"] = None
    return out


def _number(label: str, raw, row: Setting):
    exact = _exact_int(raw)  # whole numbers stay ints: a float cannot tell 2^63 - 1 from 2^63
    try:
        x = exact if exact is not None else float(raw)
    except (TypeError, ValueError):
        raise InputError(f"{label} must be {row.allowed()} (got {raw!r}).") from None
    if isinstance(raw, bool):
        raise InputError(f"{label} must be {row.allowed()} (got {raw!r}).")
    if not math.isfinite(x):
        raise InputError(f"{label} must be a finite number (got {raw!r}).")
    below = row.low is not None and (x <= row.low if row.low_open else x < row.low)
    above = row.high is not None and x > row.high
    if below or above or (row.integer and x != int(x)):
        raise InputError(f"{label} must be {row.allowed()} (got {raw!r}).")
    return int(x) if row.integer else float(x)


def _exact_int(value) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    return None


def check_breakers(breakers) -> tuple[str, ...]:
    """DRY's sequence breakers: a list of short strings (None: the default ones)."""
    if breakers is None:
        return DRY_BREAKERS
    if (not isinstance(breakers, (list, tuple)) or len(breakers) > MAX_BREAKERS
            or not all(isinstance(b, str) and 0 < len(b) <= MAX_BREAKER_CHARS for b in breakers)):
        raise InputError(f"DRY sequence breakers must be a list of at most {MAX_BREAKERS} "
                         f"strings of 1 to {MAX_BREAKER_CHARS} characters (got {breakers!r}).")
    return tuple(breakers)


def resolve_drafter(asked: str | None, loaded: Sequence[str]) -> str:
    """The drafter a request names ("" or None: the best loaded), or InputError saying what the
    missing one needs."""
    if not asked:
        return preferred(loaded) if loaded else "ngram"
    if asked not in loaded:
        need = f" (it needs {_DRAFTER_NEEDS[asked]})" if asked in _DRAFTER_NEEDS else ""
        raise InputError(f"Drafter {asked!r} is not loaded{need}; loaded: "
                         f"{', '.join(loaded) or 'none'}.")
    return asked


def build_config(values: Mapping, drafters: Sequence[str], *, max_new_cap: int | None = None,
                 names: Mapping[str, str] | None = None,
                 greedy_trees: tuple[str, ...] = ("head",)) -> tuple[GenerateConfig, list[str]]:
    """User settings -> (GenerateConfig, notes on what was capped or changed).

    `values` holds any of SETTINGS' names (raw; missing or None: the default) and `speculation`,
    `drafter`, `adaptive`, `stop`, `dry_sequence_breakers`. `drafters` are the loaded ones;
    `max_new_cap` is the server's cap on max_new_tokens; `greedy_trees`, the drafters that
    draft trees when greedy unless tree_nodes is given (`Engine.greedy_trees`)."""
    v = check({name: values.get(name) for name in SETTINGS}, names)
    notes = []
    if max_new_cap is not None and v["max_new_tokens"] > max_new_cap:
        notes.append(f"Max new tokens capped at {max_new_cap} by the server "
                     f"(asked {v['max_new_tokens']}).")
        v["max_new_tokens"] = max_new_cap
    if v["temperature"] > MAX_TEMPERATURE:
        notes.append(f"Temperature capped at {MAX_TEMPERATURE:g} (asked {v['temperature']:g}).")
        v["temperature"] = MAX_TEMPERATURE
    speculation = values.get("speculation")
    speculation = True if speculation is None else bool(speculation)
    if speculation and not drafters:
        notes.append("No drafter is loaded: plain decoding.")
        speculation = False
    drafter = resolve_drafter(values.get("drafter"), list(drafters)) if speculation \
        else (values.get("drafter") or "ngram")
    if v["tree_nodes"] is None:
        v["tree_nodes"] = default_tree_nodes(v["temperature"], drafter, greedy_trees)
    adaptive = values.get("adaptive")
    cfg = GenerateConfig(**v, speculation=speculation, drafter=drafter,
                         adaptive=True if adaptive is None else bool(adaptive),
                         stop=tuple(values.get("stop") or ()),
                         dry_sequence_breakers=check_breakers(values.get("dry_sequence_breakers")))
    return cfg, notes


def request(drafters: Sequence[str] = (), **values) -> GenerateConfig:
    """A request made in code, checked as a user's is (`build_config`): seed 0, chains, and
    speculation where a drafter is given, unless `values` say otherwise. InputError for a bad
    value, ValueError for one the builder would change (a capped temperature, say)."""
    cfg, notes = build_config({"seed": 0, "tree_nodes": 0, "speculation": bool(drafters),
                               **values}, drafters)
    if notes:
        raise ValueError(" ".join(notes))
    return cfg


def add_arguments(parser, names: Sequence[str] | None = None, defaults: Mapping | None = None,
                  helps: Mapping[str, str] | None = None) -> None:
    """The settings `names` (default: all) as command-line flags, grouped, defaults shown.
    A flag not given is None (the table's default applies when the request is built), but for
    the `defaults` a command sets itself (the bench: 128 tokens, seed 0); `helps` replaces a
    flag's help there."""
    defaults, helps = defaults or {}, helps or {}
    groups = {}
    for row in _ROWS:
        if names is not None and row.name not in names:
            continue
        if row.group not in groups:
            groups[row.group] = parser.add_argument_group(
                {"penalties": "penalties (fight repetition; lossless with speculation)",
                 "length": "length", "sampling": "sampling",
                 "speculation": "speculation"}[row.group])
        shown = defaults.get(row.name, "random" if row.name == "seed" else row.default)
        text = helps.get(row.name, row.help)
        groups[row.group].add_argument(
            row.flag, type=int if row.integer else float, default=defaults.get(row.name),
            metavar="N" if row.integer else "X",
            help=f"{text} (default: {shown})" if shown is not None else text)
    if names is None or "dry_sequence_breakers" in names:
        groups.setdefault("penalties", parser.add_argument_group("penalties")).add_argument(
            "--dry-sequence-breaker", dest="dry_sequence_breakers", action="append",
            metavar="TEXT", default=None,
            help="DRY: a string that ends a repeated sequence; repeat the flag for several "
                 f"(default: {', '.join(repr(b) for b in DRY_BREAKERS)})")


def values_from_args(args) -> dict:
    """What `add_arguments`' flags hold, by setting name (None: not given)."""
    out = {name: getattr(args, name) for name in SETTINGS if hasattr(args, name)}
    if hasattr(args, "dry_sequence_breakers"):
        out["dry_sequence_breakers"] = args.dry_sequence_breakers
    return out


def flag_names(names: Sequence[str] | None = None) -> dict[str, str]:
    """setting -> its CLI flag, for messages."""
    return {s.name: s.flag for s in _ROWS if names is None or s.name in names}


def values_from_body(body: Mapping) -> tuple[dict, dict[str, str]]:
    """An API request's settings by setting name (null: not given), and each setting's field
    name as the request spelt it, for messages."""
    out, names = {}, {}
    for row in _ROWS:
        for field in row.api or (row.name,):
            if body.get(field) is not None:
                out[row.name], names[row.name] = body[field], field
                break
        names.setdefault(row.name, row.api_name)
    return out, names
