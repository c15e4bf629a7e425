"""Loading: weights that stay views of the memory-mapped checkpoint are moved into owned memory."""

import sys
import time

import pytest
import torch
from tiny import tiny_gemma3
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

from specchat.runners.memory import (
    SheddingPages,
    _copy_out_of_file_mapping,
    _file_mappings,
    drop_read_pages,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/maps")


def _mapped(model) -> list[str]:
    spans = _file_mappings()
    return [name for name, p in model.named_parameters()
            if any(start <= p.data_ptr() < end for start, end in spans)]


def test_unquantized_weights_leave_the_file_mapping_unchanged(tmp_path):
    tiny_gemma3(0, vocab=4096).to(torch.bfloat16).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert _mapped(model), "safetensors loading no longer memory-maps: the copy is moot"
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    _copy_out_of_file_mapping(model, chunk_bytes=4096)  # many chunks per tensor

    assert _mapped(model) == []
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def _resident_kb(start: int, end: int) -> int:
    """Resident kB of the mappings that overlap [start, end) (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < end and b > start
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_a_kept_table_stays_mapped_and_its_pages_come_back_a_lookup_at_a_time(tmp_path):
    """The embedded target's table, read a row at a time, stays in the checkpoint's mapping
    (`keep`) while every other weight is copied out; the pages loading read are dropped
    (`drop_read_pages`) and lookups read theirs again: the same values all along."""
    tiny_gemma3(0, vocab=32768).to(torch.bfloat16).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    table = model.get_input_embeddings().weight
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    _copy_out_of_file_mapping(model, keep=(table,))

    assert _mapped(model) == ["model.embed_tokens.weight"]  # (tied: the LM head's too)
    start = table.data_ptr()
    end = start + table.numel() * table.element_size()
    assert torch.equal(table, before["model.embed_tokens.weight"])  # read whole: resident
    whole = _resident_kb(start, end)
    drop_read_pages(model)
    assert _resident_kb(start, end) < whole / 4
    ids = torch.tensor([[5, 17, 30000]])
    with torch.inference_mode():  # (how much a lookup maps back is the kernel's: a page or
        rows = model.get_input_embeddings()(ids)  # the page cache's folio around it)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert torch.equal(rows[0], before["model.embed_tokens.weight"][ids[0]] *
                       model.get_input_embeddings().embed_scale.to(torch.bfloat16))


def test_a_loading_checkpoints_read_pages_are_reclaimed_and_its_values_kept(tmp_path):
    """`SheddingPages` while a checkpoint loads: the pages read of the files under its folder
    leave the process's resident memory, and every value reads back the same, a page written
    since it was mapped (copy-on-write) included."""
    tiny_gemma3(0, vocab=32768).to(torch.bfloat16).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    table = model.get_input_embeddings().weight
    start = table.data_ptr()
    end = start + table.numel() * table.element_size()
    assert any(s <= start < e for s, e in _file_mappings(str(tmp_path)))
    expected = table.detach().clone()
    with torch.no_grad():
        table[7] = 3.0  # a private page of its own now
    expected[7] = 3.0
    assert torch.equal(table, expected)  # every page read: resident
    whole = _resident_kb(start, end)
    shedding = SheddingPages(tmp_path)
    if not shedding.shed():
        pytest.skip("this kernel reclaims no pages on request (MADV_PAGEOUT, Linux 5.4)")
    assert _resident_kb(start, end) < whole / 4
    assert torch.equal(table, expected)
    with SheddingPages(tmp_path, interval=0.01):  # the thread: started, stopped
        time.sleep(0.05)
    assert torch.equal(table, expected)


def test_wide_inputs_take_the_dense_path_and_agree_with_the_fused_kernel(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    from tiny import byte_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from specchat.models.load import load_model
    from specchat.runners.hf.cpu import WIDE_ROWS, _CpuNF4Forward

    torch.manual_seed(0)  # NF4 blocks of 64 and bitsandbytes' CPU packing want multiples of 64
    cfg = LlamaConfig(vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    model = load_model(str(tmp_path), "nf4", "cpu").model
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers
    routed = [m for m in layers if isinstance(vars(m).get("forward"), _CpuNF4Forward)]
    if not routed:
        pytest.skip("no AVX512-BF16: bitsandbytes has no fused CPU kernel to route around")

    layer = routed[0]
    fused = bnb.nn.Linear4bit.forward  # the class's own forward: bitsandbytes' kernel
    with torch.inference_mode():
        one = torch.randn(1, 1, layer.in_features, dtype=torch.bfloat16)
        assert torch.equal(layer(one), fused(layer, one))  # narrow: the fused kernel...
        assert layer.forward.kernel is not None  # ...called directly once checked identical
        three = torch.randn(1, 3, layer.in_features, dtype=torch.bfloat16)
        assert torch.equal(layer(three), fused(layer, three))
        wide = torch.randn(1, WIDE_ROWS, layer.in_features, dtype=torch.bfloat16)
        dense_calls = []
        real_dense = layer.forward._dense
        layer.forward._dense = lambda x: dense_calls.append(x.shape) or real_dense(x)
        dense, reference = layer(wide).float(), fused(layer, wide).float()
        del layer.forward._dense
    assert dense_calls == [wide.shape]  # the dense path ran...
    assert (dense - reference).norm() < 0.01 * reference.norm()  # ...computing the same product

    ids = torch.randint(3, 259, (1, WIDE_ROWS + 8))
    with torch.inference_mode():
        logits = model(ids).logits.float()
        saved = {m: vars(m).pop("forward") for m in routed}  # back to the fused kernel only
        reference = model(ids).logits.float()
        for m, forward in saved.items():
            m.forward = forward
    assert (logits - reference).norm() < 0.02 * reference.norm()


def test_narrow_logits_through_weight_times_x_are_bit_identical():
    from transformers import Gemma3TextConfig

    from specchat.runners.hf.cpu import _NarrowHead, fast_lm_head

    # The embedded target's width, 640: at widths like 32, the two can round differently
    # (then the head keeps linear, which the checks are there to catch).
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=4096, hidden_size=640, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, layer_types=["full_attention"])
    model = Gemma3ForCausalLM(cfg).to(torch.bfloat16).eval()
    n = _NarrowHead.CHECKS + 4  # past the checks: weight @ x.T alone for the last calls
    ids = torch.randint(0, 4096, (1, n))
    with torch.inference_mode():
        reference = [model(ids[:, :i + 1], logits_to_keep=1).logits[0, -1] for i in range(n)]
        assert fast_lm_head(model)
        fast = [model(ids[:, :i + 1], logits_to_keep=1).logits[0, -1] for i in range(n)]
        for rows in (1, 2, 5, n):  # one row or several: each row's logits as linear's
            hidden = model.model(ids[:, :rows]).last_hidden_state
            assert torch.equal(model(ids[:, :rows]).logits,
                               torch.nn.functional.linear(hidden, model.lm_head.weight))
    for a, b in zip(fast, reference):
        assert torch.equal(a, b)
    assert model.lm_head.forward.checked
    if not model.lm_head.forward.fast:
        pytest.skip("weight @ x.T is not bit-identical to linear on this CPU: the head keeps "
                    "linear")


def _tiny_nf4(tmp_path, compute):
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant,
                                                 dtype=compute, device_map={"": "cpu"}).eval()
    from tiny import bnb_cpu_repack
    bnb_cpu_repack(model, on=False)  # as on a CPU without AVX512-BF16, whatever this one has
    return model


def test_nf4_layers_dequantized_once_compute_what_bitsandbytes_computes(tmp_path):
    """CPUs without the fused kernel: each NF4 layer keeps one dense copy of its (NF4) weight
    instead of dequantizing it at every call; the model's outputs stay bitsandbytes' own."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import dequantize_4bit

    from specchat.runners.hf.cpu import _DenseForward, dense_cpu_nf4
    model = _tiny_nf4(tmp_path, torch.float32)
    ids = torch.randint(3, 259, (1, 12))
    with torch.inference_mode():
        reference = model(ids).logits
        assert dense_cpu_nf4(model, share=1e-12) == 0  # copies larger than the RAM share
        assert dense_cpu_nf4(model) == 14  # 7 per layer
        layer = model.model.layers[0].mlp.down_proj
        assert isinstance(layer.forward, _DenseForward)
        dense = model(ids).logits
        # Decoding's and verifies' rows: each row the same bits alone or among up to 11.
        x = torch.randn(11, layer.in_features)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(11)])
        same = [torch.equal(layer(x[:n]), alone[:n]) for n in range(1, 12)]
        weight = dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        assert weight.dtype == torch.float32
    with_grad = layer(x.clone().requires_grad_())  # bitsandbytes' own path, differentiable
    assert torch.allclose(dense, reference, atol=1e-5, rtol=1e-4)
    if layer.forward.packed is not None:
        assert layer.forward.weight is None  # one dense copy, not two
        assert all(same), same
    assert torch.allclose(alone, torch.nn.functional.linear(x, weight), atol=1e-5)
    assert with_grad.requires_grad and torch.allclose(with_grad, alone, atol=1e-5)


