"""A draft head's step in one C call (csrc/head.c): what `models.eagle.DraftHead.forward`
computes for a chain of a few rows once its layers read Q8_0 copies through specchat's kernels
(`DraftHead.quantize_for_drafting`). A one-token draft step in torch is about a hundred small
calls that cost several times its arithmetic; here it is one, on the same integer products.

The head's KV cache stays torch's: keys and values [1, heads, slots, head_dim] float32, viewed
over a buffer with room after them (`models.eagle.extended` makes the room), so the torch
forward (draft trees, long catch-ups) and this one take turns on the same cache."""

from __future__ import annotations

import ctypes

import torch

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64

# Rows a catch-up feeds the C step at a time (the buffers of a step grow with its rows;
# csrc/head.c's HEAD_CHUNK for a chain's catch-up)
CATCH_UP_CHUNK = 64


class _Q8Weight(ctypes.Structure):
    _fields_ = [("q", _ptr), ("d", _ptr), ("out", _i64), ("in_", _i64)]


class _DraftHead(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("inter", _i64), ("eps", ctypes.c_float),
                ("softcap", ctypes.c_float)] + \
        [(name, _ptr) for name in ("emb_norm", "feat_norm", "attn_norm", "mlp_norm",
                                   "norm_scale", "fc_bias", "inv_freq")] + \
        [(name, _Q8Weight) for name in ("fc", "qkv", "o", "gate_up", "down", "lm")] + \
        [("product", _ptr)]


class _HeadChain(ctypes.Structure):
    _fields_ = [("table", _ptr), ("kind", _i64), ("scale", ctypes.c_float), ("embed", _ptr),
                ("top", _ptr), ("vocab", _ptr), ("vocab_breaks", _ptr),
                ("min_gain", ctypes.c_double), ("lookahead", ctypes.c_double),
                ("shape", _ptr), ("places", _ptr), ("n_places", _i64), ("seq", _ptr),
                ("breaks", _ptr), ("n_seq", _i64), ("repeat", ctypes.c_float),
                ("frequency", ctypes.c_float), ("presence", ctypes.c_float), ("last_n", _i64),
                ("dry_multiplier", ctypes.c_double), ("dry_base", ctypes.c_double),
                ("dry_allowed", _i64), ("pick", _ptr), ("t", ctypes.c_float),
                ("min_p", ctypes.c_double), ("keys", _ptr)]


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


