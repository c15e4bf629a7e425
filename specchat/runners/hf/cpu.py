"""Faster exact CPU paths for NF4 targets and float32 layers.

Each path computes what it replaces: NF4 layers decode bitsandbytes' codes exactly (checked per
layer at load), and products used by verification are row-exact (a row's result is the same
bits alone or among other rows, checked per shape at load), so speculative verification gives
the one-token steps' logits. docs/cpu.md explains each path."""

from __future__ import annotations

import contextlib
import ctypes
import os

import torch

from specchat import kernels
from specchat.runners import nf4
from specchat.runners.memory import release_freed_memory

# Rows (tokens) from which dequantize-then-matmul beats bitsandbytes' fused CPU kernel:
# dequantizing costs the same whatever the rows, while the fused kernel pays per row
# (docs/cpu.md has the measurements). Speculative verifies (k + 1 <= 11 rows) stay fused.
WIDE_ROWS = 64
WIDE_CHUNK = 256  # rows per matmul, padded to a multiple of 64: at most 4 shapes per weight.
# oneDNN keeps a primitive (and its buffers) per matmul shape; one shape per prompt length
# would grow resident memory with every new prompt length.


# bitsandbytes' fused CPU kernel packs output rows in blocks of 32 and reads whole quantization
# blocks of each input row; other shapes it refuses.
FUSED_BLOCK_N = 32


def fast_cpu_nf4(model, min_rows: int = WIDE_ROWS) -> int:
    """Give the model's NF4 layers a faster forward on CPUs with AVX512-BF16 (bitsandbytes'
    fused kernel). Returns the layers changed.

    - Inputs of `min_rows` tokens or more (prefill, feature extraction) go through the dense
      weight: dequantize to bf16, then plain matmuls. The fused kernel is fast for one token
      but pays per row, so long prompts encode faster this way. Each layer keeps its weight in
      bitsandbytes' canonical layout for this (a second copy of the 4-bit weights), read in
      whichever layout the layer is in (`nf4.codes_and_state`). Outputs match the fused kernel
      up to bf16 rounding.
    - Narrower inputs (decoding, verifies) call the fused kernel's C function directly, once it
      gave bit-identical output through bitsandbytes' own path. That path spends Python time on
      every call (checks, two dispatches, dtype casts), a visible share of a decoding step
      over a model's hundred-odd layers.
    The model is the same NF4 model either way, and transformers' `generate` gets it too.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    changed = 0
    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear4bit) or module.weight.device.type != "cpu" \
                or not getattr(module, "support_avx512bf16_for_cpu", False) \
                or module.out_features % FUSED_BLOCK_N \
                or module.in_features % module.weight.quant_state.blocksize:
            # no fused CPU kernel here, or a shape the kernel's blocks do not divide:
            # `dense_cpu_nf4` takes the layer
            continue
        module.forward = _CpuNF4Forward(module, min_rows)
        changed += 1
    return changed


class _CpuNF4Forward:
    """The forward of one bitsandbytes Linear4bit on CPU: see `fast_cpu_nf4`."""

    def __init__(self, module, min_rows: int):
        import copy

        from bitsandbytes.functional import dequantize_blockwise

        self.module, self.min_rows = module, min_rows
        self.fused = module.forward  # bitsandbytes' own: repacks the weight at its first call
        # bitsandbytes rewrites the layer's state in place when it repacks: keep a copy, in the
        # canonical layout (a second copy of the 4-bit weights), whichever layout it is in now
        self.weight, state = nf4.codes_and_state(module)
        self.state = copy.deepcopy(state)
        if self.state.nested:  # double quantization: undo it once here, not at every call
            self.state.absmax = (dequantize_blockwise(self.state.absmax, self.state.state2)
                                 + self.state.offset)
            self.state.nested, self.state.state2, self.state.offset = False, None, None
        self.kernel = None  # the C function, once checked against bitsandbytes' own path
        self.repacked: tuple | None = None  # the repacked weight, scales, shape, bias
        self.checked = False
        self.dense_weight: torch.Tensor | None = None  # kept while `dense_nf4` is active

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.module.training or x.requires_grad:
            return self.fused(x)
        if x.shape[:-1].numel() >= self.min_rows:
            return self._dense(x)
        if self.kernel is not None:
            return self._direct(x)
        out = self.fused(x)
        if not self.checked:  # first narrow call: the weight is repacked now
            self.checked = True
            self.kernel = _nf4_gemv_kernel(self.module)
            if self.kernel is not None and not torch.equal(self._direct(x), out):
                self.kernel = None  # another kernel is in use (e.g. kernels-community's)
        return out

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_4bit

        dense = self.dense_weight if self.dense_weight is not None \
            else dequantize_4bit(self.weight, self.state)  # [out, in] in the compute dtype
        bias = self.module.bias.to(dense.dtype) if self.module.bias is not None else None
        rows = x.reshape(-1, x.shape[-1]).to(dense.dtype)
        out = torch.cat([_linear_bucketed(chunk, dense, bias) for chunk in rows.split(WIDE_CHUNK)])
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)

    def _direct(self, x: torch.Tensor) -> torch.Tensor:
        if self.repacked is None:  # bitsandbytes' layout after its first call, kept from here
            weight, state = self.module.weight.data, self.module.weight.quant_state
            bias = self.module.bias
            self.repacked = (weight, state.absmax, state.shape[0], state.blocksize,
                             bias.to(torch.bfloat16) if bias is not None else None)
        weight, absmax, out_features, blocksize, bias = self.repacked
        a = x.reshape(-1, x.shape[-1])
        if a.dtype != torch.bfloat16 or not a.is_contiguous():
            a = a.to(torch.bfloat16).contiguous()
        out = torch.empty(a.shape[0], out_features, dtype=torch.bfloat16)
        # Plain ints through a typed prototype, and the weight's tensors kept: for one row, the
        # Python around the call costs as much as the product.
        self.kernel(a.shape[0], out_features, a.shape[1], a.data_ptr(), weight.data_ptr(),
                    absmax.data_ptr(), out.data_ptr(), blocksize, a.shape[1], out_features)
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)


DENSE_SHARE = 0.25  # dense copies of NF4 layers may take at most this share of the RAM


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _cpu_nf4_layers(model) -> list:
    """The model's NF4 layers on CPU that nothing has routed yet."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)
            and m.weight.device.type == "cpu" and "forward" not in vars(m)]


