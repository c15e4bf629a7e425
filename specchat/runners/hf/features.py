"""The target's features: the output of its final norm, which the LM head reads and the EAGLE
head drafts from, kept by a forward hook."""

import torch
from torch import nn

# -- reading the target ------------------------------------------------------------------------


def final_norm(model) -> nn.Module:
    """The target's final norm: its output is what the LM head reads (our features)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model")
    norm = getattr(base, "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__}: cannot find the final norm (model.norm)")
    return norm


class FeatureTap:
    """Keeps the output of the target's final norm from its latest forward."""

    def __init__(self, model):
        self.last: torch.Tensor | None = None  # [batch, fed tokens, d]
        self._handle = final_norm(model).register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.last = output[0] if isinstance(output, tuple) else output

    def features(self, n: int, rows: list[int] | None = None) -> torch.Tensor:
        """Features of the latest forward, batch row 0: its first n positions, or the
        positions `rows` (a draft tree's accepted path): [n, d]."""
        if rows is None:
            return self.last[0, :n]
        return self.last[0, torch.tensor(rows, device=self.last.device)]

    def close(self) -> None:
        self._handle.remove()
