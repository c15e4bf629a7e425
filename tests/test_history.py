"""Drafting from what an owner said before (core/history.py): lookups see only the asking
owner's text, memory stays bounded, and replies drafted from history are plain decoding's."""

from test_engine import TOK, make_engine, run

from specchat.core.history import History
from specchat.drafters.ngram import NgramDrafter


def test_lookup_finds_the_latest_continuation_within_one_document():
    h = History(max_n=3)
    h.add("ada", [1, 2, 3, 4, 5])
    h.add("ada", [7, 2, 3, 9])
    assert h.lookup("ada", [0, 2, 3], 4) == (2, [9])  # the latest, cut at its document's end
    assert h.lookup("ada", [1, 2, 3], 2) == (3, [4, 5])  # the longest match first
    assert h.lookup("ada", [5, 7], 3) == (0, [])  # across two documents: no n-gram
    assert h.lookup("ada", [8, 3], 3) == (0, [])  # one token is no match
    assert h.lookup("ada", [2, 3], 0) == (0, [])


def test_an_owner_never_drafts_from_another_owners_text():
    h = History()
    h.add("ada", [1, 2, 3, 4, 5, 6])
    assert h.lookup("bob", [1, 2, 3], 3) == (0, [])
    assert h.lookup("", [1, 2, 3], 3) == (0, [])
    h.add("", [1, 2, 3, 4])  # nobody: nothing kept
    assert h.tokens("") == 0
    h.forget("ada")
    assert h.lookup("ada", [1, 2, 3], 3) == (0, [])


def test_memory_is_bounded_per_owner_and_in_owners():
    h = History(max_tokens=10, max_total=16, max_n=2)
    h.add("ada", [1, 2, 3, 4, 5, 6])
    h.add("ada", [11, 12, 13, 14, 15, 16])  # 12 tokens: the oldest document goes
    assert h.tokens("ada") == 6
    assert h.lookup("ada", [1, 2], 2) == (0, []) and h.lookup("ada", [11, 12], 2) == (2, [13, 14])
    h.add("ada", list(range(20, 40)))  # one document longer than the bound: its tail
    assert h.tokens("ada") == 10 and h.lookup("ada", [31, 32], 3) == (2, [33, 34, 35])
    h.add("bob", [1, 2, 3])
    h.lookup("ada", [31, 32], 1)  # a lookup does not count as use; an add does
    h.add("cy", [1, 2, 3, 4])  # 17 tokens in all: the owner added to least recently goes
    assert h.tokens("ada") == 0 and h.tokens("bob") == 3 and h.tokens("cy") == 4


def test_ngram_drafts_from_history_only_without_a_match_in_the_conversation():
    d = NgramDrafter()
    d.begin([5, 6, 7])
    history = History()
    history.add("ada", [40, 41, 42, 43, 44])
    d.use_history(lambda context, k: history.lookup("ada", context, k))
    assert d.draft_class([5, 6, 7, 40, 41]) == "history-2"
    ids, probs = d.propose([5, 6, 7, 40, 41], 3, None, None)
    assert ids.tolist() == [42, 43, 44] and probs is None
    # a match of two tokens in the conversation itself wins
    assert d.draft_class([5, 6, 7, 40, 41, 5, 6]) == 2
    assert d.propose([5, 6, 7, 40, 41, 5, 6], 1, None, None)[0].tolist() == [7]
    d.use_history(None)  # a request without an owner
    d.begin([5, 6, 7])
    assert d.draft_class([5, 6, 7, 40, 41]) == 0


def test_combined_takes_history_matches_of_three_tokens_and_the_head_below():
    from specchat.drafters.combined import CombinedDrafter

    class Head:  # stands in for the EAGLE head: combined only asks it to draft
        def use_history(self, lookup):
            pass

        def begin(self, prompt_ids):
            pass

    ngram = NgramDrafter()
    combined = CombinedDrafter(ngram, Head())
    history = History()
    history.add("ada", [40, 41, 42, 43, 44, 45])
    combined.begin([5, 6, 7])
    combined.use_history(lambda context, k: history.lookup("ada", context, k))
    assert combined.draft_class([5, 6, 7, 40, 41]) == "head"
    assert combined.draft_class([5, 6, 7, 40, 41, 42]) == "history-3"
    assert combined.propose([5, 6, 7, 40, 41, 42], 2, None, None)[0].tolist() == [43, 44]


def test_a_reply_drafts_from_its_owners_last_reply_and_stays_plain_decoding():
    engine = make_engine()
    prompt = "the quick brown fox"
    first, _, _ = run(engine, prompt, owner="ada", speculation=False, max_new_tokens=32)
    lookups = []
    real = engine.history.lookup

    def spy(owner, context, k):
        found = real(owner, context, k)
        lookups.append((owner, found[0]))
        return found

    engine.history.lookup = spy
    for owner in ("ada", "bob"):
        lookups.clear()
        again, steps, _ = run(engine, prompt, owner=owner, drafter="ngram", max_new_tokens=32)
        assert [t.id for t in again] == [t.id for t in first]  # greedy: plain's reply
        if owner == "ada":  # the same prompt again: its reply drafts from the last one
            assert any(n for _, n in lookups) and sum(s.accepted for s in steps) >= 8
        else:
            assert lookups and not any(n for _, n in lookups)  # bob has no history
    assert engine.history.tokens("bob") > 0  # and now he has
    # a reply with remember=False leaves the history as it was
    before = engine.history.tokens("cy")
    run(engine, prompt, owner="cy", remember=False, max_new_tokens=8)
    assert engine.history.tokens("cy") == before == 0


def test_seeded_sampled_replies_with_history_are_plain_sampling():
    engine = make_engine()
    prompt = TOK.decode(TOK("a b c d e f")["input_ids"])
    cfg = dict(temperature=0.9, seed=3, max_new_tokens=24)
    plain, _, _ = run(engine, prompt, owner="ada", speculation=False, **cfg)
    spec, _, _ = run(engine, prompt, owner="ada", drafter="ngram", **cfg)
    assert [t.id for t in spec] == [t.id for t in plain]
    assert engine.history.tokens("ada") > 0
