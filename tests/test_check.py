"""`python -m specchat check`: every path with models built in code. On a CPU it runs at small
sizes in every test run, so it cannot rot before a GPU comes; under the `gpu` mark the same
checks run on CUDA (skipped without one)."""

import json
import os

import pytest
import torch

from specchat.check import CHECKS, run_checks
from specchat.cli import main
from specchat.core.events import KINDS


@pytest.fixture(scope="module")
def cpu_report():
    return {r["check"]: r for r in run_checks("cpu", small=True)}


@pytest.mark.parametrize("name", list(CHECKS))
def test_every_check_passes_on_the_cpu(cpu_report, name):
    result = cpu_report[name]
    assert result["ok"] is True, result


def test_the_cpu_check_proves_speculation_keeps_plain_decodings_text(cpu_report):
    for name in ("drafters_gemma3", "drafters_llama"):
        result = cpu_report[name]
        assert result["row_exact"] is True
        done, total = map(int, result["same_as_plain"].split("/"))
        assert done == total == 28  # 4 prompts x (greedy: 4 drafters + seeded: 3)
        drafters = {(r["mode"], r["drafter"]) for r in result["runs"]}
        assert drafters == {(m, d) for m in ("greedy", "seeded")
                            for d in ("ngram", "model", "head", "combined")}
        assert any(r["trees"] for r in result["runs"])  # the head's greedy trees ran
        assert set().union(*(r["kinds"] for r in result["runs"])) == set(KINDS)


def test_the_speed_check_times_plain_and_speculative_decoding(cpu_report):
    speed = cpu_report["speed_real_size"]
    assert speed["runs"]["plain"]["tokens"] == speed["runs"]["ngram"]["tokens"] == 32
    assert speed["runs"]["plain"]["steps"] == {0: [31, speed["runs"]["plain"]["step_ms"]]}
    assert speed["greedy_same_as_plain"] is True  # row-exact on every CPU path
    assert set(speed["verify"]["ms"]) == {1, 2, 3, 4, 5, 6, 8, 12, 16}
    assert speed["verify"]["vs_one_token"][1] == 1.0


def test_the_speed_check_profiles_a_forward_by_kernel(capsys):
    """`check --profile`: a forward of 1 and of 16 rows by kernel (on a CPU, the torch
    operations the profiler sees), each kernel's time, launches and share, in the JSON line and
    in the summary."""
    assert main(["check", "--device", "cpu", "--only", "speed_real_size", "--profile"]) == 0
    out, err = capsys.readouterr()
    speed = [json.loads(x) for x in out.splitlines()][-1]
    table = speed["kernels"]
    assert set(table["widths"]) == {"1", "16"} and table["time"].startswith("cpu")
    for width in table["widths"].values():
        rows = width["kernels"]
        assert rows and all(r["us"] > 0 and r["launches"] > 0 for r in rows)
        assert [r["us"] for r in rows] == sorted((r["us"] for r in rows), reverse=True)
        assert 0 < sum(r["share"] for r in rows) <= 1.001
    assert "by kernel" in err and "16 rows:" in err


def test_check_command_writes_one_json_line_per_check(tmp_path, capsys):
    out = tmp_path / "check.jsonl"
    code = main(["check", "--device", "cpu", "--only", "generate_json", "--out", str(out)])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    # generate_json needs a loaded target: its prerequisite ran too
    assert [x["check"] for x in lines] == ["environment", "load_llama", "generate_json"]
    assert code == 0 and all(x["ok"] for x in lines)
    assert capsys.readouterr().out.count("\n") == 3


def test_a_failing_check_is_reported_and_its_dependents_skipped(monkeypatch):
    def broken(ctx):
        raise RuntimeError("no such kernel")
    monkeypatch.setitem(CHECKS, "load_llama", broken)
    got = {r["check"]: r for r in run_checks("cpu", small=True,
                                             only=["generate_json", "environment"])}
    assert got["load_llama"]["ok"] is False
    assert got["load_llama"]["error"] == "RuntimeError: no such kernel"
    assert got["generate_json"] == {"check": "generate_json", "ok": None,
                                    "skipped": "load_llama failed"}


@pytest.fixture(scope="module")
def cuda_report():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return {r["check"]: r for r in run_checks("cuda")}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CHECKS))
def test_every_check_passes_on_cuda(cuda_report, name):
    assert cuda_report[name]["ok"] is True, cuda_report[name]


def test_without_the_device_the_check_says_so_once_and_skips_the_rest(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    got = list(run_checks("cuda"))
    assert got[0]["check"] == "environment" and got[0]["ok"] is False
    assert got[0]["error"] == "torch sees no CUDA GPU"
    assert [r["ok"] for r in got[1:]] == [None] * (len(CHECKS) - 1)
    assert {r["skipped"] for r in got[1:]} == {"environment failed"}


BARE = """
import importlib.abc, sys
class Bare(importlib.abc.MetaPathFinder):  # a lent GPU machine's image has none of these
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("sqlite_utils", "sqlite_fts4", "platformdirs", "gradio",
                                  "fastapi", "uvicorn"):
            raise ImportError(f"no module named {name!r} on this machine")
sys.meta_path.insert(0, Bare())
from specchat.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_check_starts_on_a_machine_without_the_apps_packages(tmp_path):
    """`python -m specchat check` imports only what it uses: without the stats store's, the
    page's and the API's packages its help prints and a CPU check runs (the API's check says
    it is skipped)."""
    import subprocess
    import sys

    env = {**os.environ, "SPECCHAT_CACHE": str(tmp_path)}
    run = [sys.executable, "-c", BARE, "check"]
    helped = subprocess.run([*run, "--help"], capture_output=True, text=True, env=env,
                            timeout=120)
    assert helped.returncode == 0 and "--shape" in helped.stdout, helped.stderr
    checked = subprocess.run([*run, "--device", "cpu", "--only", "load_llama", "--only",
                              "api_chat_completions"], capture_output=True, text=True,
                             env=env, timeout=600)
    lines = [json.loads(line) for line in checked.stdout.splitlines()]
    assert {line["check"]: line["ok"] for line in lines} == {
        "environment": True, "load_llama": True, "api_chat_completions": None}, checked.stderr
    assert lines[0]["sqlite_utils"] is False and lines[0]["gradio"] is False
