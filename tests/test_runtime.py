"""The model runtime: CPU detection from flags, the path it picks, forcing a path, and the
row-exactness each loaded model proves (a path that fails it is never taken silently)."""

import pytest
import torch
from tiny import byte_tokenizer

from specchat.models import runtime
from specchat.models.runtime import PATHS, PathError, candidates, cpu_kind

pytestmark = pytest.mark.usefixtures("one_thread")

X86 = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx"
AVX2_ONLY = f"{X86} avx2 fma f16c bmi2"  # AMD EPYC Zen 3, Intel Haswell..Comet Lake
AVX_VNNI = f"{AVX2_ONLY} avx_vnni"  # Intel Alder Lake and later client cores
AVX512_NO_BF16 = f"{AVX2_ONLY} avx512f avx512bw avx512vl avx512dq avx512cd avx512_vnni"  # Xeon SP
AVX512_BF16 = f"{AVX512_NO_BF16} avx512_bf16 avx512_vbmi"  # AMD Zen 4/5, Cooper Lake
AMX = f"{AVX512_NO_BF16} amx_bf16 amx_tile amx_int8"  # Sapphire Rapids
ARM = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16 i8mm"


def names(flags: str, machine: str = "x86_64") -> list[str]:
    return [p.name for p in candidates(cpu_kind(set(flags.split()), machine), forced="")]


def test_avx512_without_native_bf16_computes_in_float32():
    """oneDNN "supports" bf16 on any AVX-512 CPU by emulating it; only avx512_bf16 or amx_bf16
    make bf16 native. Without them every path computes in float32."""
    cpu = cpu_kind(set(AVX512_NO_BF16.split()), "x86_64")
    assert cpu.avx512 and cpu.vnni and not cpu.native_bf16
    assert names(AVX512_NO_BF16) == ["cpu-int8", "cpu-fp32-avx512", "cpu-int8-avx2",
                                     "cpu-fp32-avx2", "cpu-fp32-ref", "cpu-fp32-dense"]
    assert all(p.compute == torch.float32 for p in candidates(cpu, forced=""))
    assert cpu.describe() == "x86_64 AVX2 AVX-512 VNNI (no native bf16)"


def test_each_cpu_kind_gets_its_paths_best_first():
    # With AVX-512 VNNI the integer products first (docs/cpu.md: faster in real use), then
    # specchat's own float32 forward (1.6x the decode of transformers' bf16 forward on a CPU
    # with native bf16), then the bf16 path.
    assert names(AVX512_BF16)[:3] == ["cpu-int8", "cpu-fp32-avx512", "cpu-bf16-native"]
    assert names(AMX)[:3] == ["cpu-int8", "cpu-fp32-avx512", "cpu-bf16-native"]
    assert cpu_kind(set(AMX.split()), "x86_64").describe() == \
        "x86_64 AVX2 AVX-512 VNNI AMX-INT8 native bf16"
    no_vnni = AVX512_NO_BF16.replace(" avx512_vnni", "")  # Skylake-SP: AVX-512 without VNNI
    assert names(no_vnni)[0] == "cpu-fp32-avx512"
    # Without AVX-512 the integer products on 256 bits first (AVX-VNNI's where the CPU has it:
    # Alder Lake's and later client cores; else AVX2's), then the float32 forward
    assert names(AVX2_ONLY) == ["cpu-int8-avx2", "cpu-fp32-avx2", "cpu-fp32-ref",
                                "cpu-fp32-dense"]
    assert names(AVX_VNNI) == names(AVX2_ONLY)
    assert cpu_kind(set(AVX_VNNI.split()), "x86_64").describe() == \
        "x86_64 AVX2 VNNI (no AVX-512, no native bf16)"
    assert names(X86) == ["cpu-fp32-ref", "cpu-fp32-dense"]  # no AVX2: the plain C kernels
    assert names(ARM, "aarch64") == ["cpu-fp32-ref", "cpu-fp32-dense"]  # its bf16 flag is no x86's
    assert cpu_kind(set(AVX2_ONLY.split()), "x86_64").describe() == \
        "x86_64 AVX2 (no AVX-512, no native bf16)"
    assert "plain C" in cpu_kind(set(ARM.split()), "aarch64").describe()


