"""specchat's own forward on a CPU (`runner.CpuRunner`): a Gemma 3 decoder stack in one C call,
and the draft head's chain step (`head_step`), on specchat's kernels (`specchat.kernels`)."""
