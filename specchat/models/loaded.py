"""What loading a model returns, and the error it raises."""

from dataclasses import dataclass

import torch


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why in words a user can act on."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # what the user asked for (id or path), for display and stats
    quantization: str  # "nf4" | "none" | "bf16 (NF4 unavailable: ...)"
    device: torch.device
    load_s: float
    compute: str = ""  # how it runs, where not obvious: "dequantized once to float32"

    @property
    def label(self) -> str:
        how = f", {self.compute}" if self.compute else ""
        return f"{self.name} [{self.quantization}{how}, {self.device.type}]"