def test_a_forced_path_must_exist_and_run_on_this_cpu(monkeypatch):
    avx2 = cpu_kind(set(AVX2_ONLY.split()), "x86_64")
    assert [p.name for p in candidates(avx2, forced="cpu-fp32-dense")] == ["cpu-fp32-dense"]
    with pytest.raises(PathError, match="cpu-fp32-avx512 needs AVX-512.*no AVX-512"):
        candidates(avx2, forced="cpu-fp32-avx512")
    with pytest.raises(PathError, match="native bf16"):
        candidates(avx2, forced="cpu-bf16-native")
    monkeypatch.setenv(runtime.ENV, "cpu-fast")
    with pytest.raises(PathError, match="cpu-int8 needs AVX-512 VNNI"):
        candidates(avx2, forced="cpu-int8")
    with pytest.raises(PathError, match="no such path; the paths are cpu-int8, cpu-fp32-avx512, "):
        candidates(avx2)


def test_this_cpu_is_read_from_its_flags():
    cpu = cpu_kind()
    if cpu.x86:
        assert "sse2" in cpu.flags  # every x86-64 CPU has it: the flags were read
    assert candidates(cpu, forced="")[-1].name == "cpu-fp32-dense"  # runs anywhere


def _tiny_checkpoint(path) -> str:
    """A bf16 Gemma 3 checkpoint whose layers the NF4 kernels take (widths of 64)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=259, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=64, sliding_window=16,
                           layer_types=["sliding_attention", "full_attention"],
                           eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg)
    for m in model.modules():
        if type(m).__name__ == "Gemma3RMSNorm":
            torch.nn.init.normal_(m.weight, std=0.5)  # a fresh model's norm weights are zeros
    model.to(torch.bfloat16).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def _runnable() -> list[str]:
    """Every path this machine can run: those its CPU runs whose kernels build here."""
    from specchat import kernels
    return [p.name for p in candidates(forced="")
            if p.kernels is None or kernels.load(p.kernels) is not None]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("bitsandbytes")
    return _tiny_checkpoint(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.mark.parametrize("name", [p.name for p in PATHS])
def test_every_path_this_machine_runs_loads_and_proves_itself_row_exact(checkpoint, name,
                                                                        monkeypatch):
    """Forced, each path loads an NF4 model, says which path it took, and proves a verify's
    logits equal one-token steps' bit for bit; greedy speculation is then plain greedy."""
    from specchat.core.engine import Engine
    from specchat.core.events import TokenEvent
    from specchat.core.request import GenerateConfig
    from specchat.drafters.ngram import NgramDrafter
    from specchat.models.load import load_model

    if name not in _runnable():
        pytest.skip(f"{name} cannot run on this machine ({cpu_kind().describe()})")
    monkeypatch.setenv(runtime.ENV, name)
    loaded = load_model(checkpoint, "nf4", "cpu")
    rt = loaded.runtime
    assert (rt.path, rt.forced) == (name, True)
    assert name in loaded.label and rt.cpu == cpu_kind().describe()
    if name == "cpu-fp32-dense" and not rt.row_exact:
        # torch's and oneDNN's own products and sdpa: row-exact on some CPUs, not on others.
        # Here it is not, and the model says so rather than change greedy text silently.
        assert not loaded.row_exact and "may differ from plain decoding" in rt.lossless_note
        return
    assert rt.row_exact, rt.proof  # specchat's kernels are row-exact by construction
    engine = Engine(loaded, {"ngram": NgramDrafter()})
    prompt = list(b"abcabcabcabd abcabcabcabd abcabc")
    cfg = dict(max_new_tokens=24, adaptive=False, draft_len=4)
    plain = [e.id for e in engine.stream(prompt, GenerateConfig(speculation=False, **cfg))
             if isinstance(e, TokenEvent)]
    spec = [e.id for e in engine.stream(prompt, GenerateConfig(drafter="ngram", **cfg))
            if isinstance(e, TokenEvent)]
    assert spec == plain and len(plain) == 24


