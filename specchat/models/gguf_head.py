"""Integer LM heads made at load (`gguf_file_head`): a GGUF's own Q8_0 blocks (the embedded
target's, and a `--target FILE.gguf`'s whose head is Q8_0) or Q6_K ones (most
Q4_K_M, Q5_K_M, Q6_K and Q4_0 files), run by `runners.cpu.q8_head.Q8Head` and
`runners.cpu.q6_k_head.Q6KHead` on specchat's kernels; else another model's float head
quantized once to Q8_0 on the integer path (`quantized_q8_head`).

The embedded Gemma 3 270M ships as a GGUF whose token embedding, tied to the LM head, is Q8_0:
int8 values with one fp16 scale per 32. Those are the model's true values; the converted
checkpoint holds them rounded to bf16, and the default CPU head reads a bf16 copy (335 MB a
token). This head reads the int8 values and their fp16 scales instead (178 MB), so a decoding step
spends less time on its largest weight. Like the other kernels it is row-exact: a row's logits
are the same bits alone or among any number of rows, so verification stays lossless.
docs/cpu.md has the measurements.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specchat.models.loaded import ModelLoadError
from specchat.runners.cpu.q6_k_head import BYTES as Q6_K_BYTES
from specchat.runners.cpu.q6_k_head import SUPER as Q6_K_SUPER
from specchat.runners.cpu.q6_k_head import Q6KHead
from specchat.runners.cpu.q8_head import BLOCK, Q8Head, activation_error, quantize_q8_0
from specchat.runners.memory import release_freed_memory

BLOCK_BYTES = 2 + BLOCK  # an fp16 scale, then 32 int8 values


def read_q8_0(gguf_file: str | Path, name: str | None = None, chunk_rows: int = 4096,
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q int8 [rows, cols], d float16 [rows, cols / 32]) of a Q8_0 tensor in a GGUF file (by
    default its LM head, `head_tensor`), or None when the file has no such Q8_0 tensor. Reads
    the header (`gguf_files.read_gguf`, which skips the vocabulary's strings) and that tensor's
    bytes only, `chunk_rows` rows at a time into the two arrays: no mapping of the file, whose
    pages would count as resident memory while it lasts (178 MB for the embedded target), and no
    whole-tensor temporary."""
    from specchat.models.gguf_files import read_gguf

    tensors = read_gguf(Path(gguf_file)).tensors
    name = name or head_tensor(tensors)
    tensor = tensors.get(name)
    if tensor is None or tensor.kind != Q8_0 or len(tensor.shape) != 2 \
            or tensor.shape[1] % BLOCK:
        return None
    rows, cols = tensor.shape
    blocks = cols // BLOCK
    q = np.empty((rows, cols), np.int8)
    d = np.empty((rows, blocks), np.float16)
    raw = np.empty((min(chunk_rows, rows), blocks, BLOCK_BYTES), np.uint8)
    with open(gguf_file, "rb") as f:
        f.seek(tensor.start)
        for r in range(0, rows, chunk_rows):
            part = raw[:min(chunk_rows, rows - r)]
            if f.readinto(memoryview(part).cast("B")) != part.nbytes:
                raise ValueError(f"{gguf_file}: {name} ends before its {rows} rows")
            d[r:r + len(part)] = part[..., :2].copy().view(np.float16)[..., 0]
            q[r:r + len(part)] = part[..., 2:].view(np.int8).reshape(len(part), cols)
    return torch.from_numpy(q), torch.from_numpy(d)


Q8_0, Q6_K = 8, 14  # ggml's type numbers


