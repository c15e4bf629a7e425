"""The C ABI is declared once (csrc/specchat.h): the ctypes bindings (`kernels._ARGTYPES`, the
names each variant binds) and the structs `runners.cpu.runner` mirrors are checked against it,
and each build defines what it declares."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from specchat import kernels
from specchat.runners.cpu import head_step
from specchat.runners.cpu import runner as cpu_runner

HEADER = kernels.CSRC / "specchat.h"
C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float,
           "uint32_t": ctypes.c_uint32,
           "double": ctypes.c_double}


def declared() -> dict[str, tuple[str, list]]:
    """Each function the header declares -> (its return type, its parameters as ctypes)."""
    text = re.sub(r"//[^\n]*", "", HEADER.read_text())
    out = {}
    for ret, name, params in re.findall(r"\b(void|int|int64_t|float)\s+(\w+)\s*\(([^)]*)\);",
                                        text):
        types = []
        for param in " ".join(params.split()).split(","):
            param = param.strip()
            if param in ("", "void"):
                continue
            if "*" in param:
                types.append(ctypes.c_void_p)  # every pointer crosses as an address
            else:
                kind = param.replace("const ", "").split()[0]
                types.append(C_TYPES[kind])
        out[name] = (ret, types)
    return out


def test_the_header_declares_every_binding_with_its_signature():
    functions = declared()
    assert len(functions) >= 30 and "decoder_forward16_ref" in functions
    c_names = {ctypes.c_int: "int", ctypes.c_int64: "int64_t", ctypes.c_float: "float"}
    restypes = {name: c_names[t] for name, t in kernels._RESTYPES.items()}
    for wide in (False, True):
        for simd in (False, True):
            for name, symbol in kernels.symbols(wide, simd).items():
                assert symbol in functions, f"{symbol} is bound but not declared in specchat.h"
                ret, params = functions[symbol]
                assert params == kernels._ARGTYPES[name], (symbol, params)
                assert ret == restypes.get(name, "void"), symbol
    assert functions["max_in"] == ("int", [])


def test_each_build_defines_what_the_header_declares():
    if not shutil.which("gcc"):
        pytest.skip("no C compiler")
    portable = kernels.load("ref")
    assert portable is not None
    raw = ctypes.CDLL(str(portable.path))
    for name in declared():
        # the portable build: the references (and max_in, and the packings) only
        assert hasattr(raw, name) == (name.endswith("_ref") or name == "max_in"
                                      or name in kernels._PLAIN), name
    if kernels.runs_here("avx2"):
        simd = ctypes.CDLL(str(kernels.load("avx2").path))
        for name in declared():
            assert hasattr(simd, name), name


FIELDS = {  # C struct -> (its ctypes mirror, its fields)
    "nf4_weight": (cpu_runner._NF4Weight, ["codes", "absmax", "out", "in", "bias"]),
    "decoder_layer": (cpu_runner._Layer,
                      ["q", "k", "v", "o", "gate", "up", "down", "attn_norm", "post_attn_norm",
                       "mlp_norm", "post_mlp_norm", "q_norm", "k_norm", "window", "rope"]),
    "decoder_model": (cpu_runner._Model,
                      ["layers", "hidden", "heads", "kv_heads", "head_dim", "inter",
                       "blocksize", "eps", "scale", "act", "table", "layer", "final_norm",
                       "softcap", "n_aux", "aux", "aux_out"]),
    "q8_weight": (head_step._Q8Weight, ["q", "d", "out", "in"]),
    "draft_head": (head_step._DraftHead,
                   ["hidden", "heads", "inter", "eps", "softcap", "emb_norm", "feat_norm",
                    "attn_norm", "mlp_norm", "norm_scale", "fc_bias", "inv_freq", "fc", "qkv",
                    "o", "gate_up", "down", "lm", "product"]),
    "head_chain": (head_step._HeadChain,
                   ["table", "kind", "scale", "embed", "top", "vocab", "vocab_breaks",
                    "min_gain", "lookahead", "shape", "places", "n_places", "seq", "breaks",
                    "n_seq", "repeat", "frequency", "presence", "last_n", "dry_multiplier",
                    "dry_base", "dry_allowed", "pick", "t", "min_p", "keys"]),
}


def test_the_ctypes_structs_have_the_headers_layout(tmp_path):
    """sizeof and every field's offset, as the C compiler lays the header's structs out."""
    compiler = shutil.which("gcc")
    if not compiler:
        pytest.skip("no C compiler")
    lines = [f'printf("{s} size %zu\\n", sizeof({s}));' for s in FIELDS]
    lines += [f'printf("{s} {f} %zu\\n", offsetof({s}, {f}));'
              for s, (_, fields) in FIELDS.items() for f in fields]
    source = tmp_path / "layout.c"
    source.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "specchat.h"\n'
                      "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    subprocess.run([compiler, "-I", str(kernels.CSRC), "-o", str(tmp_path / "layout"),
                    str(source)], check=True)
    got = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    c = {" ".join(line.split()[:2]): int(line.split()[2]) for line in got if line}
    for struct, (mirror, fields) in FIELDS.items():
        assert ctypes.sizeof(mirror) == c[f"{struct} size"], struct
        names = [name for name, _ in mirror._fields_]
        assert [n.rstrip("_") for n in names] == fields, struct  # `in_`: Python's keyword
        for name, field in zip(names, fields):
            assert getattr(mirror, name).offset == c[f"{struct} {field}"], (struct, field)
