"""The same request gives the same text whatever ran before it: a prompt is encoded the same
way fresh or after any other request (whole pages, then row-exact forwards), and a cached token
is reused only where this prompt would have computed it the same way. Forced on every CPU path
this machine runs whose verifies are row-exact, with prompts longer than a page."""

import pytest
import torch

from specchat.core.engine import Engine
from specchat.core.events import TokenEvent
from specchat.core.request import GenerateConfig
from specchat.drafters.ngram import NgramDrafter
from specchat.models import runtime
from specchat.models.load import load_model
from specchat.models.synthetic import byte_tokenizer, save, tiny_gemma3, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

PATHS = [p.name for p in runtime.candidates(forced="")]
# Byte tokens: prompts of 90 to 200 tokens, across one to three pages of 64.
STORY = ("The lighthouse keeper counted the ships that passed each night and wrote their names "
         "in a book. ")
PROMPTS = [STORY + "One winter a ship with no name came by.",
           STORY * 2 + "Then the lamp went out.",
           STORY[:40]]


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def checkpoint(request, tmp_path_factory):
    model = tiny_gemma3(0, hidden=128) if request.param == "gemma3" else tiny_llama(1, hidden=128)
    return save(model, byte_tokenizer(), tmp_path_factory.mktemp(request.param))


def _engine(checkpoint, path: str, monkeypatch) -> Engine:
    monkeypatch.setenv(runtime.ENV, path)
    target = load_model(str(checkpoint), "nf4", "cpu", progress=lambda *_: None)
    if not target.row_exact:
        pytest.skip(f"{path} is not row-exact here: {target.runtime.proof}")
    return Engine(target, {"ngram": NgramDrafter()})


def _record_widths(engine: Engine, then=None, asked: list | None = None) -> list[int]:
    """The rows of each target forward from now on (`then()` runs after each is recorded;
    `asked`: the logits' rows each asked for)."""
    widths, forward = [], engine._forward

    def record(ids, n):
        widths.append(len(ids))
        if asked is not None:
            asked.append(n)
        if then is not None:
            then()
        return forward(ids, n)
    engine._forward = record
    return widths


