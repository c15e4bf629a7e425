"""What a coarser LM head costs a draft in acceptance, on real weights: the embedded Gemma 3
270M's final hidden states over its own greedy continuations of Spec-Bench prompts (or
specchat's own questions), its GGUF's Q8_0 head against that head requantized to NF4 (the
`--draft-quantization nf4-head` draft's) and to plain integer formats. For each: the share of
positions whose argmax agrees with the Q8_0 head's (a greedy draft's acceptance, were the
draft the target itself) and the mean of sum min(p, q) at T = 1 (a sampled draft's).

    python -m specchat.bench.head_agreement --questions ../shared/benchmarks/spec_bench/question.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def nf4_values(w: torch.Tensor, block: int) -> torch.Tensor:
    """w rounded to NF4 per block of `block` (bitsandbytes' codes), in float32."""
    from specchat.runners.cpu.nf4_head import nf4_table

    table = nf4_table()
    x = w.reshape(-1, block)
    top = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return (table[torch.bucketize(x / top, (table[1:] + table[:-1]) / 2)] * top).view_as(w)


def int_values(w: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """w rounded to signed `bits`-bit integers per block, the block's largest magnitude at
    -2^(bits-1) (Q4_0's rule), in float32."""
    x, m = w.reshape(-1, block), 2 ** (bits - 1)
    peak = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    d = torch.where(peak == 0, torch.ones_like(peak), peak / -m)
    return ((x / d).round().clamp(-m, m - 1) * d).view_as(w)


FORMATS = {"NF4, blocks of 64": lambda w: nf4_values(w, 64),
           "NF4, blocks of 32": lambda w: nf4_values(w, 32),
           "int4, blocks of 32": lambda w: int_values(w, 32, 4),
           "int5, blocks of 32": lambda w: int_values(w, 32, 5),
           "int6, blocks of 16": lambda w: int_values(w, 16, 6)}


def agreement(prompts: list[str], new_tokens: int = 64, progress=print) -> dict:
    from specchat.core.engine import Engine
    from specchat.core.events import TokenEvent
    from specchat.core.settings import request
    from specchat.models.load import load_model

    loaded = load_model("embedded", "nf4", "cpu", progress=lambda *a: None)
    model, tokenizer = loaded.model, loaded.tokenizer
    head = model.get_output_embeddings()
    q8 = vars(head)["forward"]  # the GGUF's Q8_0 head
    w = q8.dequantized(torch.arange(q8.q.shape[0]))
    formats = {name: make(w) for name, make in FORMATS.items()}
    engine = Engine(loaded, {}, prefix_tokens=0)
    seen: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    greedy = dict.fromkeys(formats, 0)
    overlap = dict.fromkeys(formats, 0.0)
    positions = 0
    try:
        for i, prompt in enumerate(prompts):
            ids = tokenizer(prompt)["input_ids"]
            config = request(max_new_tokens=new_tokens, temperature=0.0)
            reply = [e.id for e in engine.stream(ids, config) if isinstance(e, TokenEvent)]
            seen.clear()
            with torch.inference_mode():
                model(torch.tensor([ids + reply]))
                h = seen[-1][0, len(ids) - 1:len(ids) + len(reply) - 1].float()
                vocab = len(tokenizer)
                base = (h @ w.T)[:, :vocab]
                p = torch.softmax(base, -1)
                for name, values in formats.items():
                    logits = (h @ values.T)[:, :vocab]
                    greedy[name] += int((logits.argmax(-1) == base.argmax(-1)).sum())
                    overlap[name] += float(torch.minimum(p, torch.softmax(logits, -1)).sum())
            positions += len(h)
            progress(f"{i + 1}/{len(prompts)} prompts, {positions} positions")
    finally:
        hook.remove()
    return {"positions": positions, "cpu": loaded.runtime.cpu,
            "formats": {name: {"greedy_agreement": round(greedy[name] / positions, 4),
                               "overlap_t1": round(overlap[name] / positions, 4)}
                        for name in formats}}


def main(argv: list[str] | None = None) -> int:
    from specchat.bench.questions import default_questions_path, load_questions

    p = argparse.ArgumentParser(prog="python -m specchat.bench.head_agreement",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=Path, default=None,
                   help="a question.jsonl (Spec-Bench's); default: specchat's own questions")
    p.add_argument("--every", type=int, default=12, help="every Nth question (default: 12)")
    p.add_argument("--limit", type=int, default=40, help="at most this many (default: 40)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = p.parse_args(argv)
    questions = load_questions(args.questions or default_questions_path())
    prompts = [q["turns"][0] for q in questions[::args.every][:args.limit]]
    result = agreement(prompts, args.max_new_tokens,
                       progress=lambda *a: None if args.json else print(*a))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['positions']} positions, {result['cpu']}")
    for name, r in result["formats"].items():
        print(f"  {name}: greedy {r['greedy_agreement']:.1%}, sum min(p, q) {r['overlap_t1']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
