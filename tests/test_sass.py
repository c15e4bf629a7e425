"""The NF4 kernel's machine code read without a GPU (runners/cuda/sass.py): Triton compiles it
for sm_90 on this CPU machine and its wheel's nvdisasm reads the cubin; the report finds the K
loop and counts what decides how a step decodes. (In a process of its own: the tests run the
kernels interpreted, and an interpreted kernel does not compile.)"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

COUNT = """
import json, sys
from specchat.runners.cuda import kernels, sass
out = {}
for name, k, config in [("gather", 4096, (32, 256, 4, 4, 3, 1)),
                        ("table", 4096, (32, 256, 4, 4, 3, 0)),
                        ("one step", 2048, (32, 256, 8, 4, 3, 1)),
                        ("permute", 4096, (64, 256, 4, 4, 3, 2)),
                        ("elementwise", 4096, (64, 256, 4, 4, 3, 3)),
                        ("halves", 4096, (64, 256, 4, 4, 3, 4))]:
    compiled = sass.compile_nf4(kernels.NF4Config(*config), k, arch=90)
    out[name] = {**sass.counts(sass.disassemble(compiled.asm["cubin"]), config[1]),
                 "shared_bytes": compiled.metadata.shared}
out["consumers"] = [len(c.asm["cubin"]) for c in sass.compile_consumers(90)]
print(json.dumps(out))
"""


def test_the_k_loop_and_its_shared_memory_traffic_are_counted():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COUNT], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    c = json.loads(done.stdout.splitlines()[-1])
    gather, table, one, permute = c["gather"], c["table"], c["one step"], c["permute"]
    elementwise = c["elementwise"]
    for counted in (gather, table, permute, elementwise, c["halves"]):
        assert not counted["unrolled"] and counted["mma"] > 0 and counted["registers"] > 0
        assert counted["loop_instructions"] > counted["mma"]
        assert sum(counted["global_loads_by_bytes"].values()) > 0
    # the two decodes differ where it matters: the codebook gathered from shared memory after
    # barriers (DECODE 1), the pair table read from global memory (DECODE 0)
    assert gather["LDS"] + gather["LDSM"] > 0 and gather["BAR.SYNC"] > table["BAR.SYNC"]
    assert gather["shared_bytes"] > 0
    # the byte permutes decode in registers, no codebook in shared memory: fewer barriers
    # than the gather's (what shared memory the loop reads is the pipeline's staged loads)
    assert permute["BAR.SYNC"] < gather["BAR.SYNC"]
    # codes decoded and scaled elementwise, one product a step: one hand-over of the weights
    # to the MMA, fewer barriers than the permutes' block by block
    assert elementwise["BAR.SYNC"] < permute["BAR.SYNC"]
    # ... and with a step's K in two halves, its codes and x load 16 bytes a load (the only
    # narrower ones: the absmax), in fewer instructions, with two barriers an iteration
    halves = c["halves"]
    assert halves["BAR.SYNC"] <= 2 and halves["mma"] == elementwise["mma"]
    assert set(halves["global_loads_by_bytes"]) <= {"4", "16"}
    assert elementwise["global_loads_by_bytes"]["1"] > 0  # a byte a code
    assert halves["loop_instructions"] < elementwise["loop_instructions"]
    # the kernels that add a split product's planes compile for the GPU too
    assert len(c["consumers"]) == 4 and all(size > 0 for size in c["consumers"])
    # 2048 codes in 8 slices: one step of K a program, no loop; the kernel is its iteration
    assert one["unrolled"] and one["mma"] > 0