def _reply(engine: Engine, prompt, speculation: bool, **cfg) -> list[int]:
    ids = engine.text_prompt(prompt)[0] if isinstance(prompt, str) else prompt
    cfg = GenerateConfig(max_new_tokens=24, speculation=speculation, drafter="ngram",
                         **{"temperature": 0.0, **cfg})
    return [e.id for e in engine.stream(ids, cfg) if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("path", PATHS)
def test_the_same_request_gives_the_same_text_whatever_ran_before(checkpoint, path,
                                                                    monkeypatch):
    engine = _engine(checkpoint, path, monkeypatch)
    for prompt in PROMPTS:
        engine.reset_cache()
        fresh = _reply(engine, prompt, False)
        histories = [[], [prompt], [p for p in PROMPTS if p != prompt], [prompt + " And so"]]
        for before in histories:
            for speculation in (False, True):
                engine.reset_cache()
                for other in before:
                    _reply(engine, other, not speculation)
                assert _reply(engine, prompt, speculation) == fresh, (prompt[:30], before)


@pytest.mark.parametrize("path", PATHS)
def test_a_conversation_continued_reads_as_if_encoded_fresh(checkpoint, path, monkeypatch):
    """Turn 2's prompt holds turn 1's prompt and reply (decoded row by row): it reuses the
    cache where that equals a fresh encoding and re-encodes the rest, so turn 2's reply equals
    the one a fresh engine gives, sampled with a seed too."""
    engine = _engine(checkpoint, path, monkeypatch)
    for temperature in (0.0, 0.8):
        ids = engine.text_prompt(PROMPTS[0])[0]
        engine.reset_cache()
        first = _reply(engine, ids, True, temperature=temperature, seed=3)
        second = ids + first + engine.text_prompt(" The keeper said:")[0]
        continued = _reply(engine, second, True, temperature=temperature, seed=3)
        engine.reset_cache()
        assert _reply(engine, second, False, temperature=temperature, seed=3) == continued


def test_prompts_are_encoded_in_whole_pages_then_narrow_forwards(checkpoint, monkeypatch):
    engine = _engine(checkpoint, PATHS[0], monkeypatch)
    asked = []
    widths = _record_widths(engine, asked=asked)
    ids = engine.text_prompt(STORY * 3)[0][:178]  # two pages, then 50
    list(engine.stream(ids, GenerateConfig(max_new_tokens=1, speculation=False)))
    assert widths == [64, 64, 50]
    assert asked == [0, 0, 1]  # the last forward's logits only
    # The same prompt again: the pages are kept, the last token re-fed, as a fresh run of the
    # last 50 would compute it.
    widths.clear()
    list(engine.stream(ids, GenerateConfig(max_new_tokens=1, speculation=False)))
    assert widths == [1]
    # A longer prompt that fills the third page: the 50 narrow tokens are re-encoded with it.
    widths.clear()
    longer = engine.text_prompt(STORY * 3)[0][:208]
    list(engine.stream(longer, GenerateConfig(max_new_tokens=1, speculation=False)))
    assert widths == [64, 16]


@pytest.mark.parametrize("path", PATHS)
def test_a_page_whose_logits_nobody_reads_gets_none_and_changes_nothing_else(checkpoint, path,
                                                                              monkeypatch):
    """A prompt's pages before its last forward ask for no logits (`Runner.forward`'s
    n_logits 0: the CPU runner skips its LM head); the cache they leave is the same."""
    runner = _engine(checkpoint, path, monkeypatch).runner
    ids = list(range(3, 83))
    after = []
    for n in (0, 1):
        cache = runner.new_cache()
        assert runner.forward(cache, ids[:64], 0, n).shape[0] == n
        after.append(runner.forward(cache, ids[64:], 64, 3))
    assert torch.equal(after[0], after[1])


def test_verifies_stay_narrower_than_a_page(checkpoint, monkeypatch):
    engine = _engine(checkpoint, PATHS[0], monkeypatch)
    widths = _record_widths(engine)
    ids = engine.text_prompt(STORY * 3)[0][:150]  # two pages, then 22
    list(engine.stream(ids, GenerateConfig(max_new_tokens=80, draft_len=16, adaptive=False,
                                           drafter="ngram")))
    assert widths[:3] == [64, 64, 22]
    assert max(widths[3:]) == 17  # k = 16 drafts and the newest token


def test_the_prefix_store_gives_whole_pages_to_prompts_that_start_the_same(checkpoint,
                                                                           monkeypatch):
    """A prompt whose first pages an earlier prompt encoded takes them from the store (the
    engine's cache held another conversation in between), and replies as a fresh engine
    does; the store keeps at most its token budget, least recently used out first."""
    engine = _engine(checkpoint, PATHS[0], monkeypatch)
    preamble = STORY * 2  # 193 byte tokens with BOS: three pages
    first = _reply(engine, preamble + "Who kept the book?", False)
    assert [len(ids) for ids in engine.prefixes.entries] == [192]
    _reply(engine, "Something else entirely.", False)  # the cache now holds this one
    widths = _record_widths(engine)
    second = _reply(engine, preamble + "What did he see?", True)
    assert engine.prefixes.hits == 1 and widths[0] == len(engine.text_prompt(
        preamble + "What did he see?")[0]) - 192
    del engine._forward  # the class's own again
    engine.reset_cache()
    engine.prefixes.clear()
    assert _reply(engine, preamble + "What did he see?", False) == second
    assert _reply(engine, preamble + "Who kept the book?", False) == first

    engine.prefixes.max_tokens = 200  # room for one entry of three pages
    _reply(engine, STORY[::-1] * 2, False)
    assert [ids[:3] for ids in engine.prefixes.entries] == [tuple(
        engine.text_prompt(STORY[::-1])[0][:3])]


def test_a_stop_during_prompt_encoding_ends_the_request_between_pages(checkpoint, monkeypatch):
    """A client that leaves while a long prompt is encoded frees the engine at the next page;
    what was encoded stays usable, and the same request later replies as a fresh engine does."""
    import threading

    from specchat.core.events import GenerationStats
    engine = _engine(checkpoint, PATHS[0], monkeypatch)
    ids = engine.text_prompt(STORY * 3)[0]  # four pages and a rest
    stop = threading.Event()
    widths = _record_widths(engine, then=stop.set)  # the client leaves during the first page
    events = list(engine.stream(ids, GenerateConfig(max_new_tokens=8), stop_event=stop))
    assert widths == [64] and len(events) == 1
    stats = events[0]
    assert isinstance(stats, GenerationStats)
    assert stats.stop_reason == "stopped" and stats.new_tokens == 0 and stats.prefill_tokens == 64
    del engine._forward
    again = _reply(engine, ids, True)
    engine.reset_cache()
    engine.prefixes.clear()
    assert again == _reply(engine, ids, False)


def test_prompts_that_share_their_first_pages_share_them_in_the_store(checkpoint, monkeypatch):
    """Two prompts of four whole pages with the same two first pages: the store holds six
    pages, not eight, and each prompt still takes its four pages and replies as a fresh engine
    does. Over its budget, a prompt's last pages leave before the pages they continue."""
    engine = _engine(checkpoint, PATHS[0], monkeypatch)
    common = (STORY * 2)[:140]  # with BOS, two pages and 13 tokens
    a = common + "Who kept the book? " + STORY + "It was late."
    b = common + "What did he see??? " + STORY + "It was late."
    ids_a, ids_b = engine.text_prompt(a)[0], engine.text_prompt(b)[0]
    assert ids_a[:128] == ids_b[:128] and ids_a[128:192] != ids_b[128:192]
    assert 256 < len(ids_a) < 320
    first_a, first_b = _reply(engine, a, False), _reply(engine, b, False)
    store = engine.prefixes
    assert store.tokens == 6 * 64 and sorted(map(len, store.entries)) == [256, 256]
    engine.reset_cache()
    widths = _record_widths(engine)
    assert _reply(engine, a, True) == first_a
    assert store.hits == 1 and widths[0] == len(ids_a) - 256  # only the rest encoded
    store.max_tokens = 4 * 64  # b's own last two pages go first (a was used last)
    store.add(ids_a, engine._cache, 256)
    assert store.tokens == 4 * 64 and store.longest(ids_b, 256)[1] == 128
    del engine._forward
    engine.reset_cache()
    assert _reply(engine, b, True) == first_b
