"""Whether a draft model can draft for a target: the same vocabulary, token for token."""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------
# Draft/target compatibility: the draft's token ids must mean the same text as the target's.


def vocab_mismatch(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> str | None:
    """None when the draft can propose tokens for the target; else what differs, in words."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    problems = []
    if len(t_vocab) != len(d_vocab):
        problems.append(f"tokenizer size {len(t_vocab)} vs {len(d_vocab)}")
    t_by_id = {i: t for t, i in t_vocab.items()}
    d_by_id = {i: t for t, i in d_vocab.items()}
    for i in range(min(len(t_vocab), len(d_vocab))):
        if t_by_id.get(i) != d_by_id.get(i):
            problems.append(f"first differing id {i}: {t_by_id.get(i)!r} vs {d_by_id.get(i)!r}")
            break
    for name in ("eos_token", "bos_token", "pad_token"):
        a, b = getattr(target_tok, name, None), getattr(draft_tok, name, None)
        if a != b:
            problems.append(f"{name} {a!r} vs {b!r}")
    if draft_vocab < len(t_vocab) or target_vocab < len(t_vocab):
        problems.append(f"logits width {target_vocab} vs {draft_vocab}")
    if not problems:
        return None
    return "target vs draft: " + "; ".join(problems)
