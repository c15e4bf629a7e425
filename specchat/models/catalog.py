"""The models on this machine, where people keep them: `python -m specchat models`.

Discovery only, for a model picker: it reads GGUF headers, config.json files and safetensors
headers (the 8-byte length and the JSON after it), never a weight's data, and loads nothing.
A file it cannot read is listed with the reason, never fatal to the listing. The command's
table and its --json are specchat/cli.py's.

Where it looks, each root replaced by its environment variable when that is set:

    SPECCHAT_CACHE   specchat's cache (`specchat.paths.cache_dir()`): models/*/ checkpoints
                     (converted ones), gguf/*.gguf
    HF_HUB_CACHE     the Hugging Face hub cache; else HF_HOME/hub; else ~/.cache/huggingface/hub
    LMSTUDIO_MODELS  LM Studio; else ~/.lmstudio/models and ~/.cache/lm-studio/models
    OLLAMA_MODELS    Ollama; else ~/.ollama/models and /usr/share/ollama/.ollama/models

and the folders given on the command line (.gguf files and checkpoint folders under them).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass
from glob import escape
from pathlib import Path

from gguf import GGMLQuantizationType, LlamaFileType

from specchat.paths import cache_dir

# The families specchat runs. The catalog only reports against this set: whether a checkpoint
# or a GGUF file of one of them opens is the loaders' decision.
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
SOURCES = ("specchat", "huggingface", "lmstudio", "ollama", "folder")  # the listing's order
MAX_DEPTH = 3  # folders below a root that a walk enters (LM Studio: publisher/repo/file)
WEIGHTS = (".safetensors", ".bin")  # a checkpoint's weight files (its .gguf files list alone)
SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")  # llama.cpp's split files: name-00001-of-00003
OLLAMA_MODEL = "application/vnd.ollama.image.model"  # the manifest layer holding the GGUF
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}  # config.json dtype -> bytes
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
INCOMPLETE = "incomplete download (a weight file is missing)"


@dataclass
class Entry:
    """One model on disk, as the listing shows it (and `--json` writes it, key for key)."""

    name: str
    family: str | None  # architecture: GGUF general.architecture, config.json model_type
    parameters: int | None  # weights' element count; None where no header says
    quantization: str | None  # Q4_K_M, Q8_0, bf16, nf4, ...
    size_bytes: int | None  # the weight files' bytes; None when none is there
    path: str
    source: str  # one of SOURCES
    supported: bool = False  # whether specchat can open it
    why: str | None = None  # when not supported: the reason, in a few words


def search_roots(folders=()) -> list[tuple[str, Path]]:
    """(source, folder) for every place searched, the environment's overrides applied."""
    env, home = os.environ.get, Path.home()
    hub = env("HF_HUB_CACHE") or (Path(env("HF_HOME")) / "hub" if env("HF_HOME")
                                  else home / ".cache" / "huggingface" / "hub")
    lmstudio = [env("LMSTUDIO_MODELS")] if env("LMSTUDIO_MODELS") else \
        [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]
    ollama = [env("OLLAMA_MODELS")] if env("OLLAMA_MODELS") else \
        [home / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
    return [("specchat", cache_dir()), ("huggingface", Path(hub)),
            *(("lmstudio", Path(p)) for p in lmstudio), *(("ollama", Path(p)) for p in ollama),
            *(("folder", Path(p)) for p in folders)]


def list_models(folders=()) -> list[Entry]:
    """Every model found, sorted by source then name. A folder given that overlaps a known
    root does not list its models twice."""
    scanners = {"specchat": _specchat, "huggingface": _hub, "ollama": _ollama}
    found, seen = [], set()
    for source, root in search_roots(folders):
        for entry in filter(None, scanners.get(source, _folder)(root, source)):
            real = os.path.realpath(entry.path)
            if source != "folder" or real not in seen:
                found.append(entry)
                seen.add(real)
    return sorted(found, key=lambda e: (SOURCES.index(e.source), e.name.lower()))


def _specchat(root: Path, source: str):
    for folder in sorted((root / "models").glob("*/")):
        if ".tmp-" not in folder.name:  # a conversion under way (or killed) is not a model
            yield _checkpoint(folder, folder.name, source)
    for path in sorted((root / "gguf").glob("*.gguf")):
        yield _gguf(path, path.name, source)


def _hub(root: Path, source: str):
    """models--ORG--NAME/snapshots/<rev>/: the checkpoint at the snapshot's top, and each
    GGUF file anywhere in it as its own entry."""
    for repo in sorted(root.glob("models--*")):
        name = repo.name.removeprefix("models--").replace("--", "/", 1)
        snapshot = _snapshot(repo)
        for path in _walk(snapshot) if snapshot else ():
            if path.suffix == ".gguf":
                yield _gguf(path, f"{name}/{path.relative_to(snapshot).as_posix()}", source)
            elif path == snapshot:
                yield _checkpoint(path, name, source)


def _snapshot(repo: Path) -> Path | None:
    """The snapshot refs/main names, else the newest."""
    try:
        main = repo / "snapshots" / (repo / "refs" / "main").read_text().strip()
        if main.is_dir():
            return main
    except (OSError, ValueError):
        pass
    snapshots = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
    return max(snapshots, key=lambda p: p.stat().st_mtime, default=None)


def _ollama(root: Path, source: str):
    """manifests/<registry>/<namespace>/<model>/<tag>, named as `ollama list` names them."""
    for manifest in sorted(root.glob("manifests/*/*/*/*")):
        registry, namespace, model, tag = manifest.relative_to(root / "manifests").parts
        try:
            [digest] = [layer["digest"] for layer in _json(manifest)["layers"]
                        if layer["mediaType"] == OLLAMA_MODEL]
            blob = root / "blobs" / digest.replace(":", "-")  # sha256:HEX -> blobs/sha256-HEX
        except (TypeError, KeyError, ValueError, AttributeError):
            continue  # not a model's manifest
        prefix = "" if namespace == "library" else f"{namespace}/"
        if registry != "registry.ollama.ai":
            prefix = f"{registry}/{prefix}"
        yield _gguf(blob, f"{prefix}{model}:{tag}", source)


def _folder(root: Path, source: str):
    """.gguf files and checkpoint folders under root (LM Studio's tree, or a folder given)."""
    for path in _walk(root):
        name = path.relative_to(root).as_posix() if path != root else path.name
        yield (_gguf if path.suffix == ".gguf" else _checkpoint)(path, name, source)


def _walk(root: Path, depth: int = MAX_DEPTH):
    """root itself if a .gguf file; else every .gguf file and checkpoint folder (one holding
    config.json) in root and `depth` levels below it. Symlinks are followed, loops not;
    unreadable folders are skipped."""
    if root.suffix == ".gguf" and root.is_file():
        yield root
        return
    seen, stack = set(), [(root, 0)]
    while stack:
        folder, level = stack.pop()
        try:
            real = folder.resolve()
            if real in seen:
                continue
            seen.add(real)
            children = sorted(folder.iterdir())
            if any(child.name == "config.json" for child in children):
                yield folder
            for child in children:
                if child.suffix == ".gguf" and not child.is_dir():  # a dangling link too
                    yield child
                elif level < depth and child.is_dir() and not child.name.startswith("."):
                    stack.append((child, level + 1))
        except OSError:  # a folder it may not read
            continue


def _gguf(path: Path, name: str, source: str) -> Entry | None:
    """A GGUF file from its header; a split file's set from all its parts' headers."""
    split = SPLIT.search(path.name)
    if split and int(split[1]) != 1:
        return None  # listed with its first part
    prefix = escape(path.name[:split.start()]) if split else ""
    parts = sorted(path.parent.glob(f"{prefix}-?????-of-{split[2]}.gguf")) if split else [path]
    sizes = [_size(part) for part in parts]
    entry = Entry(name, None, None, None, sum(s or 0 for s in sizes) or None, str(path), source)
    if None in sizes:
        entry.why = INCOMPLETE
        return entry
    from specchat.models.gguf_header import ModelLoadError, read_gguf
    tensors, metadata = [], None
    for part, size in zip(parts, sizes):
        try:
            header = read_gguf(part)
        except ModelLoadError as e:
            entry.why = f"unreadable: {str(e).replace(str(part), part.name)}"
            return entry
        except (OSError, ValueError, KeyError, struct.error):  # a header cut short
            entry.why = "unreadable: the header is cut short or corrupt"
            return entry
        tensors += header.tensors.values()
        metadata = metadata or header.metadata
    entry.family = metadata.get("general.architecture")
    entry.parameters = sum(math.prod(t.shape) for t in tensors)
    entry.quantization = _gguf_quantization(metadata, tensors)
    if split and not entry.why:
        entry.why = f"split GGUF ({len(parts)} of its {int(split[2])} files here); " \
                    f"specchat opens single-file GGUF"
    return _judge(entry)


def _gguf_quantization(metadata: dict, tensors: list) -> str | None:
    """llama.cpp's name for general.file_type (Q4_K_M, Q8_0, F16...), else the type holding
    the most of the matrices' weights."""
    try:
        return LlamaFileType(metadata["general.file_type"]).name.removeprefix("MOSTLY_") \
            .removeprefix("ALL_")
    except (KeyError, ValueError):  # not given, or a number newer than the gguf package
        pass
    counts = Counter()
    for t in tensors:
        if len(t.shape) >= 2:
            counts[t.kind] += math.prod(t.shape)
    return GGMLQuantizationType(counts.most_common(1)[0][0]).name if counts else None


def _checkpoint(folder: Path, name: str, source: str) -> Entry | None:
    """A transformers checkpoint folder from its config.json and its weights' headers."""
    config = _json(folder / "config.json")
    config = config if isinstance(config, dict) else {}
    family = config.get("model_type") or (config.get("architectures") or [None])[0]
    if not isinstance(family, str):
        return None  # some other config.json (a tokenizer's, a pipeline's)
    try:
        sizes = {p: _size(p) for p in sorted(folder.iterdir()) if p.suffix in WEIGHTS}
    except OSError:
        return None
    shards, total_bytes = _index(folder)
    present = {p.name for p, size in sizes.items() if size is not None}
    complete = bool(present) and len(present) == len(sizes) and shards <= present
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    entry = Entry(name, family.removesuffix("_text"), None, None,
                  sum(s for s in sizes.values() if s is not None) or None, str(folder), source)
    headers = [_safetensors_counts(p) for p in sizes if p.name in present
               and p.suffix == ".safetensors"]
    counts = sum((h for h in headers if h), Counter())  # safetensors dtype -> elements
    if complete and headers and None not in headers:
        entry.parameters = sum(counts.values())
    elif isinstance(total_bytes, int) and dtype in DTYPES:
        entry.parameters = total_bytes // DTYPES[dtype]
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        entry.quantization = _quant_name(quant)
    elif counts:
        entry.quantization = counts.most_common(1)[0][0].lower()
    elif dtype:
        entry.quantization = SHORT_DTYPES.get(dtype, dtype)
    if not complete:
        entry.why = INCOMPLETE
    return _judge(entry)


def _index(folder: Path) -> tuple[set[str], int | None]:
    """(its shard files, the weights' total bytes) from a sharded checkpoint's *.index.json;
    (no files, None) without one."""
    for path in sorted(folder.glob("*.index.json")):
        index = _json(path)
        try:
            return set(index["weight_map"].values()), index.get("metadata", {}).get("total_size")
        except (TypeError, KeyError, AttributeError):  # not an index after all
            continue
    return set(), None


def _quant_name(quant: dict) -> str:
    """A quantization_config in a word: nf4, int8, gptq 4-bit, awq 4-bit, fp8..."""
    if quant.get("load_in_4bit"):
        return quant.get("bnb_4bit_quant_type", "4-bit")
    if quant.get("load_in_8bit"):
        return "int8"
    method, bits = quant.get("quant_method", "quantized"), quant.get("bits") or quant.get("w_bit")
    return f"{method} {bits}-bit" if bits else str(method)


def _safetensors_counts(path: Path) -> Counter | None:
    """dtype -> element count of a safetensors file, from its header alone: an 8-byte
    little-endian length, then that many bytes of JSON."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:  # no real header is this long: not a safetensors file
                return None
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        counts = Counter()
        for info in header.values():
            counts[info["dtype"]] += math.prod(info["shape"])
        return counts
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError):
        return None


def _judge(entry: Entry) -> Entry:
    """supported, unless a reason is known already or the family is not one specchat runs."""
    if not entry.why and entry.family not in SUPPORTED_FAMILIES:
        entry.why = f"architecture {entry.family} is not one specchat runs"
    entry.supported = not entry.why
    return entry


def _size(path: Path) -> int | None:
    """A file's bytes through its symlinks; None when it is not there (a dangling link)."""
    try:
        return path.stat().st_size
    except OSError:
        return None


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
