"""Tiny random-config models and a byte-level tokenizer, built in-process (no downloads)."""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time

import torch

from specchat.core.sampling import nucleus
from specchat.models.loaded import LoadedModel
from specchat.models.synthetic import byte_tokenizer, tiny_gemma3, tiny_llama  # noqa: F401


def loaded(model, tokenizer=None, name="tiny") -> LoadedModel:
    return LoadedModel(model, tokenizer or byte_tokenizer(), name, "none",
                       torch.device("cpu"), 0.0)


def dense_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature/top-k/top-p:
    the reference distribution the sampler's draws must follow."""
    rows = []
    for row in logits:
        ids, probs = nucleus(row, params)
        rows.append(probs.float() if ids is None
                    else torch.zeros(logits.shape[-1]).index_put_((ids,), probs.float()))
    return torch.stack(rows)


def most_repeats(seq, n: int = 6) -> int:
    """How many times the most frequent n-gram of `seq` occurs (0 when shorter than n)."""
    grams = collections.Counter(tuple(seq[i:i + n]) for i in range(len(seq) - n + 1))
    return max(grams.values(), default=0)


def free_port() -> int:
    """A loopback port no one listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served_on_loopback(app):
    """Serve an ASGI app with uvicorn on a free loopback port, in a thread; yields its base
    URL ("http://127.0.0.1:PORT") and stops the server after."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def bnb_cpu_repack(model, on: bool, now: bool = False) -> list:
    """bitsandbytes' AVX512-BF16 CPU repack forced on or off for every NF4 layer of `model`,
    whatever this CPU has. bitsandbytes decides per layer, from the plain Python flag
    `support_avx512bf16_for_cpu`, whether a layer's first CPU forward repacks its weight for its
    own kernel. `now`: repack each layer at once, with the call `Linear4bit.forward` makes (its
    own kernel is not run: on a CPU without AVX512-BF16 it would misread the new layout).
    Returns the layers."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.support_avx512bf16_for_cpu = on
        if on and now:
            m.weight.data, m.weight.quant_state = _convert_weight_packed_for_cpu(
                m.weight.data, m.weight.quant_state)
    return layers


def with_kernel(lib, field: str, symbol: str):
    """`lib` (a `kernels.Kernels`) with its function `field` replaced by the C function `symbol`
    of the same library: one kernel variant forced, whatever this CPU would pick."""
    from specchat import kernels

    return kernels.with_function(lib, field, symbol)


def i8_kernels() -> dict:
    """{name: Kernels whose integer decoder stack is that kernel}: every one this CPU runs, the
    portable build's reference first (`cpu-int8`'s forward, forced whatever this CPU would
    pick)."""
    from specchat import kernels

    found = {"portable-ref": kernels.load("ref")}
    simd = kernels.load("avx2")
    if simd is not None:
        for name in kernels.I8_KERNELS:
            if kernels.i8_runs(name):
                found[name] = with_kernel(simd, "decoder_forward_i8", f"decoder_forward_i8_{name}")
    return {name: lib for name, lib in found.items() if lib is not None}
