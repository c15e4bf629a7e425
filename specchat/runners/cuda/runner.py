"""`CudaRunner`: a Llama-family or Gemma 3 causal LM run by specchat's own forward on a CUDA
GPU.

The weights stay the ones transformers loaded (bitsandbytes' NF4 `Linear4bit`s, or bf16
`Linear`s); this module reads them in place, adding only the absmax of each NF4 block as
float32 (bitsandbytes' double quantization undone once, 1/16 of a byte a weight). What it adds:

- **a static KV cache** allocated at load, [layers, kv heads, slots, head dim]: a token's keys
  and values sit at the slot of its position, a rollback is the engine forgetting tokens (the
  next forward overwrites them), and nothing is allocated while decoding;
- **one decode width**: a forward of up to `WIDTH` tokens is padded to `WIDTH` rows and one of
  up to `PAGE` tokens to `PAGE` rows, each replayed as a CUDA graph captured at load (static
  input buffers, no host sync inside); wider forwards (never fed by the engine) run eagerly;
- **row-exact kernels** (`kernels.py`): a row's bits never depend on the rows beside it, so
  padding, verifies and prompt pages give a token the logits a one-token step gives it.

Pad rows carry the positions after the real ones and write their keys to slots past the real
tokens, which the next forward overwrites before any row can see them. The products never read
their activations: the count of live rows sits in a device scalar (`live`) that the captured
graphs read, and a pad row's product is computed from zeros (so every row stays finite).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specchat.core.runner import Runner
from specchat.runners import nf4
from specchat.runners.cuda import kernels
from specchat.runners.static import StaticCache, rope_tables, unsupported_config

WIDTH = 16  # the decode width: plain steps, verifies of up to 15 drafts, short prompt tails
PAGE = 64  # the prompt-page width (the engine's whole pages and their tails)
CONTEXT_ENV = "SPECCHAT_CUDA_CONTEXT"
CONTEXT = 4096  # slots in the static cache by default: 0.5 GiB for an 8B Llama in bf16

SUPPORTED = ("llama", "qwen2", "mistral", "gemma3_text")
GEMMA = ("gemma3_text",)  # the Gemma 3 text stack: sandwich norms, q/k norms, gelu, windows


def unsupported(model) -> str | None:
    """Why `model` cannot run on this runtime, or None."""
    config = model.config.get_text_config()
    why = unsupported_config(config, SUPPORTED)
    if why:
        return why
    kind = config.model_type
    if kind not in GEMMA and (getattr(config, "use_sliding_window", False)
                              or kind == "mistral" and getattr(config, "sliding_window", None)):
        return "sliding-window attention"
    head_dim = _head_dim(config)
    if head_dim % 16 or head_dim & (head_dim - 1):
        return f"head dim {head_dim} is not a power of two of at least 16"
    for name, module in model.named_modules():
        if type(module).__name__ == "Linear4bit":
            state = module.weight.quant_state
            if state.quant_type != "nf4" or state.blocksize != kernels.NF4_BLOCK \
                    or module.in_features % kernels.NF4_BLOCK:
                return (f"{name}: {state.quant_type} with blocks of {state.blocksize} over "
                        f"{module.in_features} inputs (needs nf4, blocks of 64, inputs a "
                        "multiple of 64)")
    return None


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Linear:
    """One linear layer as the kernels take it: NF4 (bitsandbytes' packed codes viewed as
    [N, K/2], absmax as float32 [K/64, N] (`kernels.nf4_scales`), its codebook as
    `kernels.pair_table`) or a plain [N, K] weight."""

    def __init__(self, module, code: torch.Tensor | None):
        self.bias = module.bias.data if getattr(module, "bias", None) is not None else None
        self.out_features = module.out_features
        if type(module).__name__ == "Linear4bit":
            from bitsandbytes.functional import dequantize_blockwise
            codes, state = nf4.hold(module)  # the runner (and `fuse`) view its codes from here
            n, k = state.shape
            absmax = state.absmax
            if state.nested:
                absmax = dequantize_blockwise(state.absmax, state.state2) + state.offset
            self.packed = codes.view(n, k // 2)
            self.absmax = kernels.nf4_scales(absmax.reshape(n, k // kernels.NF4_BLOCK))
            self.code = code if code is not None else kernels.pair_table(
                state.code.cpu()).to(self.packed.device)
            self.weight = None
        else:
            self.weight = module.weight.data
            self.packed = None

    @property
    def bytes(self) -> int:
        """What one forward reads of this layer's weights."""
        parts = (self.packed, self.absmax) if self.packed is not None else (self.weight,)
        parts += (self.bias,) if self.bias is not None else ()
        return sum(t.numel() * t.element_size() for t in parts)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 rows: torch.Tensor | None = None, fold: bool = False
                 ) -> torch.Tensor | kernels.Planes:
        """x @ W.T (+ bias); `rows`: the live rows, `fold`: an NF4 product split over K may
        come back as its planes, for a norm to add (`kernels.nf4_matmul`)."""
        if self.packed is not None:
            return kernels.nf4_matmul(x, self.packed, self.absmax, self.code, self.bias, out,
                                      rows=rows, fold=fold)
        return kernels.matmul(x, self.weight, self.bias, out, rows=rows)


