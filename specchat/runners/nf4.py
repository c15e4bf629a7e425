"""bitsandbytes' NF4 layers as specchat reads them, on every CPU kind.

On a CPU with AVX512-BF16 (Zen 4, Sapphire Rapids and later), bitsandbytes repacks a
`Linear4bit`'s weight for its own CPU kernel at the layer's first forward
(`Linear4bit.forward` → `functional._convert_weight_packed_for_cpu`): the codes are reordered in
tiles of 32 output rows, the block scales become bf16 and transposed, double quantization is
undone, and the state says `packing_format_for_cpu`. The module's `weight.data` is then a new
tensor. On other CPUs, and on CUDA, nothing moves.

Whatever reads a layer's codes reads them here, in bitsandbytes' canonical layout (codes
[out * in / 2] two to a byte, one float32 absmax per block), whatever ran before:
- `codes_and_state` reads a layer and changes nothing;
- `hold` also puts the layer back in the canonical layout and stops bitsandbytes from
  repacking it, for code that keeps views of the layer's buffers (or hands the module views of
  its own) from then on.
"""

from __future__ import annotations

import copy

import torch


def is_nf4_layer(module) -> bool:
    return type(module).__name__ in ("Linear4bit", "LinearNF4") \
        and getattr(module.weight, "quant_state", None) is not None


def repacked(module) -> bool:
    """Whether bitsandbytes has repacked this layer for its AVX512-BF16 CPU kernel."""
    return bool(getattr(module.weight.quant_state, "packing_format_for_cpu", False))


def codes_and_state(module) -> tuple[torch.Tensor, object]:
    """The layer's codes and a quantization state in bitsandbytes' canonical layout, read from
    the layout the layer is in now. A repacked layer's block scales are the bf16 values that
    bitsandbytes' kernel computes with since the repack. The module is not changed; on a layer
    that was never repacked these are its own tensors."""
    restore = getattr(vars(module).get("forward"), "restore_codes", None)
    if restore is not None:  # codes a packed copy stood in for (`NF4KernelForward`)
        restore()
    weight, state = module.weight.data, module.weight.quant_state
    if not repacked(module):
        return weight, state
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    # The inverse rewrites the state it is given, and re-quantizes the scales where the layer
    # was double-quantized: give it a copy that keeps them plain.
    state = copy.copy(state)
    state.original_nested = False
    scales = state.absmax  # [in / block, out] bf16
    codes, state = _convert_weight_packed_for_cpu_inverse(weight, state)
    state.absmax = scales.T.reshape(-1).to(torch.float32).contiguous()
    state.dtype = getattr(state, "original_dtype", state.dtype)
    return codes, state


def hold(module) -> tuple[torch.Tensor, object]:
    """`codes_and_state`, and the layer keeps that canonical layout from now on: its weight and
    state are replaced by the canonical ones where it was repacked, and bitsandbytes no longer
    repacks it at a forward (its `support_avx512bf16_for_cpu` off). Returns the layer's codes
    and state, which are then the module's own."""
    codes, state = codes_and_state(module)
    if codes is not module.weight.data:
        module.weight.data, module.weight.quant_state = codes, state
    module.support_avx512bf16_for_cpu = False
    return codes, state
