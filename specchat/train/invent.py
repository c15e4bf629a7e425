"""Prompts the target writes itself (`train-draft --invent N`), in the manner of self-instruct
(Wang et al. 2023): shown a few requests of the prompt set, the target writes the next one.

A head learns the target's replies to the prompts it is trained on: with a few hundred prompts
it learns those replies by heart (on the embedded target, teacher-forced top-1 agreement on the
training prompts' replies 63%, on held-out prompts' 51%). Invented prompts are text the
target itself finds likely, on every subject its examples touch and many they do not, at the
cost of a short generation each. Only the training prompts serve as examples: a held-out
prompt never shapes what the head is trained on.
"""

from __future__ import annotations

import json
import random
import time
import zlib

import torch

from specchat.train.config import TrainConfig, _bar
from specchat.train.data import HOLDOUT_EVERY, read_jsonl

# What the target continues: a list of requests, of which it writes the next line.
HEADER = "Requests people sent to an assistant, one a line:\n"
EXAMPLES = 4  # requests shown before the one it writes
MAX_EXAMPLE_CHARS = 300  # a longer example (an article to summarize) would crowd the list
MAX_PROMPT_TOKENS = 64  # an invented request's length at most, in tokens
MIN_PROMPT_CHARS = 12
INVENT_TOP_K, INVENT_TEMPERATURE = 100, 1.0  # varied, yet from the target's likely text


def example_pool(prompts: list[dict]) -> list[str]:
    """The requests an invented prompt may be shown: training prompts of one line."""
    return [p["prompt"] for p in prompts if not p["heldout"] and "\n" not in p["prompt"].strip()
            and len(p["prompt"]) <= MAX_EXAMPLE_CHARS]


def examples_text(pool: list[str], index: int, seed: int) -> str:
    """The text the target continues for invented prompt `index`: the header and EXAMPLES
    requests drawn for that index, then the start of the next line."""
    rng = random.Random(zlib.crc32(f"{seed}:{index}".encode()))
    chosen = rng.sample(pool, min(EXAMPLES, len(pool)))
    return HEADER + "".join(f"- {p.strip()}\n" for p in chosen) + "-"


def clean(text: str, ended: bool) -> str | None:
    """An invented request from the target's continuation (`ended`: it reached the line's
    end, or the end of text, within the cap): its first line, or None where that is too short,
    unfinished or no request at all."""
    line = text.partition("\n")[0].strip()
    if not ended or len(line) < MIN_PROMPT_CHARS or not any(c.isalpha() for c in line):
        return None
    return line


@torch.inference_mode()
def invent_prompts(target, prompts: list[dict], n: int, cfg: TrainConfig,
                   deadline: float) -> list[dict]:
    """Up to n prompt records {"key", "prompt", "category", "heldout"} the target wrote,
    kept in the work directory's invented.jsonl (a resumed run writes only the missing ones;
    every HOLDOUT_EVERY-th is held out, as in a prompt file). Distinct from each other and
    from `prompts`."""
    from specchat.core.text import stop_check
    from specchat.runners.hf.attention import stock_attention
    from specchat.runners.hf.cpu import dense_nf4
    from specchat.train.batched import sample_with_features, supported
    from specchat.train.replies import _eos, gen_batch
    path = cfg.out / "invented.jsonl"
    rows = read_jsonl(path)
    pool = example_pool(prompts)
    if n <= 0 or not pool or not supported(target.model):
        return [_record(r) for r in rows[:n]]
    tok, model = target.tokenizer, target.model
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    seen = {p["prompt"].strip().lower() for p in prompts} | \
        {r["prompt"].strip().lower() for r in rows}
    ends = stop_check(tok, ("\n",))
    size = gen_batch(cfg, target.device)
    attempt = max((r["attempt"] for r in rows), default=-1) + 1
    bar = _bar(total=n, initial=min(len(rows), n), desc="invent", unit="prompt")
    with dense_nf4(model), stock_attention(model), path.open("a") as f:
        while len(rows) < n and time.time() < deadline:
            batch = range(attempt, attempt + size)
            texts = [examples_text(pool, i, cfg.seed) for i in batch]
            ids = [tok(t, add_special_tokens=True)["input_ids"] for t in texts]
            generator = torch.Generator(target.device).manual_seed(cfg.seed * 7919 + attempt)
            results = sample_with_features(model, ids, [True] * len(ids), MAX_PROMPT_TOKENS,
                                           INVENT_TEMPERATURE, INVENT_TOP_K, set(_eos(model, tok)),
                                           pad, generator, [ends] * len(ids))
            for i, r in zip(batch, results):
                # (a row cut at the cap lacks its last token, one ended at the line's end its
                # newline: the sampler keeps only the tokens it fed)
                reply = r.ids[r.prompt_len:]
                prompt = clean(tok.decode(reply, skip_special_tokens=True),
                               len(reply) < MAX_PROMPT_TOKENS - 1)
                if prompt is None or prompt.lower() in seen or len(rows) >= n:
                    continue
                seen.add(prompt.lower())
                row = {"index": len(rows), "attempt": i, "prompt": prompt}
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                bar.update(1)
            f.flush()
            attempt += size
    bar.close()
    return [_record(r) for r in rows[:n]]


def _record(row: dict) -> dict:
    return {"key": f"invented:{row['index']}", "prompt": row["prompt"], "category": "invented",
            "heldout": row["index"] % HOLDOUT_EVERY == HOLDOUT_EVERY - 1}
