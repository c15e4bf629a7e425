"""train-draft's prompts and the token sequences built from the target's replies."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

from specchat.train.config import TrainConfig

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
HOLDOUT_EVERY = 10  # prompt i is held out when i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
TEXT_SUFFIXES = (".txt", ".md", ".rst")
# The bench's own questions, read as data (train imports nothing of the bench): kept out of
# training so the bench measures the head on questions it never saw.
BENCH_QUESTIONS = Path(__file__).resolve().parents[1] / "bench" / "questions.jsonl"


# -- data ---------------------------------------------------------------------------------------


def load_prompts(files: list[Path]) -> list[dict]:
    """Prompt records {"key", "prompt", "category", "heldout"} from JSONL prompt sets."""
    files = files or sorted(PROMPTS_DIR.glob("*.jsonl"))
    out = []
    for path in files:
        for i, line in enumerate(Path(path).read_text().splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = row.get("prompt") or (row.get("turns") or [""])[0]
            if prompt:
                out.append({"key": f"{Path(path).stem}:{i}", "prompt": prompt,
                            "category": row.get("category", ""),
                            "heldout": i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1})
    return out


def load_data(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    """--data: (extra prompts, plain texts {"key", "text"}). JSONL lines with "prompt" or
    "turns" are prompts, with "text" are text; .txt/.md/.rst files (or directories of them) are
    text."""
    prompts, texts = [], []
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES + (".jsonl",)) \
            if p.is_dir() else [p]
    for f in files:
        if f.suffix == ".jsonl":
            for i, line in enumerate(f.read_text(errors="replace").splitlines()):
                if not line.strip():
                    continue
                row = json.loads(line)
                key = f"{f}:{i}"
                if row.get("text"):
                    texts.append({"key": key, "text": row["text"]})
                elif row.get("prompt") or row.get("turns"):
                    prompts.append({"key": key, "prompt": row.get("prompt") or row["turns"][0],
                                    "category": row.get("category", ""),
                                    "heldout": i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1})
        else:
            texts.append({"key": str(f), "text": f.read_text(errors="replace")})
    return prompts, texts


OVERLAP_WORDS = 8  # a shared run of this many words ties a prompt to a question


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def question_overlap(prompts: list[str], questions: list[str], n: int = OVERLAP_WORDS
                     ) -> list[tuple[int, str]]:
    """(prompt index, the words it shares) for each prompt tied to a question: sharing a run of
    `n` words with one, or holding one shorter than that whole. Training on a benchmark's
    questions would let the head memorize what it is measured on."""
    grams: set[tuple[str, ...]] = set()
    short: set[tuple[str, ...]] = set()
    for q in questions:
        w = _words(q)
        if len(w) < n:
            short.add(tuple(w))
        grams.update(tuple(w[i:i + n]) for i in range(len(w) - n + 1))
    lengths = sorted({len(s) for s in short if s})
    found = []
    for i, prompt in enumerate(prompts):
        w = _words(prompt)
        hit = next((g for j in range(len(w) - n + 1) if (g := tuple(w[j:j + n])) in grams), None)
        if hit is None:
            hit = next((g for m in lengths for j in range(len(w) - m + 1)
                        if (g := tuple(w[j:j + m])) in short), None)
        if hit is not None:
            found.append((i, " ".join(hit)))
    return found


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill: generated again
    return rows


FORMATS = ("chat", "system", "completion")  # the app's prompt formats (--formats)
# System prompts of the kind the page's System prompt box gets, written for this project.
SYSTEM_PROMPTS = (
    "You are a helpful assistant. Answer clearly and briefly.",
    "You are a patient tutor. Explain step by step, in plain words.",
    "Answer in a formal tone, in a few sentences.",
    "You are a careful assistant: say so when you are not sure of something.",
)


def _pick(salt: str, key: str, n: int) -> int:
    """0..n-1, fixed by a prompt's key (its samples "#j" share the prompt's)."""
    return zlib.crc32(f"{salt}:{key.split('#')[0]}".encode()) % n


def prompt_format(key: str, formats: tuple[str, ...]) -> str:
    """The format the prompt with this key is asked in: one of `formats`."""
    return formats[_pick("format", key, len(formats))]


def _prompts(tok, todo: list[dict], formats: tuple[str, ...] = ("chat",)
             ) -> tuple[dict[str, list[int]], dict[str, tuple[str, ...]]]:
    """Each prompt's ids in its format (`prompt_format`) by key, and its stop strings: the chat
    format's where a base model's plain "User:/Assistant:" turn ends (it has no end-of-turn
    token), none for plain text to continue, as the page's Completion mode has none."""
    from specchat.core.text import chat_prompt, raw_prompt
    ids, stops = {}, {}
    for p in todo:
        kind = prompt_format(p["key"], formats)
        if kind == "completion":
            ids[p["key"]], stops[p["key"]] = raw_prompt(tok, p["prompt"]), ()
            continue
        messages = [{"role": "user", "content": p["prompt"]}]
        if kind == "system":
            system = SYSTEM_PROMPTS[_pick("system", p["key"], len(SYSTEM_PROMPTS))]
            messages.insert(0, {"role": "system", "content": system})
        prompt, stop = chat_prompt(tok, messages)
        ids[p["key"]], stops[p["key"]] = prompt, tuple(stop)
    return ids, stops


def with_samples(prompts: list[dict], samples: int) -> list[dict]:
    """Each prompt `samples` times: the first reply keeps its key, the others (always sampled)
    get "#j". Ordered round by round, so a budget that runs out still covers every prompt."""
    return [p if j == 0 else {**p, "key": f"{p['key']}#{j}", "sample": j}
            for j in range(max(1, samples)) for p in prompts]


def _sampled(key: str) -> bool:
    """Half the prompts are answered greedily, half sampled (varied text, greedy habits)."""
    return zlib.crc32(key.encode()) % 2 == 1


def sequences(cfg: TrainConfig, texts: list[dict], tokenizer, prompts: list[dict]
              ) -> list[dict]:
    """Everything to extract: generated sequences and --data texts, cut to seq_len windows.
    "start" is the first head position that is trained and measured: the head drafts replies,
    so on generated sequences it starts where the reply does (head position t predicts token
    t + 2; the target itself emits the reply's first token)."""
    from specchat.core.text import chat_prompt
    by_key = {p["key"]: p for p in prompts}
    out = []
    for row in read_jsonl(cfg.out / "generated.jsonl"):
        prompt_len = row.get("prompt_len")
        if prompt_len is None and row["key"] in by_key:  # rows written before prompt_len
            prompt_len = len(chat_prompt(tokenizer, [{"role": "user",
                                                      "content": by_key[row["key"]]["prompt"]}])[0])
        start = max(0, (prompt_len or 1) - 1)
        if start < min(len(row["ids"]), cfg.seq_len) - 2:  # else no reply within seq_len
            out.append({"key": row["key"], "ids": row["ids"][:cfg.seq_len], "start": start,
                        "heldout": row["heldout"]})
    for i, t in enumerate(texts):
        ids = tokenizer(t["text"], add_special_tokens=True)["input_ids"]
        for j in range(0, len(ids), cfg.seq_len):
            window = ids[j:j + cfg.seq_len]
            if len(window) >= 16:
                out.append({"key": f"{t['key']}@{j}", "ids": window, "start": 0,
                            "heldout": i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1})
    return out
