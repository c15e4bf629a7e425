"""A shared demo under a hostile visitor, small (tests/share_load.py runs the full one): honest
visitors through the share tunnel, on the API and on the page's own route, keep their logins and
their fair turns while a hostile one floods the line from both and guesses their passwords with
forged X-Forwarded-For entries; a page visitor who stops or leaves mid-reply has it saved as
interrupted."""

import pytest

from share_load import owners, run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_hostile_visitor_neither_locks_out_nor_starves_the_honest_ones():
    honest, page, turns = 3, 2, 2
    figures = run(honest=honest, turns=turns, flood=12, tabs=4, guesses=6, seconds=120,
                  page=page, page_tabs=3, page_flood=6)
    print(figures.to_json(owners(honest, page)))
    assert figures.honest_statuses == {200: honest * turns}  # no 401, no 429, no time-out
    assert figures.login_statuses == {200: page + 2}  # the page's visitors and the leavers
    assert figures.page_outcomes == {"finished": page * turns}  # none refused or cut short
    assert figures.page_told_place > 0  # a waiting page reply shows its place in line
    assert figures.flood_statuses.get(429, 0) > 0  # the flood met its owner's limit
    assert set(figures.flood_statuses) <= {200, 429}
    assert figures.page_flood_outcomes.get("refused", 0) > 0  # ... on the page too
    assert set(figures.page_flood_outcomes) <= {"finished", "refused"}
    assert figures.guess_statuses.get(401, 0) > 0 and set(figures.guess_statuses) <= {401, 429}
    assert figures.login_guess_statuses.get(400, 0) > 0
    assert set(figures.login_guess_statuses) <= {400, 429}
    # each honest first token came within a fair round: one reply of every other owner
    assert figures.max_wait <= figures.fair_bound(owners(honest, page)) + 1.0
    assert figures.honest_saved == figures.honest_finished == (honest + page) * turns
    # Stop, and a page closed mid-reply: the reply so far is saved, marked interrupted
    assert figures.leavers_saved == {"stop": "stopped (interrupted)",
                                     "close": "cancelled (interrupted)"}
    # the server shares pytest's process here: what the run added stays small (alone, the
    # full script holds the whole process under 2 GB)
    assert figures.peak_rss_mb - figures.start_rss_mb < 512
