"""The CUDA runtime's code on the CPU: its Triton kernels under TRITON_INTERPRET=1 against
torch references (small-integer data where sums must be exact), and `CudaRunner` with graphs
off over a tiny NF4 Llama: bitsandbytes' layout read right, rows independent of their
neighbours and of the padding, the static cache's rollback and prefix pages, the load-time
proof, and speculative replies equal to plain ones; a GGUF target (Llama, Qwen 2) converted
and loaded as `--target FILE.gguf` loads it runs the same. On a GPU, `specchat check --device
cuda` runs the same code compiled and captured."""

import pytest
import torch

triton = pytest.importorskip("triton")  # TRITON_INTERPRET=1 without a GPU: conftest.py

from specchat.runners.cuda import kernels  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

if not kernels.UPCAST:
    pytest.skip("these tests run the kernels interpreted on the CPU", allow_module_level=True)

INTEGER_CODE = torch.arange(-8, 8).float()  # a codebook whose products and sums are exact


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 -> bitsandbytes' layout [N, K/2]: the first code of a pair in the
    high nibble."""
    return (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8)


def test_the_pair_table_holds_both_codes_of_a_byte_high_nibble_first():
    table = kernels.pair_table(INTEGER_CODE)
    byte = 0x3C  # codes 3 (high nibble, first) and 12
    first = torch.tensor([table[byte] & 0xFFFF], dtype=torch.int32).to(torch.int16)
    second = torch.tensor([(table[byte] >> 16) & 0xFFFF], dtype=torch.int32).to(torch.int16)
    assert first.view(torch.bfloat16).item() == INTEGER_CODE[3]
    assert second.view(torch.bfloat16).item() == INTEGER_CODE[12]


def _run_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """The few PTX instructions `kernels.PRMT_DECODE` uses, run on 32-bit integers."""
    def value(operand: str) -> int:
        return int(operand, 16) if operand.startswith("0x") else int(operand) \
            if operand.isdigit() else regs[operand]

    def prmt(a: int, b: int, c: int) -> int:
        pool = a | b << 32
        return sum(((pool >> (8 * ((c >> 4 * i) & 7))) & 0xFF) << 8 * i for i in range(4))

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        v = [value(a) for a in src]
        if op == "prmt.b32":
            regs[d] = prmt(*v)
        elif op == "mov.b32":
            regs[d] = v[0]
        else:
            regs[d] = {"and.b32": v[0] & v[1], "or.b32": v[0] | v[1],
                       "shr.u32": v[0] >> v[1]}[op]
    return regs


def test_the_byte_permute_decode_gives_the_pair_tables_codes():
    """DECODE 2's PTX, run instruction by instruction: for four bytes a call, the first codes'
    bf16 bits in $0-$1 and the second codes' in $2-$3, two a register, in element order, as
    the pair table has them; for every byte in every place, on bitsandbytes' NF4 codebook."""
    nf4 = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                        0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0])
    table = [int(v) & 0xFFFFFFFF for v in kernels.pair_table(nf4)]
    assert len(table) == 264
    words = {f"${5 + 4 * i + j}": table[256 + i] for i in range(8) for j in range(4)}
    for start in range(0, 256, 4):
        for shift in range(4):  # each byte in each of the four places
            data = [(start + (i + shift) % 4) % 256 for i in range(4)]
            got = _run_ptx(kernels.PRMT_DECODE.value,
                           {**words, "$4": sum(b << 8 * i for i, b in enumerate(data))})
            first = [(got[f"${i // 2}"] >> 16 * (i % 2)) & 0xFFFF for i in range(4)]
            second = [(got[f"${2 + i // 2}"] >> 16 * (i % 2)) & 0xFFFF for i in range(4)]
            assert first == [table[b] & 0xFFFF for b in data], data
            assert second == [table[b] >> 16 for b in data], data


