"""What runs a loaded model's forwards: one folder per runtime behind the runner seam
(core/runner.py), and the one place that picks among them.

| folder  | runner                  | runs                                                          |
| ------- | ----------------------- | ------------------------------------------------------------- |
| `hf/`   | `hf.runner.HFRunner`    | transformers' forward, any model on any device; on a CPU with specchat's kernels swapped in under its modules (`hf.cpu`) |
| `cpu/`  | `cpu.runner.CpuRunner`  | the decoder stack of every `family.py` family in one C call, on specchat's kernels (`cpu.kernels`, `cpu/csrc/`) |
| `cuda/` | `cuda.runner.CudaRunner` | specchat's forward on CUDA: a static cache, one padded width, CUDA graphs, Triton kernels |

`models.load.load_model` loads the weights, then asks `use_cpu_runner` or `use_cuda_runtime`
which runner takes them; every variable that steers that choice is read here. (The CPU's compute
path, `SPECCHAT_CPU_PATH`, is chosen before loading: `models.runtime`.)
"""

from __future__ import annotations

import os

CPU_RUNNER_ENV = "SPECCHAT_CPU_RUNNER"  # "transformers": the CPU paths run transformers' forward
CUDA_RUNTIME_ENV = "SPECCHAT_CUDA_RUNTIME"  # "transformers": transformers' forward on CUDA


DECODER_FORWARD = "specchat's decoder forward"  # the label's part that names the runner


def use_cpu_runner(loaded, lib, int8: bool = False) -> None:
    """Give a CPU model (a `LoadedModel`) specchat's own forward (`cpu.runner.CpuRunner`, one C
    call a forward) where its path left every layer on specchat's kernels (`lib`) and the runner
    takes the model (`int8`: on the integer NF4 kernels, the `cpu-int8` path); it keeps
    transformers' forward otherwise, and `SPECCHAT_CPU_RUNNER=transformers` asks for it."""
    from specchat.runners.cpu import runner

    if lib is None or os.environ.get(CPU_RUNNER_ENV, "") == "transformers" \
            or runner.unsupported(loaded.model):
        return
    loaded.runner_ = runner.CpuRunner(loaded.model, lib, int8=int8)
    loaded.compute = ", ".join(filter(None, [loaded.compute, DECODER_FORWARD + (
        f" (integer products: {runner.integer_kernel(lib)})" if int8 else "")]))


def use_cuda_runtime(loaded, progress) -> tuple[str, tuple[str, ...]]:
    """Give a model loaded on CUDA specchat's CUDA runtime where it can run it (a Llama-family
    or Gemma 3 model, Triton importable); else it runs on transformers' forward, and says why.
    -> (the runtime's name, why the CUDA runtime was not taken)."""
    if os.environ.get(CUDA_RUNTIME_ENV) == "transformers":
        return "cuda-transformers", (f"cuda-graphs: {CUDA_RUNTIME_ENV}=transformers",)
    try:
        from specchat.runners.cuda.runner import CudaRunner, unsupported
    except ImportError as e:  # no Triton
        why = f"cuda-graphs: Triton does not import ({e})"
    else:
        why = unsupported(loaded.model)
        if why is None:
            try:
                loaded.runner_ = CudaRunner(loaded.model)
                return "cuda-graphs", ()
            except Exception as e:  # a kernel that does not build on this GPU, say
                why = f"it failed to start ({type(e).__name__}: {str(e).splitlines()[0]})"
        why = f"cuda-graphs: {why}"
    progress(f"specchat: {why}; running on transformers' forward")
    return "cuda-transformers", (why,)


def use_transformers_forward(loaded) -> None:
    """Give a model transformers' forward (`hf.runner.HFRunner`, made on first use) in place
    of the runner it took: for a drafter that reads what only hooks on transformers' modules
    give (an EAGLE-3 head's decoder layers). The weights stay where they are; specchat's CPU
    kernels keep running under the modules."""
    loaded.runner_ = None
    loaded.compute = ", ".join(part for part in loaded.compute.split(", ")
                               if part and not part.startswith(DECODER_FORWARD))