def read_q6_k(gguf_file: str | Path, chunk_rows: int = 4096) -> torch.Tensor | None:
    """uint8 [rows, cols / 256 * 210]: a GGUF's LM head (`head_tensor`) as its Q6_K bytes, or
    None when that tensor is not Q6_K. Read `chunk_rows` rows at a time, as `read_q8_0`."""
    from specchat.models.gguf_files import read_gguf

    tensors = read_gguf(Path(gguf_file)).tensors
    name = head_tensor(tensors)
    tensor = tensors.get(name)
    if tensor is None or tensor.kind != Q6_K or len(tensor.shape) != 2 \
            or tensor.shape[1] % Q6_K_SUPER:
        return None
    rows, cols = tensor.shape
    out = np.empty((rows, cols // Q6_K_SUPER * Q6_K_BYTES), np.uint8)
    with open(gguf_file, "rb") as f:
        f.seek(tensor.start)
        for r in range(0, rows, chunk_rows):
            part = out[r:r + chunk_rows]
            if f.readinto(memoryview(part).cast("B")) != part.nbytes:
                raise ValueError(f"{gguf_file}: {name} ends before its {rows} rows")
    return torch.from_numpy(out)


def head_tensor(tensors) -> str:
    """The name of the LM head among a GGUF's tensors: `output.weight`, or where the file has
    none (a head tied to the embedding, as llama.cpp writes one) `token_embd.weight`."""
    return "output.weight" if "output.weight" in tensors else "token_embd.weight"


def gguf_file_head(model, gguf_file: str | Path, lib) -> str | None:
    """Give a CPU model (float32 or bf16) the LM head of its GGUF's head tensor
    (`head_tensor`) in the file's own type, Q8_0 or Q6_K, where the checkpoint's head is that
    tensor rounded to bf16 (checked on a sample of rows) and `lib`'s kernel (a `kernels.load`
    build, or None) is row-exact and agrees with the dequantized values. Returns the type, or
    None where it gave none."""
    head = model.get_output_embeddings()
    if lib is None or not isinstance(head, torch.nn.Linear) or head.bias is not None \
            or head.weight.dtype not in (torch.float32, torch.bfloat16) \
            or head.weight.device.type != "cpu" \
            or head.weight.shape[1] % BLOCK or head.weight.shape[1] > lib.max_in():
        return None
    for kind, read, make in (("Q8_0", read_q8_0, lambda q8: Q8Head(head, *q8, lib)),
                             ("Q6_K", read_q6_k, lambda rows: Q6KHead(head, rows, lib))):
        try:
            found = read(gguf_file)
            made = make(found) if found is not None else None
        except (ImportError, OSError, ValueError, ModelLoadError):
            made = None  # (a head of other sizes than its kernel takes: ValueError)
        if made is not None and made.q.shape[0] == head.weight.shape[0] \
                and _same_values(made, head.weight):
            head.forward = made  # the bf16 copy the previous head read goes with its forward
            release_freed_memory()
            return kind
    return None


def gguf_q8_head(model, gguf_file: str | Path, lib) -> bool:
    """`gguf_file_head` for a file whose head is Q8_0 (the embedded target's)."""
    return gguf_file_head(model, gguf_file, lib) == "Q8_0"


def _same_values(made: Q8Head, weight: torch.Tensor) -> bool:
    """Whether `made` holds `weight`'s values (their bf16 rounding, on a sample of rows) and its
    kernel agrees with them."""
    sample = torch.linspace(0, weight.shape[0] - 1, 64).long()
    with torch.inference_mode():
        values = made.dequantized(sample)
        if values.shape[1] != weight.shape[1] or not torch.equal(
                values.to(torch.bfloat16).to(torch.float32),
                weight.detach()[sample].to(torch.float32)):
            return False  # another file, or another model's weights
        return _kernel_agrees(made, sample, values)


def quantized_q8_head(model, lib) -> bool:
    """Give a CPU model's float LM head (float32 or bf16, tied or its own) a Q8_0 copy of its
    weight and this forward: a step reads half the bytes of a bf16 head, and a verify's rows go
    through the integer kernel, several times faster than the float one at 8 rows. The logits
    are the Q8_0 weight's (as llama.cpp's for a Q8_0 head), checked at load against the
    dequantized values within the activations' rounding, and row-exact. Returns whether it
    did."""
    head = model.get_output_embeddings()
    if not _float_head(head, lib, BLOCK):
        return False
    return _take(head, Q8Head(head, *quantize_q8_0(head.weight), lib))


def quantized_nf4_head(model, lib) -> bool:
    """Give a draft model's float LM head an NF4 copy of its weight (`runners.cpu.nf4_head`):
    4.5 bits a weight where Q8_0 reads 8.5, on the integer NF4 kernel, checked and row-exact as
    `quantized_q8_head`'s. Returns whether it did."""
    from specchat.runners.cpu.nf4_head import BLOCKSIZE, NF4Head

    head = model.get_output_embeddings()
    if not _float_head(head, lib, BLOCKSIZE):
        return False
    return _take(head, NF4Head(head, lib))


def _float_head(head, lib, block: int) -> bool:
    """Whether an integer head of blocks of `block` inputs can take this float LM head."""
    return lib is not None and isinstance(head, torch.nn.Linear) and head.bias is None \
        and "forward" not in vars(head) \
        and head.weight.dtype in (torch.float32, torch.bfloat16) \
        and head.weight.device.type == "cpu" and head.weight.shape[0] % 16 == 0 \
        and head.weight.shape[1] % block == 0 and head.weight.shape[1] <= lib.max_in()


def _take(head, made: Q8Head) -> bool:
    """Give `head` the forward `made` where its kernel passes `_kernel_agrees` on 64 rows."""
    sample = torch.linspace(0, head.weight.shape[0] - 1, 64).long()
    with torch.inference_mode():
        if not _kernel_agrees(made, sample, made.dequantized(sample)):
            return False
    head.forward = made
    return True


def _kernel_agrees(made: Q8Head, sample: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the head's kernel gives the logits of its dequantized `values` (rows `sample`)
    within the activations' int8 rounding, and each row the same bits among other rows."""
    from specchat.runners.hf.cpu import MAX_COLUMNS, _rows_independent

    x = torch.randn(MAX_COLUMNS, values.shape[1], generator=torch.Generator().manual_seed(0))
    got, want = made(x)[:, sample], x @ values.T
    bound = activation_error(x, values) + 1e-4 * want.abs().max()  # + float32 sums
    return bool(((got - want).abs() <= bound).all()) and _rows_independent(made, x)
