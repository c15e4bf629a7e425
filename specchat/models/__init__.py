"""Loading models: targets (NF4 through bitsandbytes), draft models, the embedded default, the
presets, vocabulary checks, the CPU's compute paths and their proof, and specchat's trained draft
head. What runs a loaded model's forwards lives in `specchat.runners`."""
