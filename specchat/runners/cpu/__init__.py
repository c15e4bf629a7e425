"""specchat's own forward on a CPU (`runner.CpuRunner`): a Gemma 3 decoder stack in one C call,
on specchat's kernels (`kernels`, the C sources in `csrc/` with their ABI in `csrc/specchat.h`)."""
