"""Seeded random interleavings of page and API requests against the real server (tests/soak.py):
no 5xx, every finished reply plain decoding's text, every 429 with its reason, a fresh request
answered in its usual time, resident memory flat after the first round. A failure names the
seed of its sequence: `python tests/soak.py --seed S --sequences 1` replays it."""

import os
import platform
import statistics

import pytest
from soak import ROUND, embedded_engine, run, tiny_engine

def check(report) -> None:
    print(report.to_json())
    assert not report.problems, f"replay with --seed {report.seeds[-1]}: {report.problems}"
    assert report.sequences >= ROUND and report.replies > 0 and report.refused > 0
    usual = statistics.median(report.probe_seconds[:ROUND])
    slowest = max(report.probe_seconds)
    assert slowest <= max(4 * usual, usual + 2.0), report.probe_seconds
    assert report.end_rss_mb <= 1.10 * report.first_round_rss_mb


@pytest.mark.usefixtures("one_thread")
def test_seeded_interleavings_on_tiny_models():
    check(run(tiny_engine(), sequences=60, seed=0, seconds=35.0))


@pytest.mark.slow
def test_seeded_interleavings_on_the_embedded_model():
    sequences = int(os.environ.get("SPECCHAT_SOAK_SEQUENCES", "200"))
    check(run(embedded_engine(), sequences=sequences, seed=1000, seconds=3600.0, tokens=32))


def test_the_servers_malloc_arenas_are_capped_unless_the_user_sets_them(monkeypatch):
    from specchat.runners.memory import limit_malloc_arenas
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False  # the user's own setting stands
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt's arena cap is glibc's")
    assert limit_malloc_arenas() is True
