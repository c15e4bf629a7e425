"""A GGUF file's header and tensor table, read without its tensors' data and without torch:
what `specchat models` (models/catalog.py) lists a file by, and what the conversions
(models/gguf_files.py, models/embedded.py) check a file against before they read its weights.
The vocabulary's strings are skipped, only counted: a 262k-token vocabulary costs nothing."""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why in words a user can act on."""


WHAT_WORKS = ("--target and --draft-model take a GGUF file, a folder holding one, a model "
              "directory (config.json, the weights, the tokenizer's files) or a hub id")


@dataclass(frozen=True)
class Tensor:
    """Where one tensor's values lie in a GGUF file, and how they are stored."""

    shape: tuple[int, ...]  # in torch's order (GGUF lists the fastest-varying dimension first)
    kind: int  # ggml's type number (F32, Q8_0, Q4_K, ...)
    start: int  # byte offset in the file
    size: int  # bytes


@dataclass(frozen=True)
class GgufHeader:
    path: Path
    metadata: dict  # key -> value; arrays of strings (the vocabulary) as their length only
    tensors: dict[str, Tensor]

    @property
    def arch(self) -> str | None:
        return self.metadata.get("general.architecture")


# GGUF metadata value types -> struct formats of the fixed-size ones (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}


class _Corrupt(Exception):
    """The header ends early or holds what no writer writes."""


def read_gguf(path: Path) -> GgufHeader:
    """A GGUF file's (version 2 or 3) metadata and tensor table, without the tensors' data.
    Every tensor's type must be one ggml knows and its data must lie within the file:
    a truncated or corrupt file is refused here, before anything reads its data."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with GGUF's "
                                 f"magic bytes): {WHAT_WORKS}")
        if end < 24:
            raise ModelLoadError(f"{path} is truncated: {end} bytes, less than a GGUF header; "
                                 "download it again")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            try:
                metadata, table, pos = _read_header(m, path)
            except (_Corrupt, struct.error, UnicodeDecodeError) as e:
                raise ModelLoadError(f"{path} is truncated or corrupt: its header cannot be "
                                     f"read ({e or 'it ends early'}); download it again") from e
    alignment = metadata.get("general.alignment", 32)
    data = -(-pos // alignment) * alignment  # the tensors' data starts aligned after the table
    tensors = {}
    for name, shape, kind, offset in table:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path}: tensor {name} has ggml type {kind}, which the gguf "
                                 "package does not know (a corrupt file, or one newer than "
                                 "the installed gguf package)") from None
        size = math.prod(shape) // block * block_bytes
        tensor = Tensor(shape, kind, data + offset, size)
        if tensor.start + size > end:
            raise ModelLoadError(f"{path} is truncated: tensor {name} ends at byte "
                                 f"{tensor.start + size:,}, past the file's end ({end:,} "
                                 "bytes); download it again")
        tensors[name] = tensor
    return GgufHeader(path, metadata, tensors)


def _read_header(m: mmap.mmap, path: Path) -> tuple[dict, list, int]:
    """(metadata, [(name, shape, type, offset)], the byte after the tensor table)."""
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 and 3 are): "
                             "convert it again with a recent llama.cpp")
    end = len(m)
    pos = 24

    def string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", m, pos)
        if pos + 8 + n > end:
            raise _Corrupt(f"a string of {n:,} bytes at byte {pos:,}")
        return m[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n

    def value(kind: int, pos: int):
        if kind in _SCALARS:
            fmt = "<" + _SCALARS[kind]
            return struct.unpack_from(fmt, m, pos)[0], pos + struct.calcsize(fmt)
        if kind == 8:
            return string(pos)
        if kind != 9:
            raise _Corrupt(f"unknown GGUF value type {kind}")
        item, count = struct.unpack_from("<IQ", m, pos)
        pos += 12
        if item in _SCALARS:  # numbers: the scores and token types, a few thousand bytes
            if pos + count * struct.calcsize(_SCALARS[item]) > end:
                raise _Corrupt(f"an array of {count:,} values at byte {pos:,}")
            fmt = f"<{count}{_SCALARS[item]}"
            return list(struct.unpack_from(fmt, m, pos)), pos + struct.calcsize(fmt)
        if pos + count * 8 > end:  # each string takes at least its 8-byte length
            raise _Corrupt(f"an array of {count:,} strings at byte {pos:,}")
        for _ in range(count):  # strings: skipped, only counted
            pos = value(item, pos)[1]
        return count, pos

    metadata = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", m, pos)
        metadata[key], pos = value(kind, pos + 4)
    if n_tensors * 24 > end:  # a name's length, a dimension, a type and an offset at least
        raise _Corrupt(f"{n_tensors:,} tensors")
    table = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", m, pos)
        if n_dims > 8:
            raise _Corrupt(f"tensor {name} has {n_dims} dimensions")
        dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
        kind, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        table.append((name, tuple(reversed(dims)), kind, offset))
    return metadata, table, pos