def kernel_cpu_nf4(model, lib) -> int:
    """On CPUs without native bf16, where bitsandbytes has no fused NF4 kernel, compute each
    NF4 layer with specchat's own kernel (`lib`: a `kernels.load` build), which reads the
    4-bit weights and decodes them in registers: the weights a step reads are 8x smaller than
    float32 copies. Each layer is checked at load against bitsandbytes' dequantized weight.
    Returns the layers changed (0 without kernels)."""
    if lib is None:
        return 0
    exact: dict[tuple, bool] = {}
    changed = 0
    for m in _cpu_nf4_layers(model):
        forward = NF4KernelForward(m, lib)
        if forward.usable(exact):
            m.forward = forward
            changed += 1
    return changed


class NF4KernelForward:
    """The forward of one NF4 layer through `kernels.nf4_matmul` (see `kernel_cpu_nf4`).
    A row's result is the same bits alone or among any number of rows."""

    def __init__(self, module, lib):
        from bitsandbytes.functional import dequantize_blockwise

        codes, state = nf4.hold(module)  # its codes are read from here on, never repacked
        self.module, self.lib, self.state = module, lib, state
        absmax = state.absmax
        if state.nested:  # double quantization: undo it once here, not at every call
            absmax = dequantize_blockwise(state.absmax, state.state2) + state.offset
        self.absmax = absmax.to(torch.float32).contiguous()
        self.table = state.code.to(torch.float32).contiguous()
        self._codes: torch.Tensor | None = codes
        self._restore = None  # where codes let go of (`release_codes`) come back from
        self.out_features, self.in_features = state.shape
        self.bias = module.bias.data.to(torch.float32) if module.bias is not None else None
        self.fallback = module.forward  # bitsandbytes' own, for gradients
        self.dense_weight: torch.Tensor | None = None  # kept while `dense_nf4` is active

    @property
    def codes(self) -> torch.Tensor:
        """The layer's codes (the module's weight), read back first if they were let go."""
        if self._codes is None:
            self._codes = self._restore().view(self._shape)
            self.module.weight.data = self._codes
        return self._codes

    def release_codes(self, restore) -> None:
        """Let go of the codes (the module's weight too) while another copy of the same bits
        serves every step, `runners.cpu`'s packed layer: at Llama 3.1 8B's shape 3.9 GB held
        twice. `restore()` gives them back, in bitsandbytes' order, the first time anything
        reads them again: this forward, bitsandbytes' own for gradients (through it),
        `dense_nf4` and `nf4.codes_and_state`."""
        codes = self.codes
        self._shape, self._restore = codes.shape, restore
        self._codes = None
        self.module.weight.data = torch.empty(0, dtype=codes.dtype)

    def restore_codes(self) -> None:
        self.codes  # (read: back where they were let go)

    def usable(self, exact: dict[tuple, bool]) -> bool:
        """Whether the kernel takes this layer's layout and computes what bitsandbytes does."""
        from bitsandbytes.functional import dequantize_4bit

        state, n_in = self.state, self.in_features
        if state.quant_type != "nf4" or getattr(state, "packing_format_for_cpu", False) \
                or self.codes.dtype != torch.uint8 or not self.codes.is_contiguous() \
                or self.codes.numel() * 2 != self.out_features * n_in \
                or self.table.numel() != 16 or n_in % state.blocksize or state.blocksize % 32 \
                or n_in > self.lib.max_in():
            return False
        x = torch.randn(MAX_COLUMNS, n_in, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            weight = dequantize_4bit(self.codes, state).to(torch.float32)
            got, want = self._product(x), torch.nn.functional.linear(x, weight)
            if not _agrees(got, want):
                return False
            shape = tuple(weight.shape)
            if shape not in exact:
                exact[shape] = _rows_independent(self._product, x)
        return exact[shape]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.nf4_matmul(self.lib, x, self.codes, self.absmax,
                                      self.state.blocksize, self.table, self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._codes is None:  # let go of (`release_codes`): bitsandbytes' forward reads them
            self.restore_codes()
        if x.requires_grad:
            return self.fallback(x)
        if self.dense_weight is not None:  # batched decoding (`dense_nf4`)
            return torch.nn.functional.linear(x.to(torch.float32), self.dense_weight,
                                              self.bias).to(x.dtype)
        out = self._product(x)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


def _agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A kernel's product against torch's, up to float32 rounding of a different sum order."""
    return torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def _rows_independent(product, x: torch.Tensor) -> bool:
    """Whether `product` gives each row of x the same bits alone and among up to all rows."""
    alone = torch.cat([product(x[i:i + 1]) for i in range(len(x))])
    return all(torch.equal(product(x[:n]), alone[:n]) for n in range(2, len(x) + 1))


def dense_cpu_nf4(model, share: float = DENSE_SHARE) -> int:
    """On CPUs without bitsandbytes' fused NF4 kernel (no AVX512-BF16), dequantize each NF4
    layer once and keep the dense weight in the compute dtype. bitsandbytes' fallback
    dequantizes every weight at every call, most of a decoding step. The weights are the NF4 model's own values, so the
    model computes the same function; only memory grows (4 bytes a weight in float32). Skipped
    when the copies would take more than `share` of the machine's memory (a 7B target would
    need 28 GB). In float32 the copies are packed for oneDNN where
    that is row-exact (`_pack`). Returns the layers changed."""
    layers = _cpu_nf4_layers(model)
    dtype = next((m.compute_dtype for m in layers if m.compute_dtype is not None),
                 torch.float32)
    size = sum(m.in_features * m.out_features for m in layers) * dtype.itemsize
    ram = _ram_bytes()
    if not layers or (ram and size > share * ram):
        return 0
    exact: dict[tuple, bool] = {}  # per weight shape: is the packed product row-exact here?
    for m in layers:
        m.forward = _DenseForward(m, dtype, exact)
    return len(layers)


class _DenseForward:
    """The forward of one NF4 layer from a dequantized copy of its weight (`dense_cpu_nf4`).
    In float32 the copy is packed for oneDNN (`_pack`) where each row's result is then the
    same bits whatever rows come with it: `linear` rounds one row differently from two or from
    four, and a greedy speculative reply would then leave the plain one at near-ties."""

    def __init__(self, module, dtype: torch.dtype, exact: dict[tuple, bool]):
        from bitsandbytes.functional import dequantize_4bit

        weight = dequantize_4bit(*nf4.codes_and_state(module)).to(dtype)
        self.bias = module.bias.data.to(dtype) if module.bias is not None else None
        self.fallback = module.forward  # bitsandbytes' own, for gradients
        self.packed = _pack(weight, exact)
        self.weight = None if self.packed is not None else weight  # one copy, not two

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:
            return self.fallback(x)
        if self.packed is None:
            return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight,
                                              self.bias).to(x.dtype)
        return _packed_product(self.packed, x.to(torch.float32), self.bias).to(x.dtype)


@contextlib.contextmanager
def dense_nf4(model):
    """While active, every forward of the model's NF4 layers on CPU (see `fast_cpu_nf4` and
    `kernel_cpu_nf4`) reads a dequantized copy of the weights, kept for the duration: batched
    decoding, where the fused kernels pay per row (and bitsandbytes' dequantizes at every call)
    and a dense product of many rows costs much less. The copies take 2 bytes per weight
    (bitsandbytes' layers, bf16) or 4 (specchat's kernel's, float32) and are dropped on exit.
    The outputs equal the kernels' up to rounding, as for prompts."""
    from bitsandbytes.functional import dequantize_4bit

    layers = [m.forward for m in model.modules()
              if isinstance(getattr(m, "forward", None), _CpuNF4Forward)]
    saved = [f.min_rows for f in layers]
    # specchat's NF4 kernel computes a row at a time, in float32: the copies are float32 too
    kernel_layers = [m.forward for m in model.modules()
                     if isinstance(getattr(m, "forward", None), NF4KernelForward)]
    try:
        for f in layers:
            f.dense_weight = dequantize_4bit(f.weight, f.state)
            f.min_rows = 1
        for f in kernel_layers:
            f.dense_weight = dequantize_4bit(f.codes, f.state).to(torch.float32)
        yield len(layers) + len(kernel_layers)
    finally:
        for f, rows in zip(layers, saved):
            f.dense_weight, f.min_rows = None, rows
        for f in kernel_layers:
            f.dense_weight = None
        release_freed_memory()


def _nf4_gemv_kernel(module):
    """bitsandbytes' C function behind its fused NF4 CPU kernel, or None where the layer is not
    in the layout it expects (repacked NF4, bf16 block scales) or the library lacks it."""
    state = module.weight.quant_state
    if not getattr(state, "packing_format_for_cpu", False) or state.quant_type != "nf4" \
            or state.absmax.dtype != torch.bfloat16 or module.weight.dtype != torch.uint8:
        return None
    try:
        from bitsandbytes.cextension import lib
        function = lib.gemv_4bit_inference_cpu_nf4_bf16
    except (ImportError, AttributeError, RuntimeError):
        return None
    # its own prototype (bitsandbytes' function object stays as it is): M, N, K, A, B, absmax,
    # out, blocksize, lda, ldc
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    prototype = ctypes.CFUNCTYPE(None, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64)
    return prototype(ctypes.cast(function, ptr).value)


def fast_lm_head(model, lib=None, share: float = DENSE_SHARE) -> bool:
    """A faster LM head for CPU inference. bf16: logits for a few rows (decoding, verifies) as
    `weight @ x.T` instead of `linear` (`_NarrowHead`). float32: the bf16 kernel of `lib` where
    the weights are bf16 values (`_Bf16KernelLinear`), else a copy packed for oneDNN
    (`_PackedHead`), where that is row-exact and the copy takes at most `share` of the RAM.
    Returns whether the head was changed."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None \
            or head.weight.device.type != "cpu":
        return False
    if head.weight.dtype == torch.bfloat16:
        head.forward = _NarrowHead(head)
        return True
    if head.weight.dtype != torch.float32:
        return False
    bf16 = _Bf16KernelLinear.build(head, lib)
    if bf16 is not None:
        head.forward = bf16
        return True
    ram = _ram_bytes()
    if not (ram and head.weight.nbytes > share * ram):
        packed = _pack(head.weight.detach(), {})
        if packed is not None:
            head.forward = _PackedHead(head, packed)
            return True
    return False


MAX_COLUMNS = 11  # a verify of 10 drafted tokens


def _pack(weight: torch.Tensor, exact: dict[tuple, bool]) -> torch.Tensor | None:
    """A float32 weight [out, in] reordered into oneDNN's blocked layout, or None where oneDNN
    is missing or where a row's result through it would depend on the rows beside it (checked
    once per weight shape; `exact` remembers the answers).

    On AVX2 CPUs MKL's float32 products of a few rows run far below memory speed, jump in
    cost at some row counts, and `linear` may round a row differently alone and among other
    rows. oneDNN's packed product (the kernel `torch.compile` uses for linear layers on CPU)
    gives each row the same bits among 1 to MAX_COLUMNS rows, and is faster (docs/cpu.md)."""
    if weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (AttributeError, RuntimeError):
        return None
    shape = tuple(weight.shape)
    if shape not in exact:
        x = torch.randn(MAX_COLUMNS, shape[1], generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            exact[shape] = _rows_independent(lambda rows: _packed_product(packed, rows), x)
    return packed if exact[shape] else None


def _packed_product(packed: torch.Tensor, x: torch.Tensor, bias=None) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias) through a weight packed by `_pack`."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def kernel_cpu_linears(model, lib) -> int:
    """float32 `nn.Linear` layers whose weights are bf16 values (a bf16 checkpoint loaded in
    float32: `--quantization none` on a CPU without native bf16, draft models) computed by
    specchat's bf16 kernel from a bf16 copy (`_Bf16KernelLinear`): half the bytes read, and
    each row the same bits among any number of rows, which `linear` does not give. Returns the
    layers changed."""
    changed = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear and m.weight.device.type == "cpu" \
                and "forward" not in vars(m):
            forward = _Bf16KernelLinear.build(m, lib)
            if forward is not None:
                m.forward = forward
                changed += 1
    return changed


class _Bf16KernelLinear:
    """A float32 linear layer whose weights are bf16 values, through `kernels.bf16_matmul`
    from a bf16 copy: the same products in float32 from half the bytes, faster than oneDNN's
    packed float32 (docs/cpu.md), and a row's result is the same bits among any number of
    rows. The float32 weight stays (tied embeddings, gradients)."""

    def __init__(self, linear: torch.nn.Linear, weight: torch.Tensor, lib):
        self.linear, self.weight, self.lib = linear, weight, lib
        self.bias = linear.bias.detach() if linear.bias is not None else None

    @classmethod
    def build(cls, linear: torch.nn.Linear, lib) -> "_Bf16KernelLinear | None":
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or weight.shape[1] % 8:
            return None
        if lib is None or weight.shape[1] > lib.max_in():
            return None
        compact = weight.to(torch.bfloat16)
        if not all(torch.equal(a.to(torch.float32), b)  # in chunks: no float32 copy at once
                   for a, b in zip(compact.split(16384), weight.split(16384))):
            return None  # not bf16 values: a bf16 copy would change the model
        made = cls(linear, compact, lib)
        x = torch.randn(MAX_COLUMNS, weight.shape[1], generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            got, want = made(x), torch.nn.functional.linear(x, weight, linear.bias)
            if not _agrees(got, want) or not _rows_independent(made, x):
                return None
        return made

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.requires_grad:
            return torch.nn.functional.linear(x, self.linear.weight.to(x.dtype), self.linear.bias)
        out = kernels.bf16_matmul(self.lib, x, self.weight)
        return out + self.bias if self.bias is not None else out


class _PackedHead:
    """A float32 LM head on a path without kernels (`runtime.PATHS`), through a copy
    packed for oneDNN (`_pack`): a row's logits are the same bits whether it is decoded alone
    or verified among up to 10 drafts (greedy speculation stays plain greedy), and a row
    costs about half as much (docs/cpu.md). The copy takes as much memory again as the head:
    the tied input embeddings still need the plain weight."""

    def __init__(self, head: torch.nn.Linear, packed: torch.Tensor):
        self.head, self.packed = head, packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.requires_grad:
            return torch.nn.functional.linear(x, self.head.weight.to(x.dtype))
        return _packed_product(self.packed, x)


class _NarrowHead:
    CHECKS = 8  # calls computed both ways before trusting weight @ x.T
    ROWS = 64  # more rows (prompts): linear, which is fast enough there

    def __init__(self, head: torch.nn.Linear):
        self.head, self.checks_left, self.fast = head, self.CHECKS, False

    @property
    def checked(self) -> bool:
        return self.checks_left == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight
        rows = x.shape[:-1].numel()
        if rows > self.ROWS or x.dtype != weight.dtype or x.requires_grad \
                or not (self.fast or self.checks_left):
            return torch.nn.functional.linear(x, weight)
        flat = x.reshape(rows, -1)
        both = flat.repeat(2, 1) if rows == 1 else flat  # one column takes a slow path
        out = torch.matmul(weight, both.T).T[:rows].contiguous().reshape(*x.shape[:-1], -1)
        if self.checks_left:  # linear's logits while checking: a call that differs is not seen
            reference = torch.nn.functional.linear(x, weight)
            same = torch.equal(out, reference)
            self.checks_left = self.checks_left - 1 if same else 0
            self.fast = same and self.checks_left == 0
            return reference
        return out


def _linear_bucketed(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    pad = -x.shape[0] % 64
    padded = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
    return torch.nn.functional.linear(padded, weight, bias)[:x.shape[0]]


GEMMA_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")  # x * rsqrt(...) * (1 + w)


def kernel_cpu_norms(model, lib) -> int:
    """Gemma's RMSNorms (six a layer) through specchat's kernel (`_GemmaNormKernel`): one call
    instead of nine small torch operations, whose dispatch costs more than the arithmetic on a
    decoding step's one row. Returns the norms changed (0 without kernels)."""
    if lib is None:
        return 0
    changed = 0
    for m in model.modules():
        if type(m).__name__ in GEMMA_NORMS and "forward" not in vars(m) \
                and m.weight.device.type == "cpu":
            forward = _GemmaNormKernel.build(m, lib)
            if forward is not None:
                m.forward = forward
                changed += 1
    return changed


class _GemmaNormKernel:
    """A Gemma RMSNorm's forward through `kernels.rms_norm`: the same formula in float32, each
    row alone. Checked at build against the module's own forward (float32 and bf16 inputs)."""

    def __init__(self, norm, lib):
        self.norm, self.lib, self.fallback = norm, lib, norm.forward
        self.w1 = (1.0 + norm.weight.detach().float()).contiguous()
        self.eps = float(norm.eps)

    @classmethod
    def build(cls, norm, lib) -> "_GemmaNormKernel | None":
        dim = norm.weight.shape[-1]
        if norm.weight.dim() != 1 or dim % 8 or not isinstance(getattr(norm, "eps", None), float):
            return None
        made = cls(norm, lib)
        x = torch.randn(MAX_COLUMNS, dim, generator=torch.Generator().manual_seed(0)) * 3
        with torch.inference_mode():
            for dtype in (torch.float32, torch.bfloat16):
                rows = x.to(dtype)
                got, want = made(rows), made.fallback(rows)
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                if got.dtype != want.dtype or not torch.allclose(got.float(), want.float(),
                                                                  rtol=tol, atol=tol):
                    return None
        return made

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad or x.dtype not in (torch.float32, torch.bfloat16):
            return self.fallback(x)
        return kernels.rms_norm(self.lib, x, self.w1, self.eps)


def compact_embeddings(model) -> bool:
    """float32 input embeddings holding bf16 values (a bf16 checkpoint computed in float32)
    kept as bf16 and widened at lookup: the same float32 vectors from half the memory (the
    embedded target's 262k x 640 table: 671 MB -> 336 MB). A tied LM head shares the bf16
    weight; its own forward (`fast_lm_head`, the GGUF's Q8_0 head) must already read a copy
    of its own. Checked on a sample of tokens against the module's own forward. Returns
    whether the table was compacted."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(embed, torch.nn.Embedding) or embed.weight.dtype != torch.float32 \
            or embed.weight.device.type != "cpu" or "forward" in vars(embed) \
            or embed.max_norm is not None:
        return False
    weight = embed.weight
    if head is not None and getattr(head, "weight", None) is weight and "forward" not in vars(head):
        return False  # the head still reads the float32 table
    shared = getattr(vars(head).get("forward") if head is not None else None, "weight", None)
    compact = shared if isinstance(shared, torch.Tensor) and shared.dtype == torch.bfloat16 \
        and shared.shape == weight.shape else weight.detach().to(torch.bfloat16)
    if not all(torch.equal(a.to(torch.float32), b)  # in chunks: no second float32 copy at once
               for a, b in zip(compact.split(16384), weight.detach().split(16384))):
        return False  # not bf16 values: a bf16 table would change the model
    made = _WideEmbedding(embed, compact)
    ids = torch.linspace(0, weight.shape[0] - 1, 64).long()[None]
    with torch.inference_mode():
        if not torch.equal(made(ids), embed(ids)):
            return False
    embed.forward = made
    weight.data = compact  # a tied head's Parameter too: it reads its own copy
    release_freed_memory()
    return True


class _WideEmbedding:
    """An embedding lookup from a bf16 table, widened to float32 (see `compact_embeddings`),
    with Gemma's scale where the module has one."""

    def __init__(self, embed: torch.nn.Embedding, table: torch.Tensor):
        self.embed = embed
        scale = getattr(embed, "embed_scale", None)
        self.scale = scale.to(torch.float32) if isinstance(scale, torch.Tensor) else None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed
        out = torch.nn.functional.embedding(ids, e.weight, e.padding_idx).to(torch.float32)
        return out * self.scale if self.scale is not None else out


def widen_to_float32(model, keep_table: bool = False) -> None:
    """Make a model loaded in bf16 (its checkpoint's dtype) compute what a float32 load
    computes: every bf16 parameter and buffer widened to float32 (exact), bitsandbytes'
    dequantized dtype float32, and a buffer with a Python value beside it (Gemma's
    `scalar_embed_scale`) recomputed from that value, as a float32 load makes it. Loading in
    bf16 and widening keeps no float32 copy of the whole file while it loads.

    `keep_table`: the input embedding table stays bf16 and is widened at lookup
    (`_WideEmbedding`); only where the LM head no longer reads it (a head with its own copy)."""
    from specchat.runners.cpu.q8_head import Q8Head

    embed = model.get_input_embeddings()
    table = embed.weight if keep_table and isinstance(embed, torch.nn.Embedding) else None
    for module in model.modules():
        if isinstance(vars(module).get("forward"), Q8Head):
            continue  # a head computed from its own Q8_0 copy: its bf16 weight stays as it is
        for name, p in module.named_parameters(recurse=False):
            if p.dtype == torch.bfloat16 and p is not table:
                p.data = p.data.to(torch.float32)
        for name, b in module.named_buffers(recurse=False):
            if b.dtype == torch.bfloat16:
                value = getattr(module, f"scalar_{name}", None)
                setattr(module, name, torch.tensor(value, dtype=torch.float32, device=b.device)
                        if isinstance(value, (int, float)) else b.to(torch.float32))
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None and getattr(state, "dtype", None) == torch.bfloat16:
            state.dtype = torch.float32
    if table is not None:
        embed.forward = _WideEmbedding(embed, table)
    release_freed_memory()