def test_a_path_that_fails_the_proof_gives_way_or_is_labelled(checkpoint, monkeypatch):
    """Unforced, a path whose verifies are not row-exact is skipped for the next one; forced,
    it is kept, and says plainly that speculation may change greedy text there."""
    from specchat.models.load import load_model

    paths = _runnable()
    if len(paths) < 2:
        pytest.skip("one path only on this machine")
    proven = runtime.prove_row_exact

    def fails_first(runner, vocab):
        if not is_second[0]:
            is_second[0] = True
            return False, "a verify of 6 rows gave other logits than one-token steps at 2 of 6"
        return proven(runner, vocab)

    is_second = [False]
    monkeypatch.setattr(runtime, "prove_row_exact", fails_first)
    monkeypatch.delenv(runtime.ENV, raising=False)
    loaded = load_model(checkpoint, "nf4", "cpu")
    assert loaded.runtime.path == paths[1] and loaded.runtime.row_exact
    assert loaded.runtime.skipped[0].startswith(f"{paths[0]}: a verify of 6 rows")
    assert loaded.row_exact

    is_second = [False]
    monkeypatch.setattr(runtime, "prove_row_exact", fails_first)
    monkeypatch.setenv(runtime.ENV, paths[0])
    forced = load_model(checkpoint, "nf4", "cpu")
    assert forced.runtime.path == paths[0] and not forced.row_exact
    assert "may differ from plain decoding" in forced.runtime.lossless_note


def test_a_path_this_cpu_cannot_run_is_refused_with_the_reason(checkpoint, monkeypatch):
    from specchat.models.load import ModelLoadError, load_model

    missing = [p.name for p in PATHS if p.missing(cpu_kind())]
    if not missing:
        pytest.skip("this CPU runs every path")
    monkeypatch.setenv(runtime.ENV, missing[0])
    with pytest.raises(ModelLoadError, match=f"{missing[0]} needs"):
        load_model(checkpoint, "nf4", "cpu")


def test_a_bf16_checkpoint_loaded_for_float32_computes_what_a_float32_load_computes(
        checkpoint, monkeypatch):
    """On the float32 paths a bf16 checkpoint loads as saved and is widened afterwards (no
    float32 copy of the whole file while it loads): the logits are a float32 load's, bit for
    bit, and Gemma's embedding scale is the float32 one."""
    from specchat.models import load

    monkeypatch.setenv(runtime.ENV, "cpu-fp32-dense" if "cpu-fp32-avx2" not in _runnable()
                       else "cpu-fp32-avx2")
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 7, 7, 12]])
    logits = []
    for as_saved in (True, False):
        if not as_saved:
            monkeypatch.setattr(load, "_saved_dtype", lambda path: None)
        model = load.load_model(checkpoint, "nf4", "cpu").model
        embed = model.get_input_embeddings()
        assert embed.embed_scale.dtype == torch.float32
        assert embed.embed_scale == torch.tensor(embed.scalar_embed_scale)  # not bf16's rounding
        with torch.inference_mode():
            logits.append(model(ids).logits)
    assert logits[0].dtype == torch.float32 and torch.equal(logits[0], logits[1])


def test_the_cpu_flags_have_one_reader():
    """The paths' CPU kind and the kernels' builds read the same flags (`kernels.cpu_flags`,
    /proc/cpuinfo's `flags` or `Features` line); the builds take x86's only."""
    import platform

    from specchat import kernels
    assert cpu_kind().flags == kernels.cpu_flags()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert kernels._cpu_flags() == (kernels.cpu_flags() if x86 else frozenset())
    if x86 and kernels.cpu_flags():
        assert "sse2" in kernels.cpu_flags() and "processor" not in kernels.cpu_flags()