def test_float32_logits_are_the_same_bits_alone_or_among_drafts():
    """A float32 LM head on a CPU: a row's logits do not depend on how many rows are verified
    with it (so greedy speculation is plain greedy), and equal linear's up to rounding."""
    from transformers import Gemma3TextConfig

    from specchat.runners.hf.cpu import MAX_COLUMNS, _PackedHead, fast_lm_head
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=4096, hidden_size=640, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, layer_types=["full_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    assert not fast_lm_head(model, share=1e-12)  # a packed copy larger than the RAM share
    if not fast_lm_head(model):
        pytest.skip("oneDNN's packed float32 product is missing or not row-exact here: "
                    "linear kept")
    head = model.lm_head
    assert isinstance(head.forward, _PackedHead)
    x = torch.randn(MAX_COLUMNS, 640)
    with torch.inference_mode():
        alone = [head(x[i:i + 1]) for i in range(MAX_COLUMNS)]
        for rows in range(1, MAX_COLUMNS + 1):
            together = head(x[None, :rows])[0]
            for i in range(rows):
                assert torch.equal(together[i:i + 1], alone[i]), (rows, i)
        assert torch.allclose(head(x), torch.nn.functional.linear(x, head.weight), atol=1e-4)


def test_a_packed_product_that_depends_on_its_neighbours_is_refused(monkeypatch):
    """Where a row's bits would depend on how many rows come with it, `_pack` keeps `linear`
    (checked once per weight shape), so a verify never silently computes other logits."""
    import specchat.runners.hf.cpu as models
    weight = torch.randn(256, 64)
    if models._pack(weight, {}) is None:
        pytest.skip("no row-exact packed product on this CPU to break")
    exact = models._packed_product
    monkeypatch.setattr(models, "_packed_product",
                        lambda packed, x, bias=None: exact(packed, x) + 1e-3 * len(x))
    answers: dict = {}
    assert models._pack(weight, answers) is None
    assert answers == {(256, 64): False}
    assert models._pack(torch.randn(256, 64), answers) is None  # the shape's answer is kept
    assert models._pack(weight.to(torch.bfloat16), {}) is None  # float32 only


def _kernels():
    from specchat import kernels
    lib = kernels.load()
    if lib is None:
        pytest.skip("specchat's CPU kernels cannot be built here (no gcc, or no AVX2/FMA)")
    return lib


def test_nf4_kernel_computes_what_bitsandbytes_computes_from_the_4bit_weights(tmp_path):
    """specchat's AVX2 kernel reads the NF4 codes and block scales directly: the model's logits
    are bitsandbytes' own (up to float32 rounding), each row's output is the same bits alone or
    among up to 11 rows, gradients still flow through bitsandbytes' path, and `dense_nf4` swaps
    in a dense copy and back."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import dequantize_4bit

    from specchat.runners.hf.cpu import NF4KernelForward, kernel_cpu_nf4
    lib = _kernels()
    model = _tiny_nf4(tmp_path, torch.float32)
    ids = torch.randint(3, 259, (1, 12))
    with torch.inference_mode():
        reference = model(ids).logits
        assert kernel_cpu_nf4(model, lib) == 14  # 7 per layer
        layer = model.model.layers[1].self_attn.o_proj
        assert isinstance(layer.forward, NF4KernelForward)
        logits = model(ids).logits
        x = torch.randn(11, layer.in_features)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(11)])
        together = [layer(x[:n]) for n in range(1, 12)]
        weight = dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    assert torch.allclose(logits, reference, atol=1e-5, rtol=1e-4)
    assert not torch.equal(logits, reference)  # another path really ran
    for n, out in enumerate(together, 1):
        assert torch.equal(out, alone[:n]), n
    assert torch.allclose(alone, torch.nn.functional.linear(x, weight), atol=1e-5)
    with_grad = layer(x.clone().requires_grad_())
    assert with_grad.requires_grad and torch.allclose(with_grad, alone, atol=1e-5)
    # Batched decoding (train-draft's, `dense_nf4`) reads a dense float32 copy instead: the same
    # product up to rounding, for as long as it is active.
    from specchat.runners.hf.cpu import dense_nf4
    with torch.inference_mode():
        with dense_nf4(model) as layers:
            assert layers == 14 and layer.forward.dense_weight is not None
            dense = layer(x)
            dense_logits = model(ids).logits
        assert layer.forward.dense_weight is None and torch.equal(layer(x), alone)
    assert torch.allclose(dense, alone, atol=1e-5)
    assert torch.allclose(dense_logits, logits, atol=1e-5, rtol=1e-4)


def test_nf4_kernel_refuses_a_layer_it_would_compute_wrongly(tmp_path):
    """Checked at load against bitsandbytes' dequantized weight: a layout the kernel misreads
    (here, the NF4 table reversed) keeps bitsandbytes' path."""
    pytest.importorskip("bitsandbytes")
    from specchat.runners.hf.cpu import NF4KernelForward
    lib = _kernels()
    model = _tiny_nf4(tmp_path, torch.float32)
    layer = model.model.layers[0].mlp.up_proj
    forward = NF4KernelForward(layer, lib)
    assert forward.usable({})
    forward.table = forward.table.flip(0).contiguous()
    assert not forward.usable({})


def test_nf4_kernel_is_the_dequantized_product_and_row_exact_for_1_to_16_rows():
    """`nf4_matmul` against a float64 product of bitsandbytes' dequantized weight (row counts
    that leave every tile a tail, three block sizes), and each row the same bits alone or among
    2 to 16 rows and with any thread count: its one-row, two-row and buffered paths do the same
    arithmetic in the same order."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes import functional as F

    from specchat import kernels
    lib = _kernels()
    torch.manual_seed(0)
    for out_features, in_features, blocksize in [(43, 640, 64), (20, 256, 128), (7, 96, 32)]:
        weight = torch.randn(out_features, in_features) * 0.05
        codes, state = F.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4",
                                       compress_statistics=True)
        absmax = (F.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
        table = state.code.float().contiguous()
        exact = F.dequantize_4bit(codes, state).double()
        x = torch.randn(16, in_features)

        def product(rows, codes=codes, absmax=absmax, blocksize=blocksize, table=table,
                    out_features=out_features):
            return kernels.nf4_matmul(lib, rows, codes, absmax, blocksize, table, out_features)

        alone = torch.cat([product(x[i:i + 1]) for i in range(16)])
        want = x.double() @ exact.T
        assert (alone.double() - want).abs().max() <= 1e-5 * want.abs().max()
        for n in range(2, 17):
            assert torch.equal(product(x[:n]), alone[:n]), (out_features, n)
        assert torch.equal(product(x.reshape(4, 4, -1)).reshape(16, -1), alone)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(product(x), alone)
        finally:
            torch.set_num_threads(threads)


def test_bf16_valued_float32_head_goes_through_the_bf16_kernel():
    """A float32 LM head holding bf16 values (a bf16 checkpoint loaded in float32) is computed
    from a bf16 copy: the same logits up to rounding, each row the same bits among 1 to 11.
    A head with other values keeps its float32 weights."""
    from transformers import Gemma3TextConfig

    from specchat.runners.hf.cpu import MAX_COLUMNS, _Bf16KernelLinear, fast_lm_head
    lib = _kernels()
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=4096, hidden_size=640, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, layer_types=["full_attention"])
    model = Gemma3ForCausalLM(cfg).to(torch.bfloat16).to(torch.float32).eval()
    assert fast_lm_head(model, lib)
    head = model.lm_head
    assert isinstance(head.forward, _Bf16KernelLinear)
    assert head.forward.weight.dtype == torch.bfloat16
    x = torch.randn(MAX_COLUMNS, 640)
    with torch.inference_mode():
        alone = torch.cat([head(x[i:i + 1]) for i in range(MAX_COLUMNS)])
        for rows in range(2, MAX_COLUMNS + 1):
            assert torch.equal(head(x[None, :rows])[0], alone[:rows]), rows
        assert torch.allclose(alone, torch.nn.functional.linear(x, head.weight), atol=1e-4)

    other = Gemma3ForCausalLM(cfg).eval()  # float32 values: no bf16 copy
    with torch.no_grad():
        other.lm_head.weight.add_(1e-6)
    fast_lm_head(other, lib)
    assert not isinstance(vars(other.lm_head).get("forward"), _Bf16KernelLinear)


def test_kernels_compile_into_the_cache_once_and_not_without_a_compiler(tmp_path, monkeypatch,
                                                                         capsys):
    from specchat import kernels
    _kernels()
    monkeypatch.setenv("SPECCHAT_CACHE", str(tmp_path))
    lib = kernels.load.__wrapped__()  # compiles the C file afresh
    built = list((tmp_path / "kernels").iterdir())
    assert lib is not None and [p.suffix for p in built] == [".so"]
    x, weight = torch.randn(3, 64), torch.randn(43, 64).to(torch.bfloat16)  # tails of both tiles
    assert torch.allclose(kernels.bf16_matmul(lib, x, weight), x @ weight.float().T,
                          atol=1e-5)
    threads = torch.get_num_threads()
    try:  # each output is one thread's work: the thread count changes no bits
        torch.set_num_threads(1)
        one = kernels.bf16_matmul(lib, x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, kernels.bf16_matmul(lib, x, weight))

    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert kernels.load.__wrapped__() is None
    assert "no C compiler (/nonexistent/cc)" in capsys.readouterr().err
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setenv("SPECCHAT_CACHE", str(tmp_path / "other"))
    assert kernels.load.__wrapped__() is None
    assert "could not build specchat's AVX2 kernels" in capsys.readouterr().err


def test_a_build_started_early_is_the_one_load_waits_for(tmp_path, monkeypatch):
    """`build_soon` compiles in the background (a first launch does it while the model
    converts); a `load` meanwhile waits for that compile rather than starting a second one, and
    a build already in the cache is not compiled again."""
    from specchat import kernels
    _kernels()
    monkeypatch.setenv("SPECCHAT_CACHE", str(tmp_path))
    compiles = []
    compile_ = kernels._compile
    monkeypatch.setattr(kernels, "_compile", lambda *a: compiles.append(a) or compile_(*a))
    kernels.build_soon("ref")
    kernels.build_soon("ref")  # under way: not started twice
    lib = kernels.load.__wrapped__("ref")
    assert lib is not None and len(compiles) == 1
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [lib.path.name]  # no leftovers
    kernels.build_soon("ref")
    assert kernels.load.__wrapped__("ref") is not None and len(compiles) == 1


def test_float32_linears_holding_bf16_values_go_through_the_bf16_kernel(tmp_path):
    """`--quantization none` on a CPU without native bf16 (and draft models): a bf16 checkpoint
    loaded in float32 computes every linear layer from bf16 copies, as before up to rounding,
    each row the same bits alone or among others; layers with other values keep `linear`."""
    from tiny import byte_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from specchat.models.load import load_model
    from specchat.models.runtime import cpu_kind
    from specchat.runners.hf.cpu import _Bf16KernelLinear, kernel_cpu_linears
    lib = _kernels()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, eos_token_id=2,
                      attention_bias=True)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).to(torch.float32).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.add_(1e-7)  # no longer bf16 values
    ids = torch.randint(3, 259, (1, 12))
    with torch.inference_mode():
        reference = model(ids).logits
        assert kernel_cpu_linears(model, lib) == 2 * 7 + 1 - 1  # the changed layer keeps linear
        logits = model(ids).logits
        q = model.model.layers[0].self_attn.q_proj  # with a bias
        assert isinstance(q.forward, _Bf16KernelLinear) and q.bias is not None
        x = torch.randn(11, 128)
        alone = torch.cat([q(x[i:i + 1]) for i in range(11)])
        for n in range(2, 12):
            assert torch.equal(q(x[:n]), alone[:n]), n
    assert "forward" not in vars(model.model.layers[1].mlp.down_proj)
    assert torch.allclose(logits, reference, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        assert torch.allclose(alone, torch.nn.functional.linear(x, q.weight, q.bias), atol=1e-5)

    if not cpu_kind().native_bf16:  # the loader does it on such CPUs
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
        byte_tokenizer().save_pretrained(tmp_path)
        loaded = load_model(str(tmp_path), "none", "cpu")
        assert f"float32 from bf16 copies ({lib.variant} kernel)" in loaded.label
        assert isinstance(vars(loaded.model.lm_head)["forward"], _Bf16KernelLinear)


def _q8_gguf(path, weight: torch.Tensor) -> None:
    """A GGUF file holding `weight` [rows, cols] as Q8_0 under the name token_embd.weight, and
    some metadata before it (a string array, like a vocabulary, for the reader to skip)."""
    import gguf
    import numpy as np
    from gguf import quants

    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_float32("some.scale", 0.5)
    writer.add_tensor("output_norm.weight", np.ones(weight.shape[1], np.float32))
    blocks = quants.quantize(weight.numpy().astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", blocks,
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_lm_head_from_a_gguf_q8_0_embedding_is_its_values_and_row_exact(tmp_path):
    """The GGUF's Q8_0 token embedding read by hand equals the gguf package's dequantization;
    the Q8_0 head replaces a head holding those values rounded to bf16, its logits are q * d's
    up to the int8 rounding of the activations (float32 or bf16 ones), each row the same bits
    among 1 to 16 (999 rows: every tiling leaves a tail); the float Q8_0 kernels, 8 and 16
    wide, are q * d's up to float32 rounding and row-exact too; a head of other values keeps
    its own forward."""
    import gguf
    from gguf import quants
    from transformers import Gemma3TextConfig

    from specchat.models.gguf_head import (
        Q8Head,
        activation_error,
        gguf_q8_head,
        read_q8_0,
    )
    lib = _kernels()
    torch.manual_seed(0)
    weight = torch.randn(999, 128) * 0.05
    path = tmp_path / "tiny.gguf"
    _q8_gguf(path, weight)
    q, d = read_q8_0(path)
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    true = torch.from_numpy(quants.dequantize(tensor.data, tensor.tensor_type).copy())
    values = (q.float().view(999, -1, 32) * d[..., None]).view(999, 128)
    assert torch.equal(values, true.float())
    assert read_q8_0(path, "output_norm.weight") is None  # not Q8_0

    cfg = Gemma3TextConfig(vocab_size=999, hidden_size=128, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, layer_types=["full_attention"])
    for dtype in (torch.float32, torch.bfloat16):
        model = Gemma3ForCausalLM(cfg).eval()
        with torch.no_grad():
            model.lm_head.weight.copy_(values.to(torch.bfloat16).float())
        model.to(dtype)
        assert gguf_q8_head(model, path, lib)
        assert isinstance(model.lm_head.forward, Q8Head)
        x = torch.randn(16, 128).to(dtype)
        with torch.inference_mode():
            alone = torch.cat([model.lm_head(x[i:i + 1]) for i in range(16)])
            for rows in range(2, 17):
                assert torch.equal(model.lm_head(x[None, :rows])[0], alone[:rows]), rows
        want = x.double() @ values.double().T
        assert alone.dtype == torch.float32
        error = (alone.double() - want).abs()
        bound = activation_error(x.double(), values.double()) + 1e-5 * want.abs().max()
        assert bool((error <= bound).all()) and error.max() > 1e-4  # int8 activations, not float

    from specchat import kernels  # both kernels, whichever this CPU runs by default
    x = torch.randn(11, 128)
    for wide in [False, True] if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} \
            <= kernels._cpu_flags() else [False]:
        alone = torch.cat([kernels.q8_0_matmul(_kernels(), x[i:i + 1], q, d, wide)
                           for i in range(11)])
        for rows in range(2, 12):
            assert torch.equal(kernels.q8_0_matmul(_kernels(), x[:rows], q, d, wide),
                               alone[:rows]), (wide, rows)
        assert torch.allclose(alone.double(), x.double() @ values.double().T, atol=1e-4)

    other = Gemma3ForCausalLM(cfg).eval()  # values of another model
    assert not gguf_q8_head(other, path, lib)
    assert "forward" not in vars(other.lm_head)


def test_gemma_norms_run_on_the_kernel_and_give_the_models_logits():
    """`kernel_cpu_norms` routes every Gemma RMSNorm through `kernels.rms_norm`; the model's
    logits stay its own (float32 and bf16), and a norm's rows are the same bits among 1 to 11."""
    lib = _kernels()
    from specchat.runners.hf.cpu import _GemmaNormKernel, kernel_cpu_norms
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_gemma3(0).to(dtype)
        for m in model.modules():
            if type(m).__name__ == "Gemma3RMSNorm":
                torch.nn.init.normal_(m.weight, std=0.5)  # the fresh model's weights are zeros
        ids = torch.randint(3, 259, (1, 24), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            want = model(ids).logits
            norms = kernel_cpu_norms(model, lib)
            got = model(ids).logits
        assert norms == 3 * 6 + 1
        assert all(isinstance(m.forward, _GemmaNormKernel) for m in model.modules()
                   if type(m).__name__ == "Gemma3RMSNorm")
        assert torch.allclose(got.float(), want.float(), atol=1e-4 if dtype == torch.float32
                              else 5e-2)
        norm = model.model.norm.forward
        x = torch.randn(11, 32).to(dtype)
        alone = torch.cat([norm(x[i:i + 1]) for i in range(11)])
        assert torch.equal(norm(x), alone)
