"""bitsandbytes' NF4 layers read in the layout they are in, on every CPU kind.

On a CPU with AVX512-BF16, bitsandbytes repacks a layer's weight for its own CPU kernel at the
layer's first forward. The tests force that repack on and off (`tiny.bnb_cpu_repack`), so an
AVX2 machine checks what a Zen 4 or a Sapphire Rapids does, and the other way round."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("bitsandbytes")

from bitsandbytes.functional import dequantize_4bit  # noqa: E402
from tiny import bnb_cpu_repack  # noqa: E402

from specchat.runners import nf4  # noqa: E402


@pytest.fixture
def nf4_model(tmp_path):
    """A tiny Llama in NF4 with double quantization (scales quantized again), bf16 compute."""
    return _load(tmp_path, torch.bfloat16)


def _load(tmp_path, dtype):
    from transformers import (AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig,
                              LlamaForCausalLM)

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant, dtype=dtype,
                                                device_map={"": "cpu"}).eval()


def _canonical(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's codes and its dequantized weight, with the block scales rounded to bf16 as a
    repack rounds them."""
    from bitsandbytes.functional import dequantize_blockwise

    state = copy.copy(layer.weight.quant_state)
    absmax = dequantize_blockwise(state.absmax, state.state2) + state.offset
    state.absmax, state.nested = absmax.bfloat16().float(), False
    return layer.weight.data.clone(), dequantize_4bit(layer.weight.data, state).float()


@pytest.mark.parametrize("repack", [False, True], ids=["as-on-avx2", "as-on-avx512bf16"])
def test_codes_and_state_read_a_layer_in_the_layout_it_is_in(nf4_model, repack):
    layers = bnb_cpu_repack(nf4_model, on=repack, now=True)
    assert len(layers) == 7
    for layer in layers:
        assert nf4.repacked(layer) is repack
        codes, state = nf4.codes_and_state(layer)
        assert nf4.repacked(layer) is repack  # the module is as it was
        assert codes.dtype == torch.uint8
        assert codes.numel() * 2 == layer.in_features * layer.out_features
        assert not getattr(state, "packing_format_for_cpu", False)
        # a layer never repacked: its own tensor
        assert (codes.data_ptr() == layer.weight.data.data_ptr()) is not repack
        weight = dequantize_4bit(codes, state)
        assert weight.shape == (layer.out_features, layer.in_features)


def test_a_repacked_layer_reads_back_its_own_codes_and_scales(nf4_model):
    """Codes exactly, scales as the bf16 values bitsandbytes computes with after the repack."""
    layers = bnb_cpu_repack(nf4_model, on=False)
    before = {layer: _canonical(layer) for layer in layers}
    bnb_cpu_repack(nf4_model, on=True, now=True)
    for layer in layers:
        assert nf4.repacked(layer)
        assert layer.weight.data.numel() == before[layer][0].numel()
        assert not torch.equal(layer.weight.data.reshape(-1), before[layer][0].reshape(-1))
        codes, state = nf4.codes_and_state(layer)
        assert torch.equal(codes.reshape(-1), before[layer][0].reshape(-1))
        assert torch.equal(dequantize_4bit(codes, state).float(), before[layer][1])


def test_hold_puts_a_layer_back_and_no_forward_repacks_it_again(nf4_model):
    layers = bnb_cpu_repack(nf4_model, on=True, now=True)
    layer = layers[0]
    codes, state = nf4.hold(layer)
    assert codes.data_ptr() == layer.weight.data.data_ptr() and state is layer.weight.quant_state
    assert not nf4.repacked(layer) and layer.support_avx512bf16_for_cpu is False
    pointer = layer.weight.data.data_ptr()
    with torch.inference_mode():
        out = layer(torch.randn(1, layer.in_features, dtype=torch.bfloat16))
    assert out.shape == (1, layer.out_features)
    assert layer.weight.data.data_ptr() == pointer and not nf4.repacked(layer)
    x = torch.randn(3, layer.in_features)
    with torch.inference_mode():
        assert torch.allclose(layer(x.bfloat16()).float(),
                              x @ dequantize_4bit(codes, state).float().T, atol=0.05, rtol=0.02)


def test_bitsandbytes_forward_repacks_where_the_flag_is_on(nf4_model):
    """The library's own trigger, on a CPU where its kernel for the repacked layout exists."""
    from bitsandbytes.functional import has_avx512bf16
    if not has_avx512bf16():
        pytest.skip("bitsandbytes has no kernel for the repacked layout on this CPU: "
                    "test_codes_and_state_read_a_layer_in_the_layout_it_is_in forces the repack")
    layer = bnb_cpu_repack(nf4_model, on=True)[0]
    with torch.inference_mode():
        layer(torch.randn(1, layer.in_features, dtype=torch.bfloat16))
    assert nf4.repacked(layer)


@pytest.mark.parametrize("repack", [False, True], ids=["as-on-avx2", "as-on-avx512bf16"])
def test_specchats_nf4_kernel_takes_every_layer_in_either_layout(tmp_path, repack):
    """The CPU runner's NF4 layers read their codes through `nf4.hold`: a layer bitsandbytes
    has repacked is read back, not refused or misread."""
    from specchat import kernels
    from specchat.runners.hf.cpu import NF4KernelForward, kernel_cpu_nf4

    lib = kernels.load()
    if lib is None:
        pytest.skip("no C compiler: no specchat kernels")
    nf4_model = _load(tmp_path, torch.float32)
    layers = bnb_cpu_repack(nf4_model, on=False)
    before = {layer: _canonical(layer) for layer in layers}
    bnb_cpu_repack(nf4_model, on=repack, now=True)
    assert kernel_cpu_nf4(nf4_model, lib) == 7
    x = torch.randn(4, 256)  # the widest input, down_proj's
    for layer in layers:
        assert isinstance(layer.forward, NF4KernelForward)
        assert torch.equal(layer.forward.codes.reshape(-1), before[layer][0].reshape(-1))
        weight = before[layer][1] if repack else dequantize_4bit(
            layer.weight.data, layer.weight.quant_state).float()
        with torch.inference_mode():
            got = layer(x[:, :layer.in_features])
        assert torch.allclose(got, x[:, :layer.in_features] @ weight.T, atol=1e-4, rtol=1e-4)
