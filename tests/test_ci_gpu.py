"""`.ci/gpu`'s plumbing, dry on the CPU (SPECCHAT_GPU_DRY_RUN): every stage runs in order under
its own time limit with its own log in $OUT, a stage that fails or runs out of time does not stop
the next, and stages.txt says how each ended. What the stages measure needs the GPU."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["1-environment", "2-speed-8b", "3-check", "4-speed-1b", "5-sweep"]


def test_every_stage_runs_under_its_limit_and_writes_its_log(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "SPECCHAT_GPU_DRY_RUN": "1",
           "SPECCHAT_GPU_STAGE_LIMIT": "8", "PYTHON": sys.executable,
           "SPECCHAT_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(["bash", str(ROOT / ".ci" / "gpu")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ended = dict(line.split(": ", 1) for line in (out / "stages.txt").read_text().splitlines())
    assert list(ended) == STAGES  # in order, every one, whatever the ones before did
    assert ended["1-environment"] == "exit 0"
    assert '"check": "environment"' in (out / "1-environment.log").read_text()
    assert "timed out after 8 s" in ended.values()  # the heavy stages, cut at the limit
    assert ended["5-sweep"] == "exit 2"  # no CUDA GPU here: it says so and the run goes on
    assert "needs a CUDA GPU" in (out / "5-sweep.log").read_text()
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(["stages.txt", *(f"{s}.log" for s in STAGES)]) and len(files) <= 8
    assert "done:" in done.stdout
