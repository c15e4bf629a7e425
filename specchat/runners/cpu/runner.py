"""`CpuRunner`: a target of a family `runners.family` declares (Gemma 2 and 3; Llama, Mistral,
Qwen 2 and 3, SmolLM, Phi-3) run by specchat's own forward on the CPU, one C call a forward.

transformers' forward spends its time around the arithmetic on a small model: for one token of
the embedded Gemma 3 270M it makes several hundred torch calls (norms, RoPE, masks, cache
updates, each kernel through its module), which cost as much as the NF4 products themselves.
Here the decoder stack runs in one call to `csrc/decoder.c`, on the same kernels the CPU path's
modules call (specchat's NF4 product, attention and RMSNorm), reading the weights where the
loaded model holds them; the embedding lookup and the LM head stay the model's own modules
(the GGUF's Q8_0 head on the embedded target).

Its cache is a `static.StaticCache` of float32 keys and values, a slot per position, grown as
a conversation grows. Draft trees are verified in one forward: the tree's nodes take the slots
after the cached tokens, their positions are their depths, and a visibility matrix says which
fed rows each row attends to; `keep_fed` moves the accepted path into place.

Every step is row-exact (csrc/decoder.c), so a token gets the same logits fed alone, in a
verify, in a tree or in a prompt page: `runtime.prove_row_exact` checks it at load.
"""

from __future__ import annotations

import ctypes
import time

import torch

from specchat import kernels
from specchat.core.runner import Runner
from specchat.core.tree import visibility
from specchat.runners.cpu.embedding import c_embedding
from specchat.runners import family as families
from specchat.runners.cpu.q8_head import Q8Head
from specchat.runners.static import StaticCache, rope_tables

SLOTS = 256  # a cache's first slots, and the step it grows by (at least doubling)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _NF4Weight(ctypes.Structure):
    _fields_ = [("codes", _ptr), ("absmax", _ptr), ("out", _i64), ("in_", _i64), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _NF4Weight) for name in ("q", "k", "v", "o", "gate", "up", "down")] + \
        [(name, _ptr) for name in families.NORM_SLOTS] + [("window", _i64), ("rope", _i64)]


class _Model(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                          "inter", "blocksize")] + \
        [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("act", _i64), ("table", _ptr),
         ("layer", ctypes.POINTER(_Layer)), ("final_norm", _ptr), ("softcap", ctypes.c_float),
         ("n_aux", _i64), ("aux", _ptr), ("aux_out", _ptr)]


# the parts of a forward `CpuRunner.clock` times, in csrc/decoder.c's order
CLOCK_ROWS = ("products", "attention", "norms", "activation", "rest")


# the integer kernels (`kernels.I8_KERNELS`) in words
I8_KERNEL_NAMES = {"amx": "AMX-INT8 from 8 rows", "vnni": "AVX-512 VNNI",
                   "avxvnni": "AVX-VNNI", "avx2": "AVX2", "ref": "plain C"}


def integer_kernel(lib) -> str:
    """The integer kernel `lib`'s decoder stack runs (`decoder_forward_i8_<name>`), in words."""
    name = getattr(lib.decoder_forward_i8, "__name__", "").rsplit("_", 1)[-1]
    return I8_KERNEL_NAMES.get(name, name)


def unsupported(model) -> str | None:
    """Why this runner cannot run `model` (as its CPU path left it), or None."""
    from specchat.runners.hf.cpu import NF4KernelForward

    config = model.config.get_text_config()
    why = families.unsupported(config)
    if why:
        return why
    base = model.get_decoder()
    attention = base.layers[0].self_attn
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % kv_heads or attention.head_dim % 8 or config.hidden_size % 8:
        return f"heads {heads}/{kv_heads}, head dim {attention.head_dim}"
    family, rows = families.family_of(config), families.product_rows(config, attention.head_dim)
    weights = set()
    for i, block in enumerate(base.layers):
        for name, products in families.linear_modules(family):
            forward = vars(block.get_submodule(name)).get("forward")
            if not isinstance(forward, NF4KernelForward):
                return f"layer {i}: a linear layer not on specchat's NF4 kernel"
            if forward.out_features != sum(rows[p] for p in products):
                return f"layer {i}: {name} has {forward.out_features} rows"
            weights.add((forward.state.blocksize, tuple(forward.table.tolist())))
    if len(weights) != 1:
        return "its NF4 layers differ in block size or codebook"
    return None