def fuse(linears: list[Linear], modules: list) -> Linear | None:
    """One NF4 Linear for layers that read the same input (q|k|v, gate|up), their outputs side
    by side: one launch with enough columns for every SM where k and v alone start few
    programs. Their codes and scales move into the fused buffers, which the layers (and
    their modules' weights) then view, so no weight is held twice. None where a layer is not
    NF4, has a bias, or another codebook."""
    first = linears[0]
    if any(lin.packed is None or lin.bias is not None or lin.packed.shape[1] != first.packed.shape[1]
           or not torch.equal(lin.code, first.code) for lin in linears):
        return None
    fused = Linear.__new__(Linear)
    fused.bias, fused.weight, fused.code = None, None, first.code
    fused.out_features = sum(lin.out_features for lin in linears)
    fused.packed = torch.cat([lin.packed for lin in linears])
    fused.absmax = torch.cat([lin.absmax for lin in linears], dim=1)  # [K/64, N]
    row = 0
    for lin, module in zip(linears, modules):
        rows = slice(row, row + lin.out_features)
        shape = module.weight.data.shape
        lin.packed, lin.absmax = fused.packed[rows], fused.absmax[:, rows]
        module.weight.data = lin.packed.reshape(shape)  # bitsandbytes' [N * K / 2, 1] view
        row += lin.out_features
    return fused


@dataclass
class Layer:
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    gate: Linear
    up: Linear
    down: Linear
    attn_norm: torch.Tensor  # before attention
    mlp_norm: torch.Tensor  # before the MLP
    qkv: Linear | None = None  # q|k|v fused (`fuse`), or None: three products
    gate_up: Linear | None = None  # gate|up fused, or None: two products
    window: int | None = None  # a sliding-window layer's window
    rope: str = "default"  # which rotary table (Gemma: "sliding_attention", "full_attention")
    q_norm: torch.Tensor | None = None  # per-head q and k norms (Gemma)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # on the attention's output (Gemma)
    post_mlp_norm: torch.Tensor | None = None  # on the MLP's output (Gemma)


