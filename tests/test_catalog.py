"""`python -m specchat models`: every source's layout built small in tmp_path, real GGUF and
safetensors files, the fields read from their headers."""

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from specchat.cli import _human, main
from specchat.models.catalog import list_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def write_gguf(path, arch="llama", file_type=gguf.LlamaFileType.MOSTLY_Q8_0, rows=4):
    """A real GGUF file: an F32 embedding [8, 32], a Q8_0 matrix [rows, 64], an F16 [4, 16]:
    256 + 64 * rows + 64 parameters."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    q8 = gguf.quants.quantize(np.random.default_rng(0).random((rows, 64), np.float32), Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=Q8_0)
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 16), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_checkpoint(folder, model_type="llama", **config):
    """config.json and a bf16 model.safetensors of 4 * 8 + 8 = 40 parameters."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    save_file({"w": torch.zeros(4, 8, dtype=torch.bfloat16),
               "b": torch.zeros(8, dtype=torch.bfloat16)}, folder / "model.safetensors")
    return folder


def hub_repo(hub, repo, files, rev="abc123"):
    """models--ORG--NAME as the hub cache lays it out: files in blobs/, the snapshot's names
    symlinks to them, refs/main naming the snapshot. files: name -> a function writing it
    (None: a link to a blob that is not there, a download cut short)."""
    root = hub / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / rev
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for k, (name, write) in enumerate(files.items()):
        blob = root / "blobs" / f"{rev}{k:04d}"
        if write is not None:
            write(blob)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(os.path.relpath(blob, (snapshot / name).parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(rev)
    return snapshot


def text(content):
    return lambda path: path.write_text(content)


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """Every source's root set to an empty folder of tmp_path. -> {source: Path}"""
    out = {name: tmp_path / name for name in ("specchat", "hub", "lmstudio", "ollama")}
    for path in out.values():
        path.mkdir()
    monkeypatch.setenv("SPECCHAT_CACHE", str(out["specchat"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(out["hub"]))
    monkeypatch.setenv("LMSTUDIO_MODELS", str(out["lmstudio"]))
    monkeypatch.setenv("OLLAMA_MODELS", str(out["ollama"]))
    return out


def by_name(entries):
    return {e.name: e for e in entries}


def test_gguf_fields_from_the_header(roots):
    path = write_gguf(roots["specchat"] / "gguf" / "tiny-Q8_0.gguf")
    write_gguf(roots["specchat"] / "gguf" / "half.gguf", file_type=gguf.LlamaFileType.MOSTLY_F16)
    write_gguf(roots["specchat"] / "gguf" / "guess.gguf", file_type=None, rows=64)
    found = by_name(list_models())
    tiny = found["tiny-Q8_0.gguf"]
    assert (tiny.family, tiny.parameters, tiny.quantization) == ("llama", 256 + 256 + 64, "Q8_0")
    assert tiny.size_bytes == path.stat().st_size and tiny.path == str(path)
    assert tiny.source == "specchat" and tiny.supported and tiny.why is None
    assert found["half.gguf"].quantization == "F16"
    # Without general.file_type: the type holding most of the matrices' weights (Q8_0 64x64)
    assert found["guess.gguf"].quantization == "Q8_0"


def test_specchat_checkpoint_gemma3_text_is_gemma3(roots):
    folder = write_checkpoint(roots["specchat"] / "models" / "gemma-3-270m-bf16", "gemma3_text")
    (roots["specchat"] / "models" / "gemma-3-270m-bf16.tmp-123").mkdir()  # a conversion
    [entry] = list_models()
    assert (entry.name, entry.family, entry.parameters, entry.quantization) == \
        ("gemma-3-270m-bf16", "gemma3", 40, "bf16")
    assert entry.size_bytes == (folder / "model.safetensors").stat().st_size
    assert entry.supported


def test_hub_snapshot_of_refs_main_its_links_resolved(roots):
    checkpoint = write_checkpoint(roots["hub"] / "staging", "qwen2",
                                  quantization_config={"load_in_4bit": True,
                                                       "bnb_4bit_quant_type": "nf4"})
    snapshot = hub_repo(roots["hub"], "Org/Tiny", {
        "config.json": text((checkpoint / "config.json").read_text()),
        "model.safetensors": lambda p: p.write_bytes((checkpoint / "model.safetensors")
                                                     .read_bytes()),
        "gguf/tiny-Q8_0.gguf": write_gguf})
    old = snapshot.parent / "old"  # newer on disk, but refs/main names the other
    write_checkpoint(old, "mamba")
    found = by_name(e for e in list_models() if e.source == "huggingface")
    assert set(found) == {"Org/Tiny", "Org/Tiny/gguf/tiny-Q8_0.gguf"}
    tiny = found["Org/Tiny"]
    assert (tiny.family, tiny.parameters, tiny.quantization, tiny.path) == \
        ("qwen2", 40, "nf4", str(snapshot))
    assert tiny.size_bytes == (checkpoint / "model.safetensors").stat().st_size
    assert found["Org/Tiny/gguf/tiny-Q8_0.gguf"].parameters == 576


def test_hub_download_cut_short_is_incomplete(roots):
    hub_repo(roots["hub"], "Org/Dangling", {"config.json": text('{"model_type": "llama"}'),
                                            "model.safetensors": None,
                                            "tiny.gguf": None})
    index = {"metadata": {"total_size": 2000}, "weight_map": {"a": "model-00001-of-00002"
             ".safetensors", "b": "model-00002-of-00002.safetensors"}}
    one = write_checkpoint(roots["hub"] / "staging").joinpath("model.safetensors").read_bytes()
    hub_repo(roots["hub"], "Org/Sharded", {
        "config.json": text('{"model_type": "llama", "torch_dtype": "bfloat16"}'),
        "model.safetensors.index.json": text(json.dumps(index)),
        "model-00001-of-00002.safetensors": lambda p: p.write_bytes(one)})
    found = by_name(list_models())
    for name in ("Org/Dangling", "Org/Dangling/tiny.gguf", "Org/Sharded"):
        assert not found[name].supported and "incomplete" in found[name].why, name
    assert found["Org/Dangling"].size_bytes is None
    # The second shard is not there: the parameters are the index's bytes over bf16's 2
    assert found["Org/Sharded"].parameters == 1000
    assert found["Org/Sharded"].size_bytes == len(one)


def test_ollama_names_as_ollama_lists_them(roots):
    blob = write_gguf(roots["ollama"] / "blobs" / ("sha256-" + "ab" * 32))
    manifest = {"layers": [{"mediaType": "application/vnd.ollama.image.license",
                            "digest": "sha256-00"},
                           {"mediaType": "application/vnd.ollama.image.model",
                            "digest": "sha256:" + "ab" * 32}]}
    for where in ("registry.ollama.ai/library/tiny/latest", "registry.ollama.ai/me/coder/7b",
                  "hf.co/Org/Repo/Q8_0"):
        (roots["ollama"] / "manifests" / where).parent.mkdir(parents=True)
        (roots["ollama"] / "manifests" / where).write_text(json.dumps(manifest))
    (roots["ollama"] / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "bad") \
        .write_text("{not json")
    found = by_name(list_models())
    assert set(found) == {"tiny:latest", "me/coder:7b", "hf.co/Org/Repo:Q8_0"}
    assert all(e.source == "ollama" and e.path == str(blob) and e.parameters == 576
               and e.supported for e in found.values())


def test_lmstudio_tree_and_what_cannot_be_opened(roots):
    lm = roots["lmstudio"]
    write_gguf(lm / "pub" / "repo" / "good-Q8_0.gguf")
    write_gguf(lm / "pub" / "repo" / "mamba.gguf", arch="mamba")
    write_gguf(lm / "pub" / "split" / "big-00001-of-00003.gguf")
    write_gguf(lm / "pub" / "split" / "big-00002-of-00003.gguf", rows=8)
    whole = write_gguf(lm / "pub" / "cut" / "cut-data.gguf").read_bytes()
    (lm / "pub" / "cut" / "cut-data.gguf").write_bytes(whole[:-100])
    (lm / "pub" / "cut" / "cut-header.gguf").write_bytes(whole[:60])
    (lm / "pub" / "cut" / "empty.gguf").write_bytes(b"")
    (lm / "pub" / "cut" / "notes.gguf").write_text("not a model")
    found = by_name(list_models())
    assert all(e.source == "lmstudio" for e in found.values())
    assert found["pub/repo/good-Q8_0.gguf"].supported
    expect = {"pub/repo/mamba.gguf": "architecture mamba",
              "pub/split/big-00001-of-00003.gguf": "split GGUF (2 of its 3 files here)",
              "pub/cut/cut-data.gguf": f"past the file's end ({len(whole) - 100:,} bytes)",
              "pub/cut/cut-header.gguf": "its header cannot be read",
              "pub/cut/empty.gguf": "unreadable",
              "pub/cut/notes.gguf": "notes.gguf is not a GGUF file"}
    for name, why in expect.items():
        assert not found[name].supported and why in found[name].why, (name, found[name].why)
    split = found["pub/split/big-00001-of-00003.gguf"]
    assert split.parameters == 576 + 832  # both parts' tensors
    assert split.size_bytes == sum(p.stat().st_size for p in (lm / "pub" / "split").iterdir())
    assert "pub/split/big-00002-of-00003.gguf" not in found


def test_folders_given_loops_depth_and_overlap(roots, tmp_path):
    extra = tmp_path / "extra"
    write_checkpoint(extra / "ckpt", "phi3")
    write_gguf(extra / "a" / "tiny.gguf")
    write_gguf(extra / "a" / "b" / "c" / "d" / "too-deep.gguf")
    (extra / "a" / "loop").symlink_to(extra)
    write_gguf(roots["lmstudio"] / "pub" / "repo" / "x.gguf")
    found = by_name(list_models([extra, roots["lmstudio"], extra / "a" / "tiny.gguf"]))
    assert {n for n, e in found.items() if e.source == "folder"} == {"ckpt", "a/tiny.gguf"}
    assert (found["ckpt"].family, found["ckpt"].parameters, found["ckpt"].supported) == \
        ("phi3", 40, True)
    assert found["pub/repo/x.gguf"].source == "lmstudio"  # listed once, from LM Studio


def test_the_catalog_imports_no_torch():
    code = "import sys, specchat.models.catalog; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_the_models_command_imports_no_torch(roots):
    """`models` starts in well under a second: the CLI and the listing (a GGUF's header and a
    checkpoint's config read) import neither torch nor transformers."""
    write_gguf(roots["lmstudio"] / "pub" / "repo" / "good-Q8_0.gguf")
    write_checkpoint(roots["specchat"] / "models" / "tiny")
    code = ("import json, sys\n"
            "from specchat.cli import main\n"
            "assert main(['models', '--json']) == 0\n"
            "print(json.dumps(sorted(m for m in sys.modules\n"
            "                        if m.split('.')[0] in ('torch', 'transformers'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    *listing, imported = proc.stdout.splitlines()
    assert [r["name"] for r in json.loads("\n".join(listing))] == ["tiny",
                                                                    "pub/repo/good-Q8_0.gguf"]
    assert json.loads(imported) == []


def test_counts_and_sizes_in_a_few_digits():
    assert [_human(n) for n in (None, 999, 1000, 268_098_176, 1_236_000_000, 999_960)] == \
        ["-", "999", "1K", "268M", "1.24B", "1M"]
    assert [_human(n, size=True) for n in (208, 1728, 253_037_344, 16_060_522_496)] == \
        ["208 B", "1.73 KB", "253 MB", "16.1 GB"]


def run(capsys, *args):
    capsys.readouterr()
    code = main(["models", *args])
    return code, *capsys.readouterr()


def test_cli_table_and_json(roots, capsys):
    write_gguf(roots["lmstudio"] / "pub" / "repo" / "good-Q8_0.gguf")
    write_gguf(roots["lmstudio"] / "pub" / "repo" / "mamba.gguf", arch="mamba")
    write_checkpoint(roots["specchat"] / "models" / "tiny")
    code, out, _ = run(capsys)
    header, *lines = out.splitlines()
    starts = [header.index(c) for c in ("name", "family", "params", "quant", "size", "source",
                                        "path")]
    cells = [[line[i:j].strip() for i, j in zip(starts, [*starts[1:], None])]
             for line in lines]
    size = (roots["specchat"] / "models" / "tiny" / "model.safetensors").stat().st_size
    assert code == 0 and cells[0] == ["tiny", "llama", "40", "bf16", f"{size} B", "specchat",
                                      str(roots["specchat"] / "models" / "tiny")]
    assert cells[1][:4] == ["pub/repo/good-Q8_0.gguf", "llama", "576", "Q8_0"]
    assert cells[1][5] == "lmstudio" and cells[2][:2] == ["pub/repo/mamba.gguf", "mamba"]
    assert lines[3].strip() == "not supported: architecture mamba is not one specchat runs"
    assert len(lines) == 4
    code, out, _ = run(capsys, "--json")
    rows = json.loads(out)
    assert code == 0 and [r["name"] for r in rows] == [
        "tiny", "pub/repo/good-Q8_0.gguf", "pub/repo/mamba.gguf"]
    assert list(rows[0]) == ["name", "family", "parameters", "quantization", "size_bytes",
                             "path", "source", "supported", "why"]
    assert rows[1]["parameters"] == 576 and rows[1]["supported"] is True
    assert rows[1]["why"] is None and rows[2]["supported"] is False


def test_cli_nothing_found_says_where_it_looked(roots, capsys):
    code, out, _ = run(capsys)
    assert code == 0 and out.startswith("no models found in: ")
    assert str(roots["hub"]) in out and str(roots["ollama"]) in out
    code, out, err = run(capsys, "--json")
    assert code == 0 and json.loads(out) == [] and "no models found" in err


def test_python_m_specchat_models(roots, tmp_path):
    write_gguf(tmp_path / "extra" / "tiny.gguf")
    proc = subprocess.run([sys.executable, "-m", "specchat", "models", "--json",
                           str(tmp_path / "extra")], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    [row] = json.loads(proc.stdout)
    assert (row["name"], row["source"], row["parameters"]) == ("tiny.gguf", "folder", 576)