class HeadStep:
    """`DraftHead.forward` for chains of up to `rows` rows, in C. Holds every tensor whose
    address the C struct keeps."""

    def __init__(self, head, lib, rows: int):
        cfg, block = head.cfg, head.block
        self.lib, self.rows, self.hidden = lib, rows, cfg.hidden_size
        self.heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self._keep: list[torch.Tensor] = []

        def floats(t: torch.Tensor) -> int:
            t = t.detach().to(torch.float32).contiguous()
            self._keep.append(t)
            return t.data_ptr()

        def q8(q: torch.Tensor, d: torch.Tensor) -> _Q8Weight:
            self._keep += [q, d]
            return _Q8Weight(q.data_ptr(), d.data_ptr(), q.shape[0], q.shape[1])

        self._struct = _DraftHead(
            hidden=cfg.hidden_size, heads=cfg.num_heads, inter=cfg.intermediate_size,
            eps=cfg.rms_eps, softcap=cfg.logit_softcap or 0.0,
            emb_norm=floats(head.emb_norm.weight), feat_norm=floats(head.feat_norm.weight),
            attn_norm=floats(block.attn_norm.weight), mlp_norm=floats(block.mlp_norm.weight),
            norm_scale=floats(head.norm_scale), fc_bias=floats(head.fc.linear.bias),
            inv_freq=floats(block.rope.inv_freq),
            fc=q8(*head.fc.q8), qkv=q8(*block.qkv.q8), o=q8(*block.o.q8),
            gate_up=q8(*block.gate_up.q8), down=q8(*block.down.q8), lm=q8(*head._int8_rows),
            product=_address(lib.q8_0_rows_matmul_i8 if head._q8_packed
                             else lib.q8_0_matmul_i8))
        self.vocab = head._int8_rows[0].shape[0]
        # the C functions a chain calls back, by address (a ctypes cast each call costs more)
        self._functions = {name: _address(getattr(lib, name)) for name in
                           ("shape_reduced", "embed_rows", "row_top", "min_p_place")}

    def takes(self, feats: torch.Tensor, embeds: torch.Tensor, cache,
              last_only: bool = False) -> bool:
        """Whether this call is one the C step computes: float32 rows [1, n, d], n <= rows or
        any n with `last_only` (a catch-up), and a float32 cache of one sequence (or none), keys
        and values over buffers alike."""
        ok = feats.dtype == embeds.dtype == torch.float32 and feats.shape == embeds.shape \
            and feats.dim() == 3 and feats.shape[0] == 1 \
            and 0 < feats.shape[1] and (last_only or feats.shape[1] <= self.rows)
        if ok and cache is not None:
            k, v = cache
            ok = k.dtype == v.dtype == torch.float32 and k.shape == v.shape \
                and k.stride() == v.stride() and k.shape[0] == 1 and k.shape[1] == self.heads
        return ok

    def __call__(self, feats, embeds, pos, keys, values, last_only: bool):
        """The forward of rows feats, embeds [1, n, d] at positions pos [n]: keys and values
        [1, heads, start + n, head_dim] over buffers alike, slots start.. written here.
        Returns (predicted features [1, m, d], logits [1, m, vocab]) of the last m rows: all n,
        or with `last_only` the last (the others stop at the cache)."""
        n = feats.shape[1]
        start, cap = keys.shape[2] - n, keys.stride(1) // self.head_dim
        if values.stride() != keys.stride() or keys.stride(3) != 1 \
                or keys.stride(0) != self.heads * cap * self.head_dim:
            raise ValueError("the draft head's keys and values must lie in buffers alike")
        feats, embeds = feats.contiguous(), embeds.contiguous()
        positions = pos.to(torch.int64).contiguous()
        rows = 1 if last_only else n
        pred = torch.empty(1, rows, self.hidden)
        logits = torch.empty(1, rows, self.vocab)
        # A long catch-up in chunks: the rows before the last only fill the cache
        chunk = CATCH_UP_CHUNK if last_only else n
        for at in range(0, n, chunk):
            m = min(chunk, n - at)
            out = rows if at + m == n else 0
            if self.lib.draft_head_forward(
                    ctypes.byref(self._struct), feats[0, at:].data_ptr(),
                    embeds[0, at:].data_ptr(), m, positions[at:].data_ptr(), keys.data_ptr(),
                    values.data_ptr(), cap, start + at, pred.data_ptr(), out, logits.data_ptr(),
                    torch.get_num_threads()):
                raise MemoryError(f"the draft head's step could not run for {m} rows after "
                                  f"{start + at} slots")
        return pred, logits

    def chain(self, feats: int, embeds: int, n: int, pos: int, keys, values, k: int, embedding,
              vocab: torch.Tensor, min_gain: float, lookahead: float, penalties=None,
              places=None, seq=None, breaks=None, n_seq: int = 0, vocab_breaks=None,
              sampled=None) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft chain in one C call (csrc/head.c, `draft_head_chain`): the catch-up
        over n rows of features and embeddings (float32 [n, d] at the addresses feats and
        embeds) at positions pos (int64 [n] at that address; addresses, not tensors: the drafter
        hands over its own buffers' rows without a torch call, each slow right after the
        target's forward) (keys and values [1, heads, start + n + k - 1, head_dim] over buffers
        alike: room for the drafts' slots), then up to k drafts,
        each the largest logit after the penalties, or with `sampled` = (temperature, min_p,
        keys: int64 [k, 2], each draft position's `Noise.keys`) min-p's draw
        (`sampling.min_p_place`) (penalties: a `core.penalties.Penalties`, None: none;
        `places`, `seq` with room for k more, `breaks` as `kernels.shape_reduced` takes them,
        `n_seq` the context's tokens in seq; `vocab_breaks` uint8 [vocab] or None), kept and
        continued as `HeadDrafter.propose` decides with min_gain and lookahead. `embedding`: a
        `runners.cpu.embedding.CEmbedding` of the target. Returns (the drafts' token ids, int64
        [kept], the rows examined [m, vocab], each after its penalties)."""
        start, cap = keys.shape[2] - n - (k - 1), keys.stride(1) // self.head_dim
        if values.stride() != keys.stride() or keys.stride(3) != 1 \
                or keys.stride(0) != self.heads * cap * self.head_dim:
            raise ValueError("the draft head's keys and values must lie in buffers alike")
        rows = torch.empty(k, self.vocab)
        tokens = torch.empty(k, dtype=torch.int64)
        kept = _i64()
        pen = penalties
        shaping = {} if pen is None else {
            "shape": self._functions["shape_reduced"], "places": places.data_ptr(),
            "n_places": places.shape[0], "seq": seq.data_ptr(), "breaks": breaks.data_ptr(),
            "n_seq": n_seq, "repeat": pen.repeat_penalty, "frequency": pen.frequency_penalty,
            "presence": pen.presence_penalty, "last_n": pen.repeat_last_n,
            "dry_multiplier": pen.dry_multiplier, "dry_base": pen.dry_base,
            "dry_allowed": pen.dry_allowed_length}
        chain = _HeadChain(
            table=embedding.table.data_ptr(), kind=embedding.kind, scale=embedding.scale,
            embed=self._functions["embed_rows"], top=self._functions["row_top"],
            vocab=vocab.data_ptr(),
            vocab_breaks=vocab_breaks.data_ptr() if vocab_breaks is not None else None,
            min_gain=min_gain, lookahead=lookahead, **shaping)
        if sampled is not None:
            temperature, min_p, keys_of = sampled
            keys_of = keys_of.to(torch.int64).contiguous()
            if keys_of.shape != (k, 2):
                raise ValueError(f"a sampled chain of {k} drafts takes [{k}, 2] keys")
            chain.pick, chain.keys = self._functions["min_p_place"], keys_of.data_ptr()
            chain.t, chain.min_p = max(temperature, 1e-5), min_p
        examined = self.lib.draft_head_chain(
            ctypes.byref(self._struct), ctypes.byref(chain), feats, embeds, n, pos,
            keys.data_ptr(), values.data_ptr(), cap, start, k, tokens.data_ptr(),
            rows.data_ptr(), ctypes.byref(kept), torch.get_num_threads())
        if examined < 0:
            raise MemoryError(f"the draft head's chain could not run for {n} rows after "
                              f"{start} slots")
        return tokens[:kept.value], rows[:examined]
