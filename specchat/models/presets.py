"""Named target/draft pairs for a GPU with access to a model hub."""

from __future__ import annotations

from dataclasses import dataclass

from specchat.models.embedded import EMBEDDED


@dataclass(frozen=True)
class Preset:
    target: str  # hub id of the target (quantized to NF4)
    draft: str  # hub id of a small draft sharing the target's tokenizer
    note: str  # one line for --help and the UI
    # hub id of a public EAGLE-3 head for the target (the `head` drafter; --head overrides),
    # "" where none is published
    head: str = ""


PRESETS: dict[str, Preset] = {
    "qwen2.5-7b": Preset("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct",
                         "Qwen2.5-7B-Instruct NF4 + Qwen2.5-0.5B-Instruct (~6 GB VRAM)"),
    "llama3.1-8b": Preset("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct",
                          "Llama-3.1-8B-Instruct NF4 + Llama-3.2-1B-Instruct (~8 GB VRAM), "
                          "EAGLE-3 head yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                          head="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
    "gemma3-12b": Preset("google/gemma-3-12b-it", "google/gemma-3-270m-it",
                         "gemma-3-12b-it NF4 + gemma-3-270m-it (~9 GB VRAM)"),
    "embedded": Preset(EMBEDDED, "", "Gemma 3 270M NF4, offline, CPU; n-gram drafter"),
}