def test_the_code_permute_decode_gives_each_codes_value():
    """DECODE 3's PTX: four codes a call, a byte each, -> their bf16 bits in $0-$1, two a
    register, in element order: every code in every place, on bitsandbytes' NF4 codebook."""
    nf4 = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                        0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0])
    table = [int(v) & 0xFFFFFFFF for v in kernels.pair_table(nf4)]
    bits = nf4.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    words = {f"${3 + 4 * i + j}": table[256 + i] for i in range(8) for j in range(4)}
    for code in range(16):
        for place in range(4):
            data = [(code + 5 * i) % 16 if i != place else code for i in range(4)]
            got = _run_ptx(kernels.PRMT_CODES.value,
                           {**words, "$2": sum(c << 8 * i for i, c in enumerate(data))})
            values = [(got[f"${i // 2}"] >> 16 * (i % 2)) & 0xFFFF for i in range(4)]
            assert values == [int(bits[c]) for c in data], data


# (columns, codes a step, slices of K, warps, stages, decode): every decoding, one and several
# blocks a step, K whole or split
NF4_CONFIGS = [(16, 64, 1, 4, 1, 0), (16, 64, 1, 4, 1, 1), (32, 128, 2, 4, 1, 1),
               (16, 64, 4, 4, 1, 0), (16, 64, 1, 4, 1, 2), (32, 128, 2, 4, 1, 2),
               (16, 64, 1, 4, 1, 3), (32, 256, 1, 4, 1, 3), (16, 128, 2, 4, 1, 3),
               (16, 64, 1, 4, 1, 4), (32, 256, 1, 4, 1, 4), (16, 128, 2, 4, 1, 4)]


