"""Loading: weights that stay views of the memory-mapped checkpoint are moved into owned memory."""

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

from specchat.models import _copy_out_of_file_mapping, _file_mappings
from tests.tiny import tiny_gemma3

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/maps")


def _mapped(model) -> list[str]:
    spans = _file_mappings()
    return [name for name, p in model.named_parameters()
            if any(start <= p.data_ptr() < end for start, end in spans)]


def test_unquantized_weights_leave_the_file_mapping_unchanged(tmp_path):
    tiny_gemma3(0, vocab=4096).to(torch.bfloat16).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert _mapped(model), "safetensors loading no longer memory-maps: the copy is moot"
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    _copy_out_of_file_mapping(model, chunk_bytes=4096)  # many chunks per tensor

    assert _mapped(model) == []
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_wide_inputs_take_the_dense_path_and_agree_with_the_fused_kernel(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import LlamaConfig, LlamaForCausalLM

    from specchat.models import WIDE_ROWS, load_model
    from tests.tiny import byte_tokenizer

    torch.manual_seed(0)  # NF4 blocks of 64 and bitsandbytes' CPU packing want multiples of 64
    cfg = LlamaConfig(vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    model = load_model(str(tmp_path), "nf4", "cpu").model
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers
    routed = [m for m in layers if "forward" in vars(m)]
    if not routed:
        pytest.skip("no AVX512-BF16: bitsandbytes has no fused CPU kernel to route around")

    layer = routed[0]
    fused = bnb.nn.Linear4bit.forward  # the class's own forward: bitsandbytes' kernel
    with torch.inference_mode():
        one = torch.randn(1, 1, layer.in_features, dtype=torch.bfloat16)
        assert torch.equal(layer(one), fused(layer, one))  # narrow: the fused kernel...
        assert layer.forward.kernel is not None  # ...called directly once checked identical
        three = torch.randn(1, 3, layer.in_features, dtype=torch.bfloat16)
        assert torch.equal(layer(three), fused(layer, three))
        wide = torch.randn(1, WIDE_ROWS, layer.in_features, dtype=torch.bfloat16)
        dense, reference = layer(wide).float(), fused(layer, wide).float()
    assert not torch.equal(dense, reference)  # another path really ran...
    assert (dense - reference).norm() < 0.01 * reference.norm()  # ...computing the same product

    ids = torch.randint(3, 259, (1, WIDE_ROWS + 8))
    with torch.inference_mode():
        logits = model(ids).logits.float()
        saved = {m: vars(m).pop("forward") for m in routed}  # back to the fused kernel only
        reference = model(ids).logits.float()
        for m, forward in saved.items():
            m.forward = forward
    assert (logits - reference).norm() < 0.02 * reference.norm()


def test_narrow_logits_through_weight_times_x_are_bit_identical():
    from transformers import Gemma3TextConfig

    from specchat.models import _NarrowHead, fast_lm_head

    # The embedded target's width, 640: at widths like 32, the two can round differently
    # (then the head keeps linear, which the checks are there to catch).
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=4096, hidden_size=640, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, layer_types=["full_attention"])
    model = Gemma3ForCausalLM(cfg).to(torch.bfloat16).eval()
    n = _NarrowHead.CHECKS + 4  # past the checks: weight @ x.T alone for the last calls
    ids = torch.randint(0, 4096, (1, n))
    with torch.inference_mode():
        reference = [model(ids[:, :i + 1], logits_to_keep=1).logits[0, -1] for i in range(n)]
        assert fast_lm_head(model)
        fast = [model(ids[:, :i + 1], logits_to_keep=1).logits[0, -1] for i in range(n)]
        for rows in (1, 2, 5, n):  # one row or several: each row's logits as linear's
            hidden = model.model(ids[:, :rows]).last_hidden_state
            assert torch.equal(model(ids[:, :rows]).logits,
                               torch.nn.functional.linear(hidden, model.lm_head.weight))
    for a, b in zip(fast, reference):
        assert torch.equal(a, b)
    assert model.lm_head.forward.checked
    if not model.lm_head.forward.fast:
        pytest.skip("weight @ x.T is not bit-identical to linear on this CPU: the head keeps "
                    "linear")