class CudaRunner(Runner):
    """The runner seam (`core.runner`) for a Llama-family or Gemma 3 model on CUDA. One cache
    per model: `new_cache` returns it, since the engine keeps one conversation at a time and
    a forward at `start` overwrites whatever the slots from there held."""

    tree_masks = False  # draft trees are verified as chains here (slots are positions)
    owned_logits = False  # on the GPU, from the graphs' static buffers
    # q|k|v's, o's and down's products split over K hand their planes to the kernel after
    # them (rope_store, the norms), which adds them as the products' second kernel would: the
    # same bits, up to three launches a layer fewer
    fold = True

    def __init__(self, model, graphs: bool | None = None, context: int | None = None):
        why = unsupported(model)
        if why:
            raise ValueError(f"the CUDA runtime cannot run this model: {why}")
        config = model.config.get_text_config()
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = base.embed_tokens.weight.dtype
        if self.dtype == torch.float32:
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.hidden = config.hidden_size
        self.eps = config.rms_norm_eps
        self.gemma = config.model_type in GEMMA
        self.scale = (config.query_pre_attn_scalar if self.gemma else self.head_dim) ** -0.5
        self.norm_offset = 1.0 if self.gemma else 0.0  # Gemma's norms scale by 1 + weight
        self.vocab = config.vocab_size
        self.embed = base.embed_tokens.weight.data
        scale = getattr(base.embed_tokens, "embed_scale", None)  # Gemma: sqrt(hidden)
        self.embed_scale = scale.to(self.dtype) if scale is not None else None
        self.final_norm = base.norm.weight.data
        code = None  # bitsandbytes' NF4 codebook as a pair table, one for all layers
        types = getattr(config, "layer_types", None) or ["full_attention"] * len(base.layers)
        self.layers = []
        for i, block in enumerate(base.layers):
            att, mlp = block.self_attn, block.mlp
            linears = [Linear(m, code) for m in (att.q_proj, att.k_proj, att.v_proj,
                                                  att.o_proj, mlp.gate_proj, mlp.up_proj,
                                                  mlp.down_proj)]
            code = next((lin.code for lin in linears if lin.packed is not None), code)
            if self.gemma:
                sliding = types[i] == "sliding_attention"
                layer = Layer(*linears, block.input_layernorm.weight.data,
                              block.pre_feedforward_layernorm.weight.data,
                              window=config.sliding_window if sliding else None,
                              rope=types[i], q_norm=att.q_norm.weight.data,
                              k_norm=att.k_norm.weight.data,
                              post_attn_norm=block.post_attention_layernorm.weight.data,
                              post_mlp_norm=block.post_feedforward_layernorm.weight.data)
            else:
                layer = Layer(*linears, block.input_layernorm.weight.data,
                              block.post_attention_layernorm.weight.data)
            layer.qkv = fuse(linears[:3], [att.q_proj, att.k_proj, att.v_proj])
            layer.gate_up = fuse(linears[4:6], [mlp.gate_proj, mlp.up_proj])
            self.layers.append(layer)
        self.lm_head = Linear(model.get_output_embeddings(), code)
        limit = getattr(config, "max_position_embeddings", None) or CONTEXT
        wanted = context or int(os.environ.get(CONTEXT_ENV, CONTEXT))
        self.context = min(limit, wanted)
        slots = -(-(self.context + PAGE) // kernels.KEYS) * kernels.KEYS
        self.cache = StaticCache(len(self.layers), self.kv_heads, slots, self.head_dim,
                                 self.dtype, self.device)
        self.rope = {kind: rope_tables(base, slots, self.head_dim, self.device,
                                        kind if self.gemma else None)
                     for kind in dict.fromkeys(layer.rope for layer in self.layers)}
        self.last_hidden: torch.Tensor | None = None  # final-norm output of the last forward
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self._captured: dict[int, tuple] = {}
        # the live rows of the forward at hand, read by its products as the graphs replay
        self.live = torch.zeros(1, dtype=torch.int32, device=self.device)
        if self.graphs:
            self._capture()

    @property
    def weight_bytes(self) -> dict[str, int]:
        """Weight bytes one forward reads by the kind of product that reads them: "nf4" (codes
        and absmax) and "bf16" (the LM head, unquantized layers), every layer once."""
        out = {"nf4": 0, "bf16": 0}
        for lin in [self.lm_head] + [getattr(layer, name) for layer in self.layers
                                     for name in ("q", "k", "v", "o", "gate", "up", "down")]:
            out["nf4" if lin.packed is not None else "bf16"] += lin.bytes
        return out

    @property
    def bytes_per_token(self) -> int:
        """Weight bytes one forward reads (every layer once, the embedding table aside)."""
        norms = sum(t.numel() * t.element_size() for layer in self.layers
                    for t in (layer.attn_norm, layer.mlp_norm))
        return sum(self.weight_bytes.values()) + norms

    # -- the forward ------------------------------------------------------------------------

    def _rows(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [M], pos [M] int32 -> (logits [M, vocab], final-norm output [M, d]); writes
        each row's keys and values at slot pos. The products read the first `self.live`
        rows' activations only."""
        m, live = ids.shape[0], self.live
        h = self.embed[ids]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        q = torch.empty(m, self.heads, self.head_dim, dtype=self.dtype, device=self.device)
        qkv_width = (self.heads + 2 * self.kv_heads) * self.head_dim
        qkv = torch.empty(m, qkv_width, dtype=self.dtype, device=self.device)
        nq, nk = self.heads * self.head_dim, self.kv_heads * self.head_dim
        inter = self.layers[0].gate.out_features
        gate_up = torch.empty(m, 2 * inter, dtype=self.dtype, device=self.device)
        x = self._norm(h, self.layers[0].attn_norm)
        for i, layer in enumerate(self.layers):
            if layer.qkv is not None:  # its planes, where split, go to rope_store
                qkv_in = layer.qkv(x, rows=live, fold=self.fold)
            else:
                qkv_in = qkv
                layer.q(x, out=qkv[:, :nq], rows=live)
                layer.k(x, out=qkv[:, nq:nq + nk], rows=live)
                layer.v(x, out=qkv[:, nq + nk:], rows=live)
            cos, sin = self.rope[layer.rope]
            qk_norm = (layer.q_norm, layer.k_norm, self.eps, self.norm_offset) \
                if layer.q_norm is not None else None
            kernels.rope_store(qkv_in, cos, sin, pos, q, self.cache.k[i], self.cache.v[i],
                               self.heads, self.kv_heads, qk_norm)
            att = kernels.attention(q, self.cache.k[i], self.cache.v[i], pos, self.scale,
                                    layer.window)
            o = layer.o(att.view(m, -1), rows=live, fold=self.fold)
            if layer.post_attn_norm is not None:
                o = self._norm(o, layer.post_attn_norm)
            x = self._norm(h, layer.mlp_norm, add=o)
            if layer.gate_up is not None:
                layer.gate_up(x, out=gate_up, rows=live)
            else:
                layer.gate(x, out=gate_up[:, :inter], rows=live)
                layer.up(x, out=gate_up[:, inter:], rows=live)
            down = layer.down(kernels.act_mul(gate_up, gelu=self.gemma), rows=live,
                              fold=self.fold)
            if layer.post_mlp_norm is not None:
                down = self._norm(down, layer.post_mlp_norm)
            norm = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.final_norm
            x = self._norm(h, norm, add=down)
        return self.lm_head(x, rows=live), x

    def _norm(self, x: torch.Tensor | kernels.Planes, weight: torch.Tensor,
              add: torch.Tensor | kernels.Planes | None = None) -> torch.Tensor:
        """The model's RMS norm of x's rows (after x += add); either may be a product's
        planes, added by the norm (`kernels.rms_norm`)."""
        return kernels.rms_norm(x, weight, self.eps, add=add, offset=self.norm_offset,
                                cast_first=not self.gemma)

    def _capture(self) -> None:
        """Capture the forward at WIDTH and PAGE rows as CUDA graphs over static buffers."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        pool = None
        with torch.cuda.stream(stream):
            for width in (PAGE, WIDTH):
                ids = torch.zeros(width, dtype=torch.long, device=self.device)
                pos = torch.arange(width, dtype=torch.int32, device=self.device)
                self.live.fill_(width)
                for _ in range(2):  # compile the kernels, settle the allocator
                    self._rows(ids, pos)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits, hidden = self._rows(ids, pos)
                pool = graph.pool()
                self._captured[width] = (graph, ids, pos, logits, hidden)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(self, cache, ids: list[int], start: int, n_logits: int) -> torch.Tensor:
        """Feed `ids` at positions start.. after the cached ones; the last n_logits rows of
        logits [n, vocab]."""
        n = len(ids)
        if start + n > self.context:
            raise ValueError(f"the context is full: {start + n} tokens, the CUDA runtime "
                             f"holds {self.context} ({CONTEXT_ENV})")
        width = WIDTH if n <= WIDTH else PAGE if n <= PAGE else None
        if width is not None and width in self._captured:
            graph, ids_buf, pos_buf, logits, hidden = self._captured[width]
            padded = ids + [ids[-1]] * (width - n)
            host = torch.tensor([*padded, *range(start, start + width), n], dtype=torch.long)
            ids_buf.copy_(host[:width], non_blocking=True)
            pos_buf.copy_(host[width:2 * width], non_blocking=True)
            self.live.copy_(host[2 * width:], non_blocking=True)
            graph.replay()
        else:
            padded = ids + [ids[-1]] * ((width or n) - n)
            ids_t = torch.tensor(padded, dtype=torch.long, device=self.device)
            pos = torch.arange(start, start + len(padded), dtype=torch.int32, device=self.device)
            self.live.fill_(n)
            logits, hidden = self._rows(ids_t, pos)
        self.last_hidden = hidden[:n]
        return logits[n - n_logits:n].clone()  # the graph's buffer is rewritten next step

    # -- the seam ---------------------------------------------------------------------------

    def new_cache(self) -> StaticCache:
        return self.cache  # "empty": the next forward starts at 0 and rewrites its slots

    def crop(self, cache, cached: int, keep: int) -> bool:
        return True  # the slots past `keep` are rewritten before any row reads them

    def keep_fed(self, cache, fed: int, start: int, keep: list[int]) -> None:
        cache.keep(start, keep)

    def forward_tree(self, cache, ids, parents, start):
        raise NotImplementedError("the CUDA runtime verifies draft trees as chains "
                                  "(tree_masks is False)")

    def watch_features(self, layers: tuple[int, ...] | None = None) -> None:
        # every forward keeps its final-norm output (`last_hidden`), and only that
        # (`layer_features` False: the loader moves an EAGLE-3 head's target to `HFRunner`)
        if layers is not None:
            raise NotImplementedError(f"{type(self).__name__} keeps no decoder layer's input")

    def features(self, n: int, rows: list[int] | None = None) -> torch.Tensor:
        if rows is None:
            return self.last_hidden[:n].clone()
        return self.last_hidden[torch.tensor(rows, device=self.last_hidden.device)]
