"""What the integer products cost in quality: the bench's questions, each answered greedily by
the float path (`cpu-fp32-avx512`; `cpu-fp32-avx2` where the CPU has no AVX-512, against
`cpu-int8-avx2`: every integer kernel gives the same bits), then the question and that reply
teacher-forced through both paths on the same loaded model.
Over the reply's positions: how often the two paths' top tokens agree, and the KL divergence
of the integer path's next-token distribution from the float path's (in nats: llama.cpp's
`perplexity --kl-divergence` reads the same two figures against its float model). Also: how
many greedy replies the integer path gives identical to the float path's.

    python -m specchat.bench.quality --limit-per-category 3 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from specchat import kernels
from specchat.bench.questions import default_questions_path, load_questions


def greedy(runner, prompt: list[int], max_new: int, eos: set[int], stops: tuple[str, ...],
           decode) -> list[int]:
    """The runner's greedy reply to `prompt`, as a chat reply ends: at most `max_new` tokens, up
    to an end token or the token that completes a stop string (the next turn's marker)."""
    cache, reply = runner.new_cache(), []
    logits = runner.forward(cache, prompt, 0, 1)
    while len(reply) < max_new:
        token = int(logits[-1].argmax())
        reply.append(token)
        if token in eos or any(stop in decode(reply) for stop in stops):
            break
        logits = runner.forward(cache, [token], len(prompt) + len(reply) - 1, 1)
    return reply


def compare(reference, other, prompt: list[int], reply: list[int]) -> tuple[int, float, list]:
    """`reply` teacher-forced after `prompt` through both runners: (positions whose top tokens
    agree, the sum of KL(reference || other) over the reply's positions, each position's KL)."""
    ids = prompt + reply
    rows = []
    for runner in (reference, other):
        logits = runner.forward(runner.new_cache(), ids, 0, len(reply)).float()
        rows.append(torch.log_softmax(logits, dim=-1))
    p, q = rows
    kl = (p.exp() * (p - q)).sum(-1)
    same = int((p.argmax(-1) == q.argmax(-1)).sum())
    return same, float(kl.sum()), kl.tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specchat.bench.quality",
                                 description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--questions", default=str(default_questions_path()),
                    help="a JSONL file of questions (default: the bench's)")
    ap.add_argument("--limit-per-category", type=int, default=None,
                    help="the first N questions of each category (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=96,
                    help="the longest greedy reply (default: 96)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be at least 1")
    if not kernels.runs_here("avx2"):
        print("the integer path needs the SIMD build (AVX2, FMA, F16C)", file=sys.stderr)
        return 2
    from specchat.loader import load_engine
    from specchat.runners.cpu.runner import CpuRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    questions = load_questions(args.questions, limit_per_category=args.limit_per_category)
    engine = load_engine("embedded", progress=lambda *a: None).engine
    float_variant = "avx512" if kernels.runs_here("avx512") else "avx2"
    reference = CpuRunner(engine.model, kernels.load(float_variant))
    integer = CpuRunner(engine.model, kernels.load(float_variant), int8=True)
    eos = set(engine.eos_ids)
    began = time.perf_counter()
    positions = agree = identical = 0
    kl_sum, kls = 0.0, []
    with torch.inference_mode():
        for q in questions:
            prompt, stops = engine.chat_prompt([{"role": "user", "content": q["turns"][0]}])
            ends = (args.max_new_tokens, eos, stops, engine.tokenizer.decode)
            reply = greedy(reference, prompt, *ends)
            identical += greedy(integer, prompt, *ends) == reply
            same, total, each = compare(reference, integer, prompt, reply)
            positions, agree, kl_sum = positions + len(reply), agree + same, kl_sum + total
            kls += each
    kls.sort()
    integer_path = "cpu-int8" if float_variant == "avx512" else "cpu-int8-avx2"
    print(f"{integer_path} against cpu-fp32-{float_variant}, the embedded target, {len(questions)} "
          f"questions (the chat format, stop strings on), the float path's greedy replies of "
          f"at most {args.max_new_tokens} tokens, teacher-forced ({time.perf_counter() - began:.0f} s)")
    print(f"  positions               {positions}")
    print(f"  top-1 agreement         {100 * agree / positions:.2f}%")
    print(f"  mean KL divergence      {kl_sum / positions:.6f} nats")
    print(f"  99th percentile KL      {kls[min(len(kls) - 1, int(0.99 * len(kls)))]:.6f} nats")
    print(f"  largest KL              {kls[-1]:.6f} nats")
    print(f"  greedy replies the same {identical} of {len(questions)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
