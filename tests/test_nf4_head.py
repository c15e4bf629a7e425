"""A draft model's LM head in NF4 (`runners.cpu.nf4_head`): `quantize_nf4` writes the codes and
scales bitsandbytes writes; the head gives one set of bits on every integer kernel this CPU runs
and the portable reference, row-exact; its logits are its dequantized weight's up to the
activations' rounding; it keeps the integer heads' contract for ids past `upto` and for the
block maxima (`logits_maxima`); and `--draft-quantization nf4-head` takes it, where the
default keeps a target's head."""

import os
import shutil

import pytest
import torch

from specchat import kernels
from specchat.models import runtime
from specchat.models.gguf_head import quantized_nf4_head
from specchat.runners.cpu.nf4_head import NF4Head, quantize_nf4
from specchat.runners.cpu.q8_head import activation_error

pytestmark = pytest.mark.usefixtures("one_thread")
bnb = pytest.importorskip("bitsandbytes")


def _compiler() -> bool:
    return shutil.which(os.environ.get("CC", "gcc")) is not None


def _libs() -> dict:
    """{name: Kernels}: the portable reference, and each integer kernel this CPU runs bound in
    the SIMD build."""
    if not _compiler():
        pytest.skip("no C compiler")
    found = {"ref": kernels.load("ref")}
    simd = kernels.load("avx2")
    if simd is not None:
        for name in kernels.I8_KERNELS:
            if kernels.i8_runs(name):
                found[name] = kernels.with_i8_kernel(simd, name)
    assert None not in found.values()
    return found


