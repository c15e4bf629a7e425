"""Saving and loading draft heads, bound to the identity of the target they were trained for."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict
from pathlib import Path

import torch

from specchat.models.eagle import DraftHead, HeadConfig, norm_scale_of
from specchat.paths import assets_dir

FORMAT = "specchat-head/1"


class HeadMismatchError(ValueError):
    """A head file was trained for another target (or is not a head file)."""


# -- target identity, saving and loading -------------------------------------------------------

_CONFIG_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim",
                "rms_norm_eps", "tie_word_embeddings")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@torch.no_grad()
def target_identity(model, tokenizer, name: str = "") -> dict:
    """What a head is bound to: the target's architecture, vocabulary and (a sample of) weights.
    Independent of quantization and dtype, so an NF4 and an fp32 load of one model match."""
    cfg = model.config.get_text_config().to_dict()
    config_hash = _sha(json.dumps({k: cfg.get(k) for k in _CONFIG_KEYS}, sort_keys=True))[:16]
    vocab_hash = _sha(json.dumps(sorted(tokenizer.get_vocab().items())))[:16]
    emb = model.get_input_embeddings().weight
    rows = torch.linspace(1, emb.shape[0] - 1, 16).long().to(emb.device)
    fingerprint = torch.cat([norm_scale_of(model)[:64],
                             emb[rows, :16].float().flatten().cpu()])
    return {"name": name, "config": config_hash, "vocab": vocab_hash,
            "key": _sha(config_hash + vocab_hash)[:12],
            "fingerprint": [round(float(x), 5) for x in fingerprint]}


def identity_problem(recorded: dict, actual: dict) -> str | None:
    """None when a head recorded for `recorded` may draft for `actual`; else why not."""
    if recorded.get("config") != actual["config"]:
        return "its architecture differs"
    if recorded.get("vocab") != actual["vocab"]:
        return "its vocabulary differs"
    a, b = torch.tensor(recorded.get("fingerprint", [])), torch.tensor(actual["fingerprint"])
    if a.shape != b.shape or not torch.allclose(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max())):
        return "its weights differ (a fine-tune or another checkpoint of the same architecture)"
    return None


def slug(name: str) -> str:
    base = Path(name.rstrip("/")).name if name else "target"
    base = base.split(" (")[0]  # "Gemma 3 270M (embedded, ...)" -> "Gemma 3 270M"
    return re.sub(r"[^a-z0-9.]+", "-", base.lower()).strip("-") or "target"


def default_head_dir(identity: dict) -> Path:
    from specchat.paths import cache_dir
    return cache_dir() / "heads" / f"{slug(identity['name'])}-{identity['key']}"


SHIPPED_DIR = assets_dir() / "heads"


def save_head(path: str | Path, head: DraftHead, identity: dict, meta: dict | None = None,
              dtype: torch.dtype = torch.bfloat16):
    """Weights in `dtype` (bf16 halves the file; drafting runs in fp32 either way)."""
    from safetensors.torch import save_file
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    params = {name for name, _ in head.named_parameters()}
    tensors = {k: (v.to(dtype) if k in params else v).detach().cpu().contiguous()
               for k, v in head.state_dict().items()}
    header = {"format": FORMAT, "config": asdict(head.cfg), "target": identity,
              "meta": meta or {}}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"specchat": json.dumps(header)})
    tmp.replace(path)  # atomic: a killed save never leaves half a head


def read_header(path: str | Path) -> dict:
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {}).get("specchat", "{}"))
    except Exception as e:  # noqa: BLE001  (a truncated or foreign file: say so)
        raise HeadMismatchError(f"{path}: not a readable draft head ({e})") from e
    if header.get("format") != FORMAT:
        raise HeadMismatchError(f"{path}: not a specchat draft head (format "
                                f"{header.get('format')!r}, expected {FORMAT!r})")
    return header


def load_head(path: str | Path, model, tokenizer, identity: dict | None = None,
              name: str = "") -> DraftHead:
    """Load a head for `model`, refusing one trained for another target."""
    from safetensors.torch import load_file
    header = read_header(path)
    actual = identity or target_identity(model, tokenizer, name)
    problem = identity_problem(header["target"], actual)
    if problem:
        trained_for = header["target"].get("name") or "another target"
        raise HeadMismatchError(
            f"The draft head {path} was trained for {trained_for}"
            f" (config {header['target'].get('config')}, vocab {header['target'].get('vocab')}); "
            f"the loaded target {actual['name'] or ''} (config {actual['config']}, vocab "
            f"{actual['vocab']}) is different: {problem}. Train a head for this target with "
            f"`python -m specchat train-draft --target ...`.")
    head = DraftHead(HeadConfig(**header["config"]))
    head.load_state_dict(load_file(str(path)), strict=False)
    device = next(model.parameters()).device
    return head.to(device).attach(model).eval()


def any_heads() -> bool:
    """Is there any head file at all (so that hashing the target's vocabulary can be skipped)?"""
    from specchat.paths import cache_dir
    return any((cache_dir() / "heads").glob("*/head.safetensors")) or \
        any(SHIPPED_DIR.glob("*.safetensors"))


def find_head(identity: dict) -> Path | None:
    """The head for this target: trained here (cache) first, then one shipped in assets/."""
    candidates = [default_head_dir(identity) / "head.safetensors",
                  *sorted(SHIPPED_DIR.glob(f"*-{identity['key']}.safetensors"))]
    for path in candidates:
        if path.exists():
            return path
    return None
