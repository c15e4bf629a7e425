"""Loading models: targets (NF4 through bitsandbytes), draft models, the embedded default, the
presets, vocabulary checks, the CPU paths and kernels, and specchat's trained draft head."""
