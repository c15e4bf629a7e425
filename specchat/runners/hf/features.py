"""The target's features, kept by hooks on transformers' modules during the forwards the
runner already makes: the output of its final norm (what the LM head reads, and the EAGLE-1
head drafts from), or the hidden states entering chosen decoder layers (what an EAGLE-3 head
fuses)."""

import torch
from torch import nn

# -- reading the target ------------------------------------------------------------------------


def _decoder(model) -> nn.Module:
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def final_norm(model) -> nn.Module:
    """The target's final norm: its output is what the LM head reads (our features)."""
    norm = getattr(_decoder(model), "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__}: cannot find the final norm (model.norm)")
    return norm


def decoder_layers(model) -> nn.ModuleList:
    layers = getattr(_decoder(model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (model.layers)")
    return layers


class FeatureTap:
    """Keeps features of the target's latest forward, batch row 0.

    layers None: the output of the final norm [batch, fed, d].
    layers (i, j, ...): the hidden states entering decoder layers i, j, ... (index L, one past
    the last layer, is the last layer's output, entering the final norm), concatenated in that
    order [batch, fed, len(layers) * d]. That is the residual stream vLLM and SGLang capture
    for EAGLE-3 (`aux_hidden_states.append(hidden_states + residual)` before layer i runs, in
    vllm/model_executor/models/llama.py and python/sglang/srt/models/llama.py), and
    transformers' `output_hidden_states[i]` for i < L (its entry L is after the final norm)."""

    def __init__(self, model, layers: tuple[int, ...] | None = None):
        self.layers = layers
        self.last: torch.Tensor | None = None  # [batch, fed tokens, d]: final norm's output
        self._inputs: dict[int, torch.Tensor] = {}  # layer index -> its input, latest forward
        if layers is None:
            self._handles = [final_norm(model).register_forward_hook(self._hook)]
            return
        blocks = decoder_layers(model)
        self._handles = []
        for i in sorted(set(layers)):
            if not 0 <= i <= len(blocks):
                raise ValueError(f"layer {i}: the target has {len(blocks)} decoder layers")
            module = blocks[i] if i < len(blocks) else final_norm(model)
            self._handles.append(module.register_forward_pre_hook(
                self._input_hook(i), with_kwargs=True))

    def _hook(self, module, args, output):
        self.last = output[0] if isinstance(output, tuple) else output

    def _input_hook(self, index: int):
        def hook(module, args, kwargs):
            self._inputs[index] = args[0] if args else kwargs["hidden_states"]
        return hook

    def batch(self) -> torch.Tensor:
        """Features of the latest forward, every batch row: [batch, fed, width]."""
        if self.layers is None:
            return self.last
        return torch.cat([self._inputs[i] for i in self.layers], dim=-1)

    def features(self, n: int, rows: list[int] | None = None) -> torch.Tensor:
        """Features of the latest forward, batch row 0: its first n positions, or the
        positions `rows` (a draft tree's accepted path): [n, width]."""
        last = self.batch()  # with layers, a new tensor: no later forward overwrites it
        if rows is None:
            return last[0, :n]
        return last[0, torch.tensor(rows, device=last.device)]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
