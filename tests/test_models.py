"""Loading: weights that stay views of the memory-mapped checkpoint are moved into owned memory."""

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

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
