"""Reading Spec-Bench-style question files, and the default set shipped with specchat."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

# specchat's own question set: 3 questions in each of Spec-Bench's 13 categories, written for
# this project (none from Spec-Bench, MT-Bench or train-draft's prompts). Spec-Bench's own
# question.jsonl has the same shape and is read with --questions.
DEFAULT_QUESTIONS = Path(__file__).with_name("questions.jsonl")


# ---------------------------------------------------------------------------------------------
# Questions


def default_questions_path() -> Path:
    """The question file shipped in the package, used when no --questions is given."""
    return DEFAULT_QUESTIONS


def load_questions(path: str | Path, categories: Iterable[str] | None = None,
                   limit_per_category: int | None = None) -> list[dict]:
    """JSONL, one question a line with `turns` (list of user messages) and `category`.
    Keeps file order; the first `limit_per_category` of each category."""
    wanted = list(categories or [])
    out, seen = [], defaultdict(int)
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            q = json.loads(line)
            turns = q.get("turns")
            if isinstance(turns, str):
                turns = [turns]
            if not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{path}:{n}: a question needs `turns`, a list of strings")
            cat = str(q.get("category", "all"))
            if wanted and cat not in wanted:
                continue
            if limit_per_category is not None and seen[cat] >= limit_per_category:
                continue
            seen[cat] += 1
            out.append({"question_id": q.get("question_id", n), "category": cat, "turns": turns})
    missing = [c for c in wanted if not seen[c]]
    if missing:
        raise ValueError(f"no questions in categories {', '.join(missing)} in {path}")
    return out
