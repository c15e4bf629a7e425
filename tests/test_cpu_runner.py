"""specchat's own CPU forward (`runners.cpu.runner`, csrc/decoder.c): it computes what
transformers' forward computes, every row alone (chains, trees, pages), the same bits on the
SIMD kernels and their plain-C references, with a cache that grows and keeps a tree's path.
Forced on every kernels path this machine runs."""

import pytest
import torch
from tiny import i8_kernels

from specchat import kernels, runners
from specchat.core.engine import Engine
from specchat.core.events import TokenEvent
from specchat.core.request import GenerateConfig
from specchat.drafters.ngram import NgramDrafter
from specchat.models import runtime
from specchat.models.load import load_model
from specchat.models.synthetic import byte_tokenizer, save, tiny_gemma3, tiny_llama
from specchat.runners.cpu import runner as cpu_runner
from specchat.runners.hf.runner import HFRunner

pytestmark = pytest.mark.usefixtures("one_thread")

KERNEL_PATHS = [p.name for p in runtime.candidates(forced="")
                if p.kernels and not p.fused_nf4 and kernels.load(p.kernels) is not None]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Gemma 3 whose every layer specchat's NF4 kernel takes: widths of 64, a window of 16 (so
    prompts pass it), random norm weights (a fresh model's are zeros)."""
    pytest.importorskip("bitsandbytes")
    model = tiny_gemma3(0, hidden=128, head_dim=64)
    for m in model.modules():
        if type(m).__name__ == "Gemma3RMSNorm":
            torch.nn.init.normal_(m.weight, std=0.5)
    return save(model.to(torch.bfloat16), byte_tokenizer(), tmp_path_factory.mktemp("gemma3"))


def load(checkpoint, path, monkeypatch, runner=""):
    monkeypatch.setenv(runtime.ENV, path)
    monkeypatch.setenv(runners.CPU_RUNNER_ENV, runner)
    return load_model(str(checkpoint), "nf4", "cpu", progress=lambda *a: None)


IDS = [(7 + 37 * i) % 250 + 3 for i in range(300)]  # past the window and the cache's first slots


def assert_computes(got: torch.Tensor, want: torch.Tensor, path: str) -> None:
    """transformers' values on a float path (up to float32 rounding); on `cpu-int8` within
    its int8 roundings (activations per block of 32, NF4's table to 127 steps)."""
    if runtime.BY_NAME[path].int8:
        assert (got - want).norm() <= 0.03 * want.norm(), (got - want).norm() / want.norm()
        assert not torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def logits_in_pages(runner, ids, page=64):
    cache = runner.new_cache()
    return torch.cat([runner.forward(cache, ids[s:s + page], s, len(ids[s:s + page]))
                      for s in range(0, len(ids), page)]), cache


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_the_decoder_forward_computes_what_transformers_computes(checkpoint, path, monkeypatch):
    ours = load(checkpoint, path, monkeypatch)
    assert isinstance(ours.runner, cpu_runner.CpuRunner)
    assert "decoder forward" in ours.label and ours.runtime.row_exact, ours.runtime.proof
    # an integer path names its kernel (the one this CPU runs for the path's build)
    if runtime.BY_NAME[path].int8:
        kernel = cpu_runner.I8_KERNEL_NAMES[kernels.i8_kernel(runtime.BY_NAME[path].kernels
                                                              == "avx512")]
        assert f"decoder forward (integer products: {kernel})" in ours.label, ours.label
    theirs = load(checkpoint, path, monkeypatch, runner="transformers")
    assert isinstance(theirs.runner, HFRunner) and "decoder forward" not in theirs.label
    got, cache = logits_in_pages(ours.runner, IDS)
    want, _ = logits_in_pages(theirs.runner, IDS)
    assert cache.slots >= len(IDS) > cpu_runner.SLOTS  # the cache grew, keeping what it held
    assert_computes(got, want, path)
    # the features the EAGLE head drafts from: the final norm's output of the last forward
    theirs.runner.watch_features()
    logits_in_pages(theirs.runner, IDS)
    assert_computes(ours.runner.features(len(IDS) - 256), theirs.runner.features(len(IDS) - 256),
                    path)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_a_token_gets_the_same_logits_fed_alone_in_a_chain_or_in_a_page(checkpoint, path,
                                                                        monkeypatch):
    runner = load(checkpoint, path, monkeypatch).runner
    pages, _ = logits_in_pages(runner, IDS)
    for width in (1, 5, 17):
        cache = runner.new_cache()
        runner.forward(cache, IDS[:200], 0, 1)
        rows = torch.cat([runner.forward(cache, IDS[s:min(s + width, 260)], s,
                                         len(IDS[s:min(s + width, 260)]))
                          for s in range(200, 260, width)])
        assert torch.equal(rows, pages[200:260]), width


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_a_draft_tree_gets_the_logits_its_paths_get_as_chains(checkpoint, path, monkeypatch):
    """Each node of a tree verified in one forward gets the logits its root path gets fed as a
    chain, and the path `keep_fed` keeps reads on as if it had been fed alone."""
    runner = load(checkpoint, path, monkeypatch).runner
    prefix, start = IDS[:40], 40
    #        root 0 - 1 - 3 - 5
    #               \ 2 - 4
    ids, parents = [11, 21, 22, 31, 32, 41], [-1, -1, 0, 1, 2]
    cache = runner.new_cache()
    runner.forward(cache, prefix, 0, 1)
    tree = runner.forward_tree(cache, ids, parents, start)

    def path_to(node):  # fed indices, root first
        chain = [node]
        while chain[-1] > 0:
            chain.append(parents[chain[-1] - 1] + 1)
        return chain[::-1]

    for node in range(len(ids)):
        chain = [ids[i] for i in path_to(node)]
        fresh = runner.new_cache()
        runner.forward(fresh, prefix, 0, 1)
        assert torch.equal(runner.forward(fresh, chain, start, len(chain))[-1], tree[node])
    keep = path_to(5)  # root, 21, 31, 41
    runner.keep_fed(cache, len(ids), start, keep)
    after = runner.forward(cache, [7], start + len(keep), 1)
    fresh = runner.new_cache()
    runner.forward(fresh, prefix + [ids[i] for i in keep], 0, 1)
    assert torch.equal(runner.forward(fresh, [7], start + len(keep), 1), after)


def test_the_reference_build_computes_the_simd_builds_bits(checkpoint, monkeypatch):
    if "cpu-fp32-avx2" not in KERNEL_PATHS or "cpu-fp32-ref" not in KERNEL_PATHS:
        pytest.skip(f"needs the AVX2 and the reference paths ({runtime.cpu_kind().describe()})")
    simd, _ = logits_in_pages(load(checkpoint, "cpu-fp32-avx2", monkeypatch).runner, IDS[:130])
    ref, _ = logits_in_pages(load(checkpoint, "cpu-fp32-ref", monkeypatch).runner, IDS[:130])
    assert torch.equal(simd, ref)


def test_the_integer_forward_is_the_same_bits_on_every_kernel(checkpoint, monkeypatch):
    """`cpu-int8`'s decoder stack on each integer kernel this CPU runs (VNNI, AVX2, the SIMD
    build's reference, the portable build's): the same logits, bit for bit, in pages and in
    one-token steps; forced whatever path this CPU would take."""
    base = next((p for p in KERNEL_PATHS if not runtime.BY_NAME[p].int8), None)
    if base is None:
        pytest.skip("no kernels path runs here")
    model = load(checkpoint, base, monkeypatch).model
    found = i8_kernels()
    outs = {name: logits_in_pages(cpu_runner.CpuRunner(model, lib, int8=True), IDS[:130])[0]
            for name, lib in found.items()}
    first = outs.pop("portable-ref")
    assert outs or not kernels.runs_here("avx2")
    for name, got in outs.items():
        assert torch.equal(got, first), name
    runner = cpu_runner.CpuRunner(model, found["portable-ref"], int8=True)
    cache = runner.new_cache()
    steps = torch.cat([runner.forward(cache, IDS[i:i + 1], i, 1) for i in range(40)])
    assert torch.equal(steps, first[:40])


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_greedy_and_seeded_speculation_on_the_decoder_forward_replay_plain(checkpoint, path,
                                                                           monkeypatch):
    engine = Engine(load(checkpoint, path, monkeypatch), {"ngram": NgramDrafter()})
    prompt = list(b"abcabcabcabd abcabcabcabd abcabc")
    for temperature in (0.0, 0.8):
        cfg = dict(max_new_tokens=40, adaptive=False, draft_len=4, temperature=temperature,
                   seed=3)
        plain = [e.id for e in engine.stream(prompt, GenerateConfig(speculation=False, **cfg))
                 if isinstance(e, TokenEvent)]
        spec = [e.id for e in engine.stream(prompt, GenerateConfig(drafter="ngram", **cfg))
                if isinstance(e, TokenEvent)]
        assert spec == plain and len(plain) == 40


def test_models_it_cannot_run_keep_transformers_forward_and_say_why(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("phi3", vocab_size=259, hidden_size=128,
                                  intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.5)
    torch.manual_seed(0)
    phi3 = save(AutoModelForCausalLM.from_config(config), byte_tokenizer(), tmp_path / "phi3")
    path = next(iter(KERNEL_PATHS), None)
    if path is None:
        pytest.skip("no kernels path runs here")
    loaded = load(phi3, path, monkeypatch)
    assert isinstance(loaded.runner, HFRunner)
    assert "partial RoPE (factor 0.5)" in cpu_runner.unsupported(loaded.model)
    with pytest.raises(ValueError, match="cannot run this model"):
        cpu_runner.CpuRunner(loaded.model, kernels.load(runtime.BY_NAME[path].kernels))
    small = save(tiny_gemma3(0), byte_tokenizer(), tmp_path / "small")  # widths of 16 and 32
    loaded = load(small, path, monkeypatch)
    assert isinstance(loaded.runner, HFRunner)
    assert "not on specchat's NF4 kernel" in cpu_runner.unsupported(loaded.model)


def test_the_profile_splits_the_c_forward_into_its_parts(checkpoint, monkeypatch):
    """`bench --profile` on the decoder forward: its products, attention, norms and activation
    come from the C call's own clock, and every row adds up to the forward."""
    from specchat.bench.config import BenchSettings
    from specchat.bench.profile import FORWARD_ROWS, profile_plain

    path = next(iter(KERNEL_PATHS), None)
    if path is None:
        pytest.skip("no kernels path runs here")
    engine = Engine(load(checkpoint, path, monkeypatch), {})
    settings = BenchSettings(modes=("plain",), max_new_tokens=12, stop_strings=False)
    found = profile_plain(engine, [(IDS[:70], ())], settings)
    rows = found["ms_per_token"]
    assert found["tokens"] == 10
    for row in ("NF4 layers", "attention", "norms", "MLP activation", "LM head"):
        assert rows[row] > 0, row
    assert sum(rows[r] for r in FORWARD_ROWS) == pytest.approx(found["forward_ms"], rel=1e-6)
    assert engine.runner.clock is None and "_run" not in vars(engine.runner)


def test_the_profile_times_forwards_of_several_rows_by_part(checkpoint, monkeypatch):
    """`bench --profile`'s cost of a forward by rows (what a verify costs): every row count
    timed after the same prompt, split by the C forward's clock, with a table in the report;
    the cache is left as the prompt alone each time, so the runner goes on decoding right."""
    from specchat.bench.profile import profile_rows, rows_lines

    path = next(iter(KERNEL_PATHS), None)
    if path is None:
        pytest.skip("no kernels path runs here")
    engine = Engine(load(checkpoint, path, monkeypatch), {})
    found = profile_rows(engine, IDS[:40], rows=(1, 3), repeats=2)
    assert found["context"] == 40 and set(found["rows"]) == {1, 3}
    for n, parts in found["rows"].items():
        assert parts["ms"] > 0 and parts["NF4 layers"] > 0 and parts["attention"] > 0, n
        assert parts["NF4 layers"] + parts["attention"] < parts["ms"]
    lines = rows_lines(found)
    assert "verify of n - 1 drafts" in lines[0] and lines[3].split()[0] == "3"
    assert engine.runner.clock is None


def test_the_bench_times_the_decoder_forwards_at_the_runner(checkpoint, monkeypatch):
    """The bench's prompt and decode times come from the runner's forwards, which transformers'
    module hooks never see on this forward."""
    from specchat.bench.config import BenchSettings
    from specchat.bench.run import _ModeRunner

    path = next(iter(KERNEL_PATHS), None)
    if path is None:
        pytest.skip("no kernels path runs here")
    engine = Engine(load(checkpoint, path, monkeypatch), {})
    settings = BenchSettings(modes=("plain",), max_new_tokens=8, stop_strings=False)
    run = _ModeRunner(engine, settings, None, {})
    try:
        found = run("plain", IDS[:70], (), fresh=True)
    finally:
        run.detach()
    assert found["prefill_tokens"] == 70 and 0 < found["prefill_s"] < found["forward_s"]
    assert not {"forward", "forward_tree"} & set(vars(engine.runner))


def test_a_model_wider_than_its_query_heads_computes_what_transformers_computes(tmp_path,
                                                                              monkeypatch):
    """Gemma 3 1B's shape in small: the hidden size (192) above heads x head dim (2 x 64), so
    the products' outputs are wider than the queries."""
    path = next(iter(KERNEL_PATHS), None)
    if path is None:
        pytest.skip("no kernels path runs here")
    model = tiny_gemma3(1, hidden=192, head_dim=64)
    checkpoint = save(model.to(torch.bfloat16), byte_tokenizer(), tmp_path / "wide")
    ours = load(checkpoint, path, monkeypatch)
    assert isinstance(ours.runner, cpu_runner.CpuRunner) and ours.runtime.row_exact
    theirs = load(checkpoint, path, monkeypatch, runner="transformers")
    got, _ = logits_in_pages(ours.runner, IDS[:100])
    want, _ = logits_in_pages(theirs.runner, IDS[:100])
    assert_computes(got, want, path)


def _q8_head(model, lib) -> None:
    """Give a tiny model's LM head a Q8_0 copy of its weight through `runners.cpu.q8_head.Q8Head`, as
    the embedded target's comes from its GGUF (int8 values, one fp16 scale per 32)."""
    from specchat.runners.cpu.q8_head import Q8Head

    head = model.get_output_embeddings()
    w = head.weight.detach().float().view(head.weight.shape[0], -1, 32)
    d = (w.abs().amax(-1) / 127).clamp_min(1e-8).to(torch.float16)
    q = (w / d.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
    head.forward = Q8Head(head, q.view(head.weight.shape).contiguous(), d.contiguous(), lib)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_ids_never_sampled_are_not_computed_and_the_others_keep_their_bits(checkpoint, path,
                                                                          monkeypatch):
    """`skip_logits_from`: with a Q8_0 head, steps of one token and verifies of several give
    the other ids the same logits as before, and those ids -inf; the profile still times the
    head; greedy speculation is still plain greedy."""
    from specchat.bench.config import BenchSettings
    from specchat.bench.profile import profile_plain

    loaded = load(checkpoint, path, monkeypatch)
    runner = loaded.runner
    _q8_head(loaded.model, runner.lib)
    before, _ = logits_in_pages(runner, IDS[:40], page=5)
    assert runner.skip_logits_from(200)
    for page in (1, 5):
        after, _ = logits_in_pages(runner, IDS[:40], page=page)
        assert torch.equal(after[:, :200], before[:, :200]), page
        assert bool((after[:, 200:] == -torch.inf).all()), page
    plain = Engine(loaded, {"ngram": NgramDrafter()})
    cfg = dict(max_new_tokens=30, temperature=0.0)
    replies = [[e.id for e in plain.stream(IDS[:40], GenerateConfig(
        speculation=spec, drafter="ngram", **cfg)) if isinstance(e, TokenEvent)]
        for spec in (False, True)]
    assert replies[0] == replies[1] and max(replies[0]) < 200
    found = profile_plain(plain, [(IDS[:70], ())], BenchSettings(
        modes=("plain",), max_new_tokens=12, stop_strings=False))
    assert found["ms_per_token"]["LM head"] > 0


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_the_embedding_lookup_in_c_gives_the_modules_logits(checkpoint, path, monkeypatch):
    """The runner looks a forward's ids up in one C call (`embed_rows`), checked against the
    model's embedding module at load: the logits are the bits the module's lookup gives, and an
    id past the table is refused as the module refuses it."""
    runner = load(checkpoint, path, monkeypatch).runner
    assert runner._embedding is not None
    got, _ = logits_in_pages(runner, IDS)
    runner._embedding = None  # the module's lookup
    want, _ = logits_in_pages(runner, IDS)
    assert torch.equal(got, want)
    runner._embedding = runner._c_embedding()
    for bad in ([runner.embed.weight.shape[0]], [-1]):
        with pytest.raises(IndexError):
            runner.forward(runner.new_cache(), bad, 0, 1)


def test_an_embedding_the_c_lookup_does_not_match_keeps_the_modules(checkpoint, monkeypatch):
    """An embedding module that computes something else than Gemma 3's scaled lookup (here one
    more multiplication) is not replaced: the runner keeps calling it."""
    runner = load(checkpoint, KERNEL_PATHS[0], monkeypatch).runner
    embed, plain = runner.embed, type(runner.embed).forward
    monkeypatch.setattr(embed, "forward", lambda ids: plain(embed, ids) * 2)
    assert runner._c_embedding() is None
    runner._embedding = None
    doubled, _ = logits_in_pages(runner, IDS[:40])
    monkeypatch.setattr(embed, "forward", lambda ids: plain(embed, ids))
    same, _ = logits_in_pages(runner, IDS[:40])
    assert not torch.equal(doubled, same)


def test_the_quality_comparison_reads_two_paths_on_the_same_reply(checkpoint, monkeypatch):
    """`bench.quality`: a greedy reply, then the prompt and reply teacher-forced through two
    runners. A path against itself agrees everywhere with no divergence; the integer path
    against the float one gives a divergence at each position, never below zero."""
    from specchat.bench import quality

    base = next((p for p in KERNEL_PATHS if not runtime.BY_NAME[p].int8), None)
    if base is None:
        pytest.skip("no kernels path runs here")
    model = load(checkpoint, base, monkeypatch).model
    lib = kernels.load(runtime.BY_NAME[base].kernels)
    reference = cpu_runner.CpuRunner(model, lib)
    prompt = IDS[:24]
    reply = quality.greedy(reference, prompt, 8, set(), (), lambda ids: "")
    assert len(reply) == 8
    cut = quality.greedy(reference, prompt, 8, set(), ("x",),
                         lambda ids: "x" if len(ids) == 3 else "")
    assert cut == reply[:3]  # the token that completes a stop string ends the reply
    same, total, each = quality.compare(reference, reference, prompt, reply)
    assert (same, total, len(each)) == (8, 0.0, 8)
    integer = cpu_runner.CpuRunner(model, lib, int8=True)
    same, total, each = quality.compare(reference, integer, prompt, reply)
    assert 0 <= same <= 8 and len(each) == 8 and min(each) > -1e-6 and total > 0


def test_the_integer_paths_packed_layers_hold_the_codes_once(checkpoint, monkeypatch):
    """On `cpu-int8` the modules let go of bitsandbytes' codes once the packed copy serves the
    steps; transformers' forward on the same model reads them back, the same bits, and
    computes what a model that never let go computes."""
    from specchat.runners.hf.cpu import NF4KernelForward
    from specchat.runners.nf4 import codes_and_state

    path = next((p for p in KERNEL_PATHS if runtime.BY_NAME[p].int8), None)
    if path is None:
        pytest.skip("no integer path runs here")
    ours = load(checkpoint, path, monkeypatch)
    assert isinstance(ours.runner, cpu_runner.CpuRunner)
    layer = ours.model.get_decoder().layers[0].mlp.down_proj
    forward = vars(layer)["forward"]
    assert isinstance(forward, NF4KernelForward) and layer.weight.data.numel() == 0
    theirs = load(checkpoint, path, monkeypatch, runner="transformers")
    want = vars(theirs.model.get_decoder().layers[0].mlp.down_proj)["forward"].codes
    assert layer.weight.data.numel() == 0  # (the other model's load did not touch it)
    assert torch.equal(codes_and_state(layer)[0], want)  # read back, in bitsandbytes' order
    assert layer.weight.data.data_ptr() == forward.codes.data_ptr()
    forward.release_codes(forward._restore)
    runners.use_transformers_forward(ours)
    ids = IDS[:40]
    assert torch.equal(logits_in_pages(ours.runner, ids)[0],
                       logits_in_pages(theirs.runner, ids)[0])