@pytest.mark.parametrize("config", [None, *NF4_CONFIGS])
def test_nf4_matmul_is_exact_on_small_integers_with_bias_and_a_strided_output(config):
    torch.manual_seed(0)
    n, k, m = 40, 256, 5  # n not a multiple of the tile, four absmax blocks a row
    codes = torch.randint(0, 16, (n, k))
    absmax = 2.0 ** torch.randint(-2, 3, (n, k // 64)).float()
    bias = torch.randint(-4, 5, (n,)).to(torch.bfloat16)
    x = torch.randint(-3, 4, (m, k)).to(torch.bfloat16)
    wide = torch.full((m, n + 8), float("nan"))
    kernels.nf4_matmul(x, _pack(codes), kernels.nf4_scales(absmax),
                       kernels.pair_table(INTEGER_CODE), bias,
                       out=wide[:, 4:4 + n], config=config)
    weight = INTEGER_CODE[codes] * absmax.repeat_interleave(64, 1)
    assert torch.equal(wide[:, 4:4 + n], x.float() @ weight.T + bias.float())
    assert wide[:, :4].isnan().all() and wide[:, 4 + n:].isnan().all()  # nothing else written


def test_both_decodings_give_the_same_bits_and_a_config_must_divide_k():
    torch.manual_seed(1)
    packed = _pack(torch.randint(0, 16, (24, 192)))
    absmax = torch.rand(24, 3)
    scales = kernels.nf4_scales(absmax)
    table = kernels.pair_table(torch.linspace(-1, 1, 16))
    x = torch.randn(3, 192).to(torch.bfloat16)
    by_table = kernels.nf4_matmul(x, packed, scales, table, config=(16, 64, 1, 4, 1, 0))
    by_gather = kernels.nf4_matmul(x, packed, scales, table, config=(16, 64, 1, 4, 1, 1))
    assert torch.equal(by_table, by_gather)
    # DECODE 3 multiplies bitsandbytes' own dequantized weights, a step's codes in one product:
    # within a bf16 rounding of each weight and of the output (interpreted, a float's cast to
    # bf16 truncates: up to 2^-7 of the value, where a GPU rounds to nearest)
    weight = (kernels.pair_table(torch.linspace(-1, 1, 16))[:256:16] & 0xFFFF).to(torch.int16)
    codes = torch.stack([packed >> 4, packed & 15], -1).reshape(24, 192).long()
    dequantized = (weight.view(torch.bfloat16).float()[codes]
                   * absmax.repeat_interleave(64, 1)).to(torch.bfloat16).float()
    by_step = kernels.nf4_matmul(x, packed, scales, table, config=(16, 64, 1, 4, 1, 3))
    bound = (x.float().abs() @ dequantized.abs().T + by_step.float().abs()) * 2 ** -7
    assert ((by_step.float() - x.float() @ dequantized.T).abs() <= bound).all()
    with pytest.raises(ValueError, match="whole steps"):
        kernels.nf4_matmul(x, packed, scales, table, config=(16, 128, 1, 4, 1, 1))
    with pytest.raises(ValueError, match="power of two"):
        kernels.nf4_matmul(x, packed, scales, table, config=(16, 192, 1, 4, 1, 3))
    with pytest.raises(ValueError, match=r"\[K/64, N\]"):
        kernels.nf4_matmul(x, packed, absmax, table)  # bitsandbytes' own [N, K/64]


def test_the_shapes_config_and_the_sweeps_candidates_divide_k_into_whole_steps():
    from specchat.runners.cuda import sweep

    shapes = [shape for model in sweep.SHAPES.values() for name, shape in model.items()
              if name != "lm head"] + [(96, 192)]
    for n, k in shapes:
        configs = sweep.candidates(n, k)
        assert configs[0] == kernels.nf4_config(n, k) and len(configs) <= 27
        for c in configs:
            assert k % (c.split * c.block_k) == 0 and c.block_k % 64 == 0, c


def test_the_sweeps_timings_rotate_weight_copies_twice_the_l2():
    from specchat.runners.cuda import sweep

    l2 = 50 << 20  # an H100's
    assert sweep.copies_for(8 << 20, l2) == 13  # o, 4096 x 4096 in NF4: 104 MiB in all
    assert sweep.copies_for(66 << 20, l2) == 2
    assert sweep.copies_for(1 << 30, l2) == 1  # a bf16 LM head is larger than the L2 alone


def test_the_sweep_says_what_it_needs_without_a_gpu(capsys):
    from specchat.runners.cuda import sweep

    with pytest.raises(SystemExit) as done:
        sweep.main(["--help"])
    assert done.value.code == 0 and "--write" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert sweep.main([]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def _rows_alone_and_together(fn, x: torch.Tensor) -> None:
    """fn(rows) -> outputs row for row: each row computed alone, or among others in any order,
    gives the same bits."""
    together = fn(x)
    order = torch.randperm(x.shape[0])
    shuffled = fn(x[order].contiguous())
    for i in range(x.shape[0]):
        assert torch.equal(fn(x[i:i + 1].contiguous())[0], together[i])
    assert torch.equal(shuffled, together[order])


def test_matmul_rows_never_depend_on_their_neighbours():
    torch.manual_seed(2)
    packed = _pack(torch.randint(0, 16, (32, 128)))
    absmax = kernels.nf4_scales(torch.rand(32, 2))
    table = kernels.pair_table(torch.linspace(-1, 1, 16))
    weight = torch.randn(80, 128).to(torch.bfloat16)
    x = torch.randn(19, 128).to(torch.bfloat16)
    _rows_alone_and_together(lambda r: kernels.nf4_matmul(r, packed, absmax, table), x)
    for config in ((16, 64, 1, 4, 1, 0), (16, 64, 1, 4, 1, 1), (16, 64, 2, 4, 1, 1),
                   (16, 64, 2, 4, 1, 2)):
        _rows_alone_and_together(lambda r, c=config: kernels.nf4_matmul(r, packed, absmax, table,
                                                                        config=c), x)
    _rows_alone_and_together(lambda r: kernels.matmul(r, weight), x)
    _rows_alone_and_together(lambda r: kernels.rms_norm(r, weight[0], 1e-6), x)


@pytest.mark.parametrize("config", [None, *NF4_CONFIGS])
def test_pad_rows_are_never_read_and_the_live_rows_keep_their_bits(config):
    """The runtime feeds 16 rows with the live count in a device scalar: the live rows give
    the bits they give alone, the pad rows the bias alone, whatever the pad rows hold."""
    torch.manual_seed(3)
    n, k = 40, 256
    packed = _pack(torch.randint(0, 16, (n, k)))
    absmax = kernels.nf4_scales(torch.rand(n, k // 64))
    table = kernels.pair_table(torch.linspace(-1, 1, 16))
    bias = torch.randn(n).to(torch.bfloat16)
    weight = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(16, k).to(torch.bfloat16)
    poisoned = x.clone()
    poisoned[3:] = float("nan")  # a read pad row would carry its NaN into the output
    live = torch.tensor([3], dtype=torch.int32)
    for product in (lambda r, rows=None: kernels.nf4_matmul(r, packed, absmax, table, bias,
                                                            config=config, rows=rows),
                    lambda r, rows=None: kernels.matmul(r, weight, bias, rows=rows)):
        out = product(poisoned, rows=live)
        assert torch.equal(out[:3], product(x[:3].contiguous()))
        assert torch.equal(out[3:], bias.expand(13, n))
    # without the live count every row is read: the poison shows
    assert kernels.nf4_matmul(poisoned, packed, absmax, table, config=config)[3:].isnan().all()


@pytest.mark.parametrize("config", [(16, 64, 2, 4, 1, 1), (16, 64, 4, 4, 1, 4)])
def test_a_norm_adds_a_split_products_planes_to_the_same_bits(config):
    """A product split over K hands its planes to the norm after it: the norm adds them as the
    product's own second kernel does, as its residual add (Llama) or its input (Gemma's norms
    after attention and the MLP)."""
    torch.manual_seed(4)
    n, k, m = 40, 256, 5
    packed = _pack(torch.randint(0, 16, (n, k)))
    absmax = kernels.nf4_scales(torch.rand(n, k // 64))
    table = kernels.pair_table(torch.linspace(-1, 1, 16))
    x = torch.randn(m, k).to(torch.bfloat16)
    weight = torch.randn(n).to(torch.bfloat16)
    for bias in (None, torch.randn(n).to(torch.bfloat16)):
        whole = kernels.nf4_matmul(x, packed, absmax, table, bias, config=config)
        planes = kernels.nf4_matmul(x, packed, absmax, table, bias, config=config, fold=True)
        assert isinstance(planes, kernels.Planes) and planes.shape == whole.shape
        h = torch.randn(m, n).to(torch.bfloat16)
        h_folded = h.clone()
        normed = kernels.rms_norm(h, weight, 1e-6, add=whole)
        assert torch.equal(kernels.rms_norm(h_folded, weight, 1e-6, add=planes), normed)
        assert torch.equal(h_folded, h)  # the residual stream, added in place alike
        gemma = dict(offset=1.0, cast_first=False)
        assert torch.equal(kernels.rms_norm(planes, weight, 1e-6, **gemma),
                           kernels.rms_norm(whole, weight, 1e-6, **gemma))
    with pytest.raises(ValueError, match="no add"):
        kernels.rms_norm(planes, weight, 1e-6, add=whole)


def _attention_reference(q, k_cache, v_cache, pos, scale, window=None):
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    out = torch.empty(q.shape)
    for r, p in enumerate(pos.tolist()):
        lo = max(0, p - window + 1) if window else 0
        for h in range(heads):
            kv = h // (heads // kv_heads)
            s = (k_cache[kv, lo:p + 1].double() @ q[r, h].double()) * scale
            out[r, h] = (torch.softmax(s, 0) @ v_cache[kv, lo:p + 1].double()).float()
    return out


@pytest.mark.parametrize("window", [None, 50])
def test_attention_matches_softmax_attention_over_each_rows_past(window):
    torch.manual_seed(3)
    heads, kv_heads, d, slots = 4, 2, 16, 192
    k_cache = torch.randn(kv_heads, slots, d).to(torch.bfloat16)
    v_cache = torch.randn(kv_heads, slots, d).to(torch.bfloat16)
    pos = torch.tensor([0, 5, 63, 64, 130, 131, 140], dtype=torch.int32)
    q = torch.randn(len(pos), heads, d).to(torch.bfloat16)
    got = kernels.attention(q, k_cache, v_cache, pos, d ** -0.5, window)
    want = _attention_reference(q, k_cache, v_cache, pos, d ** -0.5, window)
    assert (got.float() - want).abs().max() < 0.02
    # a row's output is its own, whatever rows share its tile and how far they reach
    for i in range(len(pos)):
        alone = kernels.attention(q[i:i + 1].contiguous(), k_cache, v_cache, pos[i:i + 1],
                                  d ** -0.5, window)
        assert torch.equal(alone[0], got[i])


def test_rope_store_rotates_q_and_k_and_writes_keys_and_values_at_their_positions():
    torch.manual_seed(4)
    heads, kv_heads, d, slots = 2, 1, 16, 64
    pos = torch.tensor([7, 8, 9], dtype=torch.int32)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d).to(torch.bfloat16)
    angle = torch.arange(slots)[:, None] * torch.rand(d // 2)[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    q = torch.empty(3, heads, d, dtype=torch.bfloat16)
    k_cache = torch.zeros(kv_heads, slots, d, dtype=torch.bfloat16)
    v_cache = torch.zeros(kv_heads, slots, d, dtype=torch.bfloat16)
    kernels.rope_store(qkv, cos, sin, pos, q, k_cache, v_cache, heads, kv_heads)

    def rope(x, p):
        x = x.float()
        half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos[p] + half * sin[p]

    parts = qkv.view(3, heads + 2 * kv_heads, d)
    for r, p in enumerate(pos.tolist()):
        assert torch.allclose(q[r].float(), rope(parts[r, :heads], p), atol=0.02)
        assert torch.allclose(k_cache[0, p].float(), rope(parts[r, heads], p), atol=0.02)
        assert torch.equal(v_cache[0, p], parts[r, heads + 1])
    assert not k_cache[0, :7].any() and not k_cache[0, 10:].any()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_adds_a_split_products_planes_to_the_same_bits(qk_norm):
    torch.manual_seed(6)
    heads, kv_heads, d, slots, k = 2, 1, 16, 32, 256
    n = (heads + 2 * kv_heads) * d
    packed = _pack(torch.randint(0, 16, (n, k)))
    absmax = kernels.nf4_scales(torch.rand(n, k // 64))
    table = kernels.pair_table(torch.linspace(-1, 1, 16))
    x = torch.randn(3, k).to(torch.bfloat16)
    pos = torch.tensor([4, 5, 6], dtype=torch.int32)
    angle = torch.arange(slots)[:, None] * torch.rand(d // 2)[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    norms = (torch.randn(d).to(torch.bfloat16), torch.randn(d).to(torch.bfloat16), 1e-6, 1.0) \
        if qk_norm else None
    for bias in (None, torch.randn(n).to(torch.bfloat16)):
        outs = []
        for fold in (False, True):
            qkv = kernels.nf4_matmul(x, packed, absmax, table, bias,
                                     config=(16, 64, 2, 4, 1, 1), fold=fold)
            assert isinstance(qkv, kernels.Planes) == fold
            q = torch.empty(3, heads, d, dtype=torch.bfloat16)
            k_cache = torch.zeros(kv_heads, slots, d, dtype=torch.bfloat16)
            v_cache = torch.zeros(kv_heads, slots, d, dtype=torch.bfloat16)
            kernels.rope_store(qkv, cos, sin, pos, q, k_cache, v_cache, heads, kv_heads, norms)
            outs.append((q, k_cache, v_cache))
        for whole, folded in zip(*outs):
            assert torch.equal(whole, folded)


# -- the runner over a tiny NF4 Llama -----------------------------------------------------


@pytest.fixture(scope="module")
def nf4_llama(tmp_path_factory):
    """A tiny one-layer Llama (dimensions multiples of 64, as NF4 blocks need) in NF4 through
    transformers and bitsandbytes, bf16 compute, on the CPU (the Gemma test chains three)."""
    from tiny import byte_tokenizer
    from transformers import LlamaConfig

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=2, bos_token_id=1,
                         pad_token_id=0, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("nf4-llama")
    from transformers import LlamaForCausalLM
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return _load_nf4(path), path


def _load_nf4(path):
    """A saved checkpoint loaded in NF4 (double quantization, bf16 compute) on the CPU, as
    load_model loads a target on CUDA. Its layers repack themselves at a first forward, as on
    a CPU with AVX512-BF16 whatever this one has: the runner must hold them."""
    from tiny import bnb_cpu_repack
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant,
                                                 dtype=torch.bfloat16,
                                                 device_map={"": "cpu"}).eval()
    bnb_cpu_repack(model, on=True)
    return model


@pytest.fixture(scope="module")
def runner(nf4_llama):
    from specchat.runners.cuda.runner import CudaRunner
    return CudaRunner(nf4_llama[0], graphs=False, context=192)


IDS = [(40 + 37 * i) % 250 + 3 for i in range(20)]


def test_the_runner_computes_what_transformers_computes(nf4_llama, runner):
    model, _ = nf4_llama
    got = runner.forward(runner.new_cache(), IDS, 0, len(IDS)).float()
    with torch.inference_mode():
        want = model(torch.tensor([IDS])).logits[0].float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert got.argmax(-1).eq(want.argmax(-1)).float().mean() >= 0.85  # random logits: near-ties
    # q|k|v and gate|up run fused, and transformers' modules (which computed `want` after the
    # runner was made) read their weights from the fused buffers, not from copies
    layer, block = runner.layers[0], model.model.layers[0]
    assert layer.qkv is not None and layer.gate_up is not None
    assert block.self_attn.k_proj.weight.data.data_ptr() == layer.k.packed.data_ptr()
    assert layer.k.packed.data_ptr() - layer.qkv.packed.data_ptr() == layer.q.packed.numel()


def test_folding_split_products_into_their_norms_keeps_every_bit(runner, monkeypatch):
    """Every product split over K wherever its K allows: the forward with o's and down's
    planes added by the norms after them gives the logits of the forward without."""
    rule = kernels.nf4_config

    def split(n, k, card=None):
        return kernels.NF4Config(16, 64, 2, 4, 1, 1) if k % 128 == 0 else rule(n, k, card)

    monkeypatch.setattr(kernels, "nf4_config", split)
    folded = runner.forward(runner.new_cache(), IDS, 0, len(IDS)).float()
    monkeypatch.setattr(runner, "fold", False)
    assert torch.equal(runner.forward(runner.new_cache(), IDS, 0, len(IDS)).float(), folded)


def test_a_tokens_logits_never_depend_on_what_is_fed_with_it(runner):
    """One at a time (padded to the decode width), in chains of every length, or in one page:
    the same bits."""
    cache = runner.new_cache()
    whole = runner.forward(cache, IDS, 0, len(IDS))
    steps = torch.cat([runner.forward(cache, IDS[i:i + 1], i, 1) for i in range(len(IDS))])
    assert torch.equal(steps, whole)
    at, parts = 0, []
    for width in (3, 16, 1):
        parts.append(runner.forward(cache, IDS[at:at + width], at, width))
        at += width
    assert at == len(IDS) and torch.equal(torch.cat(parts), whole)


def test_rolling_back_the_static_cache_forgets_the_rejected_tokens(runner):
    """A verify writes drafts past the kept tokens; the next forward overwrites them before
    any row can see them: the reply goes on as if they had never been fed."""
    cache = runner.new_cache()
    want = runner.forward(cache, IDS, 0, len(IDS))
    runner.forward(cache, IDS[:10], 0, 1)
    runner.forward(cache, [200, 201, 202, 203, 204], 10, 5)  # rejected drafts
    assert runner.crop(cache, 15, 10)
    assert torch.equal(runner.forward(cache, IDS[10:], 10, 10), want[10:])


def test_the_prefix_store_restores_whole_pages_of_the_static_cache(runner):
    from specchat.core.prefix import PrefixStore

    store = PrefixStore(1000, page=8)
    cache = runner.new_cache()
    want = runner.forward(cache, IDS, 0, len(IDS))
    store.add(IDS, cache, 16)
    runner.forward(cache, [9] * 16, 0, 16)  # another prompt overwrites the slots
    stored, n = store.longest(IDS, 16)
    assert n == 16
    store.restore(stored, n, runner.new_cache())
    assert torch.equal(runner.forward(cache, IDS[16:], 16, 4), want[16:])


def test_the_kernel_tables_weight_bytes_are_the_runners(runner):
    """`check --profile` rates the matmul kernels by the bytes of the weights they read: the
    NF4 layers' codes and absmax, and the bf16 weights (here the LM head), every layer once."""
    got = runner.weight_bytes
    norms = sum(t.numel() * t.element_size() for layer in runner.layers
                for t in (layer.attn_norm, layer.mlp_norm))
    assert got["nf4"] > 0 and got["bf16"] >= runner.lm_head.bytes
    assert got["nf4"] + got["bf16"] == runner.bytes_per_token - norms


def test_the_load_time_proof_passes_on_the_runner(runner, monkeypatch):
    """The proof load_model runs, over fewer tokens (interpreted kernels are slow): steps,
    verifies of 2 and 6, the decode width and a page past it."""
    from specchat.models import runtime

    monkeypatch.setattr(runtime, "PROOF_NEW", 6)
    monkeypatch.setattr(runtime, "PROOF_WIDTHS", (1, 2, 6))
    monkeypatch.setattr(runtime, "PROOF_WIDEST", 17)
    exact, proof = runtime.prove_row_exact(runner, 259)
    assert exact, proof
    assert "6 and 17 rows" in proof


def test_speculative_replies_are_plain_replies_on_the_runner(nf4_llama, runner):
    """Greedy and seeded, with n-gram drafts and a draft model (the same tiny model on its own
    runner): the engine's text equals plain decoding's."""
    from tiny import byte_tokenizer

    from specchat.core.engine import Engine
    from specchat.core.events import TokenEvent
    from specchat.core.request import GenerateConfig
    from specchat.drafters.model import ModelDrafter
    from specchat.drafters.ngram import NgramDrafter
    from specchat.models.loaded import LoadedModel
    from specchat.runners.cuda.runner import CudaRunner

    model, _ = nf4_llama
    tokenizer = byte_tokenizer()
    loaded = LoadedModel(model, tokenizer, "tiny-nf4", "nf4", torch.device("cpu"), 0.0,
                         runner_=runner)
    draft = ModelDrafter(model, 259, runner=CudaRunner(model, graphs=False, context=192))
    engine = Engine(loaded, {"ngram": NgramDrafter(), "model": draft})
    assert not engine.trees_ok  # trees are verified as chains here
    prompt = tokenizer("abcabc abc", add_special_tokens=False).input_ids

    def reply(**cfg):
        events = engine.stream(prompt, GenerateConfig(max_new_tokens=8, **cfg))
        return [e.id for e in events if isinstance(e, TokenEvent)]

    for sampling in (dict(temperature=0.0), dict(temperature=0.8, seed=3)):
        plain = reply(speculation=False, **sampling)
        assert reply(speculation=True, drafter="ngram", adaptive=False, **sampling) == plain
    greedy = reply(speculation=False, temperature=0.0)
    assert reply(speculation=True, drafter="model", adaptive=False, temperature=0.0) == greedy


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_target_runs_on_the_runtime_as_its_checkpoint_does(arch, tmp_path, monkeypatch):
    """A GGUF file as `--target FILE.gguf` takes it on CUDA: converted into the cache
    (`resolve`), loaded in NF4 with the file's tokenizer (`_load`, as load_model loads it),
    given the runtime by `use_cuda_runtime`: the logits and greedy text of transformers' model
    of the converted checkpoint, the load-time proof passed (Llama's), and speculative replies
    equal to plain ones."""
    from gguf_writer import tiny_model, write_gguf
    from tiny import bnb_cpu_repack

    from specchat import runners
    from specchat.core.engine import Engine
    from specchat.core.events import TokenEvent
    from specchat.core.request import GenerateConfig
    from specchat.drafters.model import ModelDrafter
    from specchat.drafters.ngram import NgramDrafter
    from specchat.models import runtime
    from specchat.models.load import _load, resolve
    from specchat.runners.cuda.runner import CONTEXT_ENV, CudaRunner

    monkeypatch.setenv("SPECCHAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(CONTEXT_ENV, "128")  # interpreted attention: few slots
    model = tiny_model(arch)
    # attention weights at the MLP's scale (std 0.075): the writer's 0.25 makes a softmax so
    # near one-hot that two bf16 forwards' roundings differ by 6% of the logits
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "self_attn" in name and p.dim() == 2:
                p.mul_(0.3)
    file = write_gguf(tmp_path / f"tiny-{arch}.gguf", model)
    said = []
    path = resolve(str(file), said.append)
    loaded = _load(str(file), path, "nf4", torch.device("cpu"), torch.bfloat16, local=True)
    bnb_cpu_repack(loaded.model, on=True)  # as `_load_nf4`: the runner must hold repacked layers
    assert runners.use_cuda_runtime(loaded, said.append) == ("cuda-graphs", ()), said
    runner = loaded.runner
    assert isinstance(runner, CudaRunner) and runner.dtype == torch.bfloat16
    layer = runner.layers[0]  # NF4 throughout; q|k|v fused where they have no bias (Qwen 2's)
    assert all(getattr(layer, n).packed is not None for n in ("q", "k", "v", "o", "down"))
    assert layer.gate_up is not None and (layer.qkv is None) == (arch == "qwen2")
    got = runner.forward(runner.new_cache(), IDS, 0, len(IDS)).float()
    with torch.inference_mode():
        want = loaded.model(torch.tensor([IDS])).logits[0].float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert got.argmax(-1).eq(want.argmax(-1)).float().mean() >= 0.85

    if arch == "llama":  # the load-time proof, over fewer tokens: 5 s interpreted, once
        monkeypatch.setattr(runtime, "PROOF_NEW", 6)
        monkeypatch.setattr(runtime, "PROOF_WIDTHS", (1, 2, 6))
        monkeypatch.setattr(runtime, "PROOF_WIDEST", 17)
        exact, proof = runtime.prove_row_exact(runner, model.config.vocab_size)
        assert exact, proof

    tokenizer = loaded.tokenizer  # the file's byte-level BPE, through the cache
    prompt = tokenizer("hello world, hello world", add_special_tokens=False).input_ids
    draft = ModelDrafter(loaded.model, model.config.vocab_size,
                         runner=CudaRunner(loaded.model, graphs=False, context=128))
    engine = Engine(loaded, {"ngram": NgramDrafter(), "model": draft})

    def reply(**cfg):
        events = engine.stream(prompt, GenerateConfig(max_new_tokens=8, temperature=0.0, **cfg))
        return [e.id for e in events if isinstance(e, TokenEvent)]

    plain = reply(speculation=False)
    with torch.inference_mode():
        greedy = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=len(plain),
                                       do_sample=False)[0, len(prompt):].tolist()
    assert plain == greedy
    assert reply(speculation=True, drafter="ngram", adaptive=False) == plain
    assert reply(speculation=True, drafter="model", adaptive=False) == plain


def test_a_gemma3_model_runs_as_transformers_runs_it_row_exact(tmp_path):
    """Gemma 3's stack (sandwich norms scaled by 1 + weight, q and k norms, gelu, a scaled
    embedding, sliding-window layers with their own rotary table) on the same kernels: close to
    transformers' forward, and a token's logits the same bits alone or in a page, past the
    window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from specchat.runners.cuda.runner import CudaRunner, unsupported

    torch.manual_seed(7)
    config = Gemma3TextConfig(vocab_size=259, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=32, sliding_window=6, max_position_embeddings=256,
                              layer_types=["sliding_attention", "sliding_attention",
                                           "full_attention"])
    model = Gemma3ForCausalLM(config).to(torch.bfloat16).eval()
    for p in model.parameters():  # norm weights start at zero: make them count
        if p.dim() == 1:
            p.data.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    model = _load_nf4(tmp_path)
    assert unsupported(model) is None
    runner = CudaRunner(model, graphs=False, context=128)
    ids = IDS[:14]
    whole = runner.forward(runner.new_cache(), ids, 0, len(ids))
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].float()
    assert (whole.float() - want).abs().max() <= 0.05 * want.abs().max()
    steps = torch.cat([runner.forward(None, ids[i:i + 1], i, 1) for i in range(len(ids))])
    assert torch.equal(steps, whole)


def test_models_it_cannot_run_say_why():
    from transformers import LlamaConfig, LlamaForCausalLM

    from specchat.runners.cuda.runner import unsupported

    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, hidden_act="gelu"))
    assert unsupported(tiny) == "its activation is gelu"
    from transformers import GPT2Config, GPT2LMHeadModel
    assert "is not a model it runs" in unsupported(GPT2LMHeadModel(GPT2Config(n_layer=1)))