def _head(out: int = 1040, inn: int = 192, seed: int = 0) -> torch.nn.Linear:
    """A float head of N(0, 0.02) rows, one of them zero (absmax 0), as a model holds it."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(inn, out, bias=False)
    head.weight.data = (torch.randn(out, inn, generator=g) * 0.02).to(torch.bfloat16)
    head.weight.data[5] = 0
    return head


def _inputs(n: int, inn: int = 192, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inn, generator=g) * torch.logspace(-1, 1, n)[:, None]
    if n > 2:
        x[1, 32:64] = 0  # a zero block of the activations: dx = 0
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32),
                                              b.contiguous().view(torch.int32))


def test_the_codes_and_scales_are_bitsandbytes_own():
    from bitsandbytes.functional import quantize_4bit

    weight = _head().weight.data
    codes, absmax = quantize_nf4(weight, chunk_rows=100)  # ragged chunks
    theirs, state = quantize_4bit(weight, blocksize=64, quant_type="nf4")
    assert torch.equal(codes, theirs.view(-1))
    assert torch.equal(absmax, state.absmax)
    with pytest.raises(ValueError, match="blocks of 64"):
        quantize_nf4(torch.zeros(16, 96))


def test_every_kernel_gives_one_set_of_bits_row_exact():
    libs = _libs()
    made = {name: NF4Head(_head(), lib) for name, lib in libs.items()}
    for n in (1, 2, 3, 8, 13):
        x = _inputs(n)
        want = made["ref"](x)
        for name, head in made.items():
            got = head(x)
            assert _same_bits(got, want), (name, n)
            for j in range(n):  # each row alone: the same bits as among the others
                assert _same_bits(head(x[j:j + 1])[0], got[j]), (name, n, j)


def test_the_logits_are_the_dequantized_weights_up_to_the_activations_rounding():
    lib = _libs()["ref"]
    head = NF4Head(_head(), lib)
    rows = torch.arange(head.q.shape[0])
    values = head.dequantized(rows)
    x = _inputs(4)
    got, want = head(x), x @ values.T
    assert ((got - want).abs() <= activation_error(x, values) + 1e-5).all()
    # and NF4's rounding of the float weight: within half a level's gap of each block's absmax
    assert (values - _head().weight.float()).abs().max() < 0.02 * 4 * 0.17
    assert torch.equal(values[5], torch.zeros(values.shape[1]))


@pytest.mark.parametrize("upto", [None, 1040, 1000, 960, 7])
def test_ids_past_upto_are_minus_infinity_and_the_block_maxima_each_blocks_largest(upto):
    for name, lib in _libs().items():
        head = NF4Head(_head(), lib)
        for n in (1, 3):
            x = _inputs(n)
            full = head(x)
            maxima = torch.empty(n, kernels.head_blocks(1040))
            got = head.leading(x, upto, maxima)
            want = full.clone()
            if upto is not None:
                want[:, upto:] = -torch.inf
            assert _same_bits(got, want), (name, n)
            padded = torch.nn.functional.pad(want, (0, 1088 - 1040), value=-torch.inf)
            assert torch.equal(maxima, padded.view(n, -1, 64).amax(-1)), (name, n)
    with pytest.raises(ValueError, match="maxima must be"):
        head.leading(_inputs(2), None, torch.empty(1, kernels.head_blocks(1040)))


def test_a_head_it_cannot_take_keeps_its_forward():
    lib = _libs()["ref"]

    class Model(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.head = head

        def get_output_embeddings(self):
            return self.head

    odd = _head(out=1040, inn=96)  # rows of 96: not whole NF4 blocks of 64
    assert not quantized_nf4_head(Model(odd), lib) and "forward" not in vars(odd)
    fine = _head()
    assert quantized_nf4_head(Model(fine), lib) and isinstance(vars(fine)["forward"], NF4Head)


@pytest.mark.parametrize("quantization,four_bit", [("nf4-head", True), ("auto", False),
                                                   ("nf4", False)])
def test_draft_quantization_nf4_head_takes_the_nf4_head_and_auto_keeps_a_targets(
        quantization, four_bit, tmp_path, monkeypatch):
    from specchat.loader import load_engine
    from specchat.models.synthetic import byte_tokenizer, save, tiny_family

    int8 = next((p.name for p in runtime.candidates(forced="")
                 if p.int8 and kernels.load(p.kernels) is not None), None)
    if int8 is None:
        pytest.skip("no integer path runs here")
    monkeypatch.setenv(runtime.ENV, int8)
    target = save(tiny_family("llama", seed=1).to(torch.bfloat16), byte_tokenizer(),
                  tmp_path / "target")
    draft = save(tiny_family("llama", seed=2).to(torch.bfloat16), byte_tokenizer(),
                 tmp_path / "draft")
    report = load_engine(str(target), str(draft), draft_quantization=quantization,
                         device="cpu", progress=lambda *a: None)
    assert ("LM head in NF4" in report.draft.label) == four_bit
    assert "LM head in Q8_0" in report.engine.target.label
    if four_bit:  # greedy speculation with the NF4 head's drafts replays plain decoding
        from specchat.core.events import TokenEvent
        from specchat.core.request import GenerateConfig

        prompt = list(b"A draft with a four-bit head. A draft")
        cfg = dict(max_new_tokens=24, adaptive=False, draft_len=3, temperature=0.0)
        plain = [e.id for e in report.engine.stream(prompt, GenerateConfig(speculation=False,
                                                                           **cfg))
                 if isinstance(e, TokenEvent)]
        spec = [e.id for e in report.engine.stream(prompt, GenerateConfig(drafter="model",
                                                                          **cfg))
                if isinstance(e, TokenEvent)]
        assert spec == plain and len(plain) == 24


def test_the_head_agreement_bench_runs_on_the_embedded_model():
    """`bench.head_agreement` on one prompt: every format's figures are shares, the finer
    formats agree at least as often as NF4 here, and int6 nearly always."""
    from specchat.bench.head_agreement import agreement

    if not _compiler():
        pytest.skip("no C compiler")
    result = agreement(["The capital of France is"], new_tokens=12, progress=lambda *a: None)
    assert 1 <= result["positions"] <= 12
    shares = result["formats"]
    for r in shares.values():
        assert 0 <= r["greedy_agreement"] <= 1 and 0 < r["overlap_t1"] <= 1 + 1e-4
    assert shares["int6, blocks of 16"]["overlap_t1"] > shares["NF4, blocks of 64"]["overlap_t1"]
    assert shares["int6, blocks of 16"]["overlap_t1"] > 0.9