def _norm_weight(norm, plus_one: bool) -> torch.Tensor:
    """A norm's scale in float32, as csrc/norms.c multiplies by it: Gemma's 1 + weight, else
    the weight."""
    weight = norm.weight.detach().float()
    return (1.0 + weight if plus_one else weight).contiguous()


class CpuRunner(Runner):
    """The runner seam (`core.runner`) for a target of a `runners.family` family on a CPU path
    with specchat's kernels (`lib`, a `kernels.load` build): see the module's docstring."""

    tree_masks = True
    owned_logits = True  # the head writes a new float32 tensor each forward
    layer_features = True  # the C forward copies the residual stream entering chosen layers

    def __init__(self, model, lib, int8: bool = False):
        """`int8`: the `cpu-int8` path, NF4 by integer dot products (csrc/nf4_i8.c) on a
        packed copy of the codes (the same 4 bits a weight)."""
        why = unsupported(model)
        if why:
            raise ValueError(f"specchat's CPU forward cannot run this model: {why}")
        config = model.config.get_text_config()
        base = model.get_decoder()
        self.family = families.family_of(config)
        self.model, self.lib, self.int8 = model, lib, int8
        self._decoder = lib.decoder_forward_i8 if int8 else lib.decoder_forward
        attention = base.layers[0].self_attn
        self.hidden, self.head_dim = config.hidden_size, attention.head_dim
        self.kv_heads, self.n_layers = config.num_key_value_heads, len(base.layers)
        self.embed = model.get_input_embeddings()
        self.head = model.get_output_embeddings()
        if int8 and isinstance(vars(self.head).get("forward"), Q8Head):  # the GGUF's Q8_0 head
            vars(self.head)["forward"].pack_rows(lib)  # by the same arithmetic, in place
        self._keep: list[torch.Tensor] = []  # every tensor the C structs point into
        self._weights: list[torch.Tensor] = []  # the layers' among them (`bytes_per_token`)
        windows = families.windows(config, self.n_layers)
        rows = families.product_rows(config, self.head_dim)
        layers = (_Layer * self.n_layers)()
        for i, block in enumerate(base.layers):
            kept = len(self._keep)
            weights = self._products(block, rows)
            norms = [self._ptr(_norm_weight(block.get_submodule(self.family.norms[slot]),
                                            self.family.norm_plus_one))
                     if slot in self.family.norms else None for slot in families.NORM_SLOTS]
            self._weights += self._keep[kept:]
            layers[i] = _Layer(*weights, *norms, windows[i], families.rope_index(config, i))
        first = vars(base.layers[0].get_submodule(families.linear_modules(self.family)[0][0]))[
            "forward"]
        self._layers = layers
        attention_cap, self.logit_cap = families.soft_caps(config)
        self._model = _Model(self.n_layers, self.hidden, config.num_attention_heads,
                             self.kv_heads, self.head_dim, config.intermediate_size,
                             first.state.blocksize, float(config.rms_norm_eps),
                             float(attention.scaling), self.family.act,
                             self._ptr(first.table), layers,
                             self._ptr(_norm_weight(base.norm, self.family.norm_plus_one)),
                             attention_cap)
        self._base = base
        self._rope: list[torch.Tensor] = []
        self._rope_ptrs = (_ptr * 4)()
        self._rope_slots = 0
        self.last_hidden: torch.Tensor | None = None  # final-norm output of the last forward
        # `watch_features(layers)`: the layers (int64, the C struct's `aux`) and the latest
        # forward's hidden states entering them [n, len(layers) * hidden]
        self._aux: torch.Tensor | None = None
        self.last_aux: torch.Tensor | None = None
        self._last_rows = 0  # its rows (a Python int: no torch call to read it)
        # seconds by part of the decoder stack (CLOCK_ROWS), summed over forwards while set:
        # `bench --profile` sets it to (ctypes.c_double * len(CLOCK_ROWS))()
        self.clock = None
        # seconds in the LM head's product where the runner calls it past the module (with
        # `skip_logits_from`; module hooks see the other calls), summed while `clock` is set
        self.head_seconds = 0.0
        self._logits_upto: int | None = None  # ids from here on come out -inf (`skip_logits_from`)
        # (the latest logits, their block maxima, whether each row is still unshaped) from the
        # GGUF's Q8_0 head: `shape_pick` reads only the blocks it needs of a row not yet shaped
        # (csrc/sample.c)
        self._maxima: tuple[torch.Tensor, torch.Tensor, list[bool]] | None = None
        # a forward's token ids and positions (`_ints`)
        self._int_buffers: list[torch.Tensor | None] = [None, None]
        self._int_views: list[memoryview] = [memoryview(b""), memoryview(b"")]
        self._ints_at = [0, 0]
        # the embedding lookup in C (`_c_embedding`), or None: the module's. (It reads the
        # table where it lies now: the CPU paths are done with the model when a runner is made.)
        self._embedding = self._c_embedding()
        self._embedded = torch.empty(0, self.hidden)  # a forward's embedding rows

    @property
    def bytes_per_token(self) -> int:
        """Bytes a one-token step reads: every layer's 4-bit codes and scales (and biases), its
        norms, and the LM head's weight as its forward holds it (Q8_0 values and scales, or
        the float weight); the embedding table aside (one row of it)."""
        layers = sum(t.nbytes for t in self._weights)
        head = vars(self.head).get("forward")
        if isinstance(head, Q8Head):
            read = [head.q, head.dw if head.dw is not None else head.d]
        else:  # a kernel's own copy (bf16), or the module's weight
            own = getattr(head, "weight", None)
            read = [own if isinstance(own, torch.Tensor) else self.head.weight]
        return layers + sum(t.nbytes for t in read if isinstance(t, torch.Tensor))

    def _ptr(self, t: torch.Tensor) -> int:
        self._keep.append(t)
        return t.data_ptr()

    def _products(self, block, rows: dict[str, int]) -> list[_NF4Weight]:
        """A layer's products in `families.PRODUCTS`' order, a fused module's split by rows."""
        weights = {}
        for name, products in families.linear_modules(self.family):
            forward, first, packed = vars(block.get_submodule(name))["forward"], 0, []
            for product in products:
                weights[product] = self._nf4(forward, first, rows[product], packed)
                first += rows[product]
            if packed:  # the same bits once: the module's codes come back from these if it
                forward.release_codes(  # runs again
                    lambda lib=self.lib, packed=packed, inn=forward.in_features: torch.cat(
                        [kernels.nf4_i8_unpack(lib, p, out, inn) for p, out in packed]))
        return [weights[p] for p in families.PRODUCTS]

    def _nf4(self, forward, first: int, out: int, packed: list) -> _NF4Weight:
        """Rows [first, first + out) of an NF4 layer: a row's codes and block scales lie apart
        from its neighbours' (`unsupported` asks for whole blocks a row). On the integer path
        their packed copy, added to `packed` with its rows."""
        inn, blocksize = forward.in_features, forward.state.blocksize
        codes = forward.codes.view(-1)[first * inn // 2:(first + out) * inn // 2]
        scales = forward.absmax[first * inn // blocksize:(first + out) * inn // blocksize]
        if self.int8:  # the integer kernels' layout: packed codes, a scale per NF4 block
            codes, scales = kernels.nf4_i8_pack(self.lib, codes.contiguous(),
                                                scales.contiguous(), out, inn, blocksize)
            packed.append((codes, out))
        bias = forward.bias[first:first + out].contiguous() if forward.bias is not None \
            else None
        return _NF4Weight(self._ptr(codes), self._ptr(scales), out, inn,
                          self._ptr(bias) if bias is not None else None)

    def _ropes_for(self, slots: int) -> None:
        """RoPE tables covering positions below `slots`."""
        if slots <= self._rope_slots:
            return
        slots = max(slots, 2 * self._rope_slots, SLOTS)
        self._rope = [t for kind in self.family.rope_kinds
                      for t in rope_tables(self._base, slots, self.head_dim, "cpu", kind)]
        for i, t in enumerate(self._rope):  # (one table: every layer's index is 0)
            self._rope_ptrs[i] = t.data_ptr()
        self._rope_slots = slots

    def _run(self, cache: StaticCache, ids: list[int], positions: int, start: int,
             visible: torch.Tensor | None, n_logits: int, end: int) -> torch.Tensor:
        """`positions`: the address of the rows' int64 positions; `end`: past the largest.

        A step's Python makes few torch calls: right after a forward every one of them runs
        with the CPU's caches cold, tens of microseconds each. The ids and the embedding rows
        go through the runner's own buffers and one C call (`embed_rows`, checked against the
        embedding module at load), the LM head is one product; nothing here needs autograd's
        inference mode but the module paths, which enter it."""
        n = len(ids)
        if start + n > cache.slots:  # whole steps of SLOTS, at least doubling
            cache.grow(-(-max(start + n, 2 * cache.slots) // SLOTS) * SLOTS)
        self._ropes_for(end)
        if n > len(self._embedded):  # the embedding rows' buffer (the C forward copies them)
            self._embedded = torch.empty(max(n, 2 * len(self._embedded)), self.hidden)
        if self._embedding is not None:
            table, kind, vocabulary, scale = self._embedding
            if min(ids) < 0 or max(ids) >= vocabulary:
                raise IndexError(f"token ids must lie in [0, {vocabulary}): {ids}")
            tokens = self._ints(n, 0)
            for i, t in enumerate(ids):
                tokens[i] = t
            self.lib.embed_rows(table, kind, self.hidden, self._ints_at[0], n, scale,
                                self._embedded.data_ptr())
        else:
            with torch.inference_mode():
                self._embedded[:n] = self.embed(torch.tensor(ids))
        out = torch.empty(n, self.hidden, dtype=torch.float32)
        if self._aux is not None:  # a new tensor each forward: a drafter may keep it a while
            self.last_aux = torch.empty(n, len(self._aux) * self.hidden)
            self._model.aux_out = self.last_aux.data_ptr()
        done = self._decoder(
            ctypes.byref(self._model), self._embedded.data_ptr(), n, positions, start,
            visible.data_ptr() if visible is not None else None, cache.k.data_ptr(),
            cache.v.data_ptr(), cache.slots, self._rope_ptrs, out.data_ptr(), self.clock,
            torch.get_num_threads())
        if done != 0:
            raise MemoryError(f"specchat's CPU forward could not allocate its buffers for "
                              f"{n} rows after {start} tokens")
        self.last_hidden, self._last_rows = out, n
        if n_logits == 0:  # a prompt's page whose logits nobody reads: no LM head
            self._maxima = None
            return torch.empty(0, self.head.weight.shape[0])
        head = vars(self.head).get("forward")
        if isinstance(head, Q8Head):  # with the block maxima, for `shape_pick`
            started = time.perf_counter()
            capped = self.logit_cap > 0  # (the caps change the maxima: none then)
            maxima = None if capped else torch.empty(n_logits,
                                                     kernels.head_blocks(head.q.shape[0]))
            logits = head.leading(out[n - n_logits:] if n_logits < n else out,
                                  self._logits_upto, maxima)
            self._maxima = None if capped else (logits, maxima, [True] * n_logits)
            if capped:
                kernels.softcap_logits(self.lib, logits, self.logit_cap)
            if self.clock is not None:
                self.head_seconds += time.perf_counter() - started
            return logits
        self._maxima = None
        with torch.inference_mode():
            logits = self.head(out[n - n_logits:])
        logits = logits if logits.dtype == torch.float32 else logits.float()
        return kernels.softcap_logits(self.lib, logits.contiguous(), self.logit_cap) \
            if self.logit_cap > 0 else logits

    def _ints(self, n: int, which: int) -> memoryview:
        """Room for n int64 values in the runner's own buffer `which` (0: a forward's token ids,
        1: its positions), as a memoryview for element writes; `_ints_at[which]` is its
        address. Grown, never shrunk."""
        if n > len(self._int_views[which]):
            buffer = torch.zeros(max(n, 2 * len(self._int_views[which]), 64), dtype=torch.int64)
            self._int_buffers[which] = buffer
            self._int_views[which] = memoryview(buffer.numpy())
            self._ints_at[which] = buffer.data_ptr()
        return self._int_views[which]

    def _c_embedding(self) -> tuple[int, int, int, float] | None:
        """(the table's address, its `embed_rows` kind, its rows, the scale) where `embed_rows`
        gives the bits of the model's embedding (`embedding.c_embedding`); else None: the
        module runs."""
        found = c_embedding(self.lib, self.embed, self.hidden, plain=True)
        if found is None:
            return None
        return self._ptr(found.table), found.kind, found.rows, found.scale

    # -- the seam ---------------------------------------------------------------------------

    def new_cache(self) -> StaticCache:
        return StaticCache(self.n_layers, self.kv_heads, SLOTS, self.head_dim, torch.float32,
                           torch.device("cpu"))

    def forward(self, cache: StaticCache, ids: list[int], start: int,
                n_logits: int) -> torch.Tensor:
        positions = self._ints(len(ids), 1)
        for i in range(len(ids)):
            positions[i] = start + i
        return self._run(cache, ids, self._ints_at[1], start, None, n_logits, start + len(ids))

    def forward_tree(self, cache: StaticCache, ids: list[int], parents: list[int],
                     start: int) -> torch.Tensor:
        visible = visibility(parents)
        positions = start + visible.sum(-1) - 1  # a node's position: the root's plus its depth
        positions = positions.to(torch.int64).contiguous()
        return self._run(cache, ids, positions.data_ptr(), start,
                         visible.to(torch.uint8).contiguous(), len(ids),
                         int(positions.max()) + 1)

    def skip_logits_from(self, start: int) -> bool:
        """Ids `start`.. are never sampled (a vocabulary's last ids, which the engine masks):
        with the GGUF's Q8_0 head, a one-token step no longer computes their logits (Gemma 3's
        last 6,145 ids: 2% of the head) and every forward returns them as -inf. The other
        logits keep their bits. Returns whether it does."""
        if not isinstance(vars(self.head).get("forward"), Q8Head):
            return False
        self._logits_upto = start
        return True

    def shape_pick(self, logits: torch.Tensor, runs: list[tuple[int, int]], seq, breaks,
                   lengths: list[int], penalties, mode: str | None, temperature: float,
                   min_p: float, keys: list[tuple[int, int]] | None) -> list[int] | None:
        """The sampler's work on a forward's logits in one native call (csrc/sample.c): in
        place, the ids in `runs` masked and the penalties applied for row r's prefix
        seq[:lengths[r]]; then with `mode` each row's draw, "greedy" (the argmax) or "min_p"
        (`core.sampling.min_p_draw` with the row's noise keys). The bits of the Python
        definitions. -> the draws, or None without a mode."""
        mode_id = _PICKS[mode]
        maxima = self._fresh_maxima(logits)
        picks = kernels.shape_pick(self.lib, logits, runs, seq, breaks, lengths, penalties,
                                   mode_id, temperature, min_p, keys, maxima)
        return picks if mode is not None else None

    def _fresh_maxima(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The head's block maxima of `logits` where they are rows of the latest forward's
        logits (all of them, or some in a row: a draft tree's chain, then one leaf), none of
        them shaped since; those rows count as shaped from now on. None otherwise."""
        if self._maxima is None:
            return None
        made, maxima, fresh = self._maxima
        width = made.shape[-1]
        if logits.dim() != 2 or logits.shape[-1] != width:
            return None
        first, rest = divmod(logits.data_ptr() - made.data_ptr(), 4 * width)
        last = first + logits.shape[0]
        if rest or first < 0 or last > made.shape[0] or not all(fresh[first:last]):
            return None
        fresh[first:last] = [False] * (last - first)
        return maxima[first:last]

    def row_evidence(self, row: torch.Tensor, n: int, temperature: float, min_p: float,
                     also: int | None):
        """A float32 row's n largest logits at `temperature` (ids, values), its log-sum-exp
        and token `also`'s probability at it and under min-p, in one native call
        (`kernels.row_evidence`)."""
        return kernels.row_evidence(self.lib, row, n, temperature, min_p, also)

    def crop(self, cache, cached: int, keep: int) -> bool:
        return True  # the slots past `keep` are rewritten before any row reads them

    def keep_fed(self, cache: StaticCache, fed: int, start: int, keep: list[int]) -> None:
        cache.keep(start, keep)

    def watch_features(self, layers: tuple[int, ...] | None = None) -> None:
        """Every forward keeps its final-norm output (`last_hidden`); with `layers`, the C
        forward also copies the residual stream entering those layers (`last_aux`)."""
        if layers is not None and not all(0 <= i <= self.n_layers for i in layers):
            raise ValueError(f"layers {layers}: the target has {self.n_layers}")
        self._aux = None if layers is None else torch.tensor(layers, dtype=torch.int64)
        self._model.n_aux = 0 if layers is None else len(layers)
        self._model.aux = None if layers is None else self._aux.data_ptr()
        self._model.aux_out = None
        self.last_aux = None

    def features(self, n: int, rows: list[int] | None = None) -> torch.Tensor:
        kept = self.last_hidden if self._aux is None else self.last_aux
        if rows is None:  # (a view: each forward writes a new tensor)
            return kept if n == self._last_rows else kept[:n]
        return kept[torch.tensor(rows)]


_PICKS = {None: kernels.PICK_NONE, "greedy": kernels.PICK_GREEDY, "min_p": kernels.PICK_MIN_P}
