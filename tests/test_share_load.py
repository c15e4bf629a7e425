"""A shared demo under a hostile visitor, small (tests/share_load.py runs the full one): honest
visitors through the share tunnel keep their logins and their fair turns while a hostile one
floods the line and guesses their passwords with forged X-Forwarded-For entries."""

import pytest

from share_load import HOSTILE_KEYS, run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_hostile_visitor_neither_locks_out_nor_starves_the_honest_ones():
    honest, turns = 3, 2
    figures = run(honest=honest, turns=turns, flood=12, tabs=4, guesses=6, seconds=120)
    print(figures.to_json(honest + len(HOSTILE_KEYS)))
    assert figures.honest_statuses == {200: honest * turns}  # no 401, no 429, no time-out
    assert figures.flood_statuses.get(429, 0) > 0  # the flood met its owner's limit
    assert set(figures.flood_statuses) <= {200, 429}
    assert figures.guess_statuses.get(401, 0) > 0 and set(figures.guess_statuses) <= {401, 429}
    # each honest first token came within a fair round: one reply of every other owner
    assert max(figures.honest_waits) <= figures.fair_bound(honest + len(HOSTILE_KEYS)) + 1.0
    assert figures.honest_saved == figures.honest_finished == honest * turns
    # the server shares pytest's process here: what the run added stays small (alone, the
    # full script holds the whole process under 2 GB)
    assert figures.peak_rss_mb - figures.start_rss_mb < 512
