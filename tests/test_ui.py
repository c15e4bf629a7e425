"""The chat page's handlers on a tiny random model pair, without a browser: streaming renders
exactly the engine's tokens and kinds, Stop leaves a consistent conversation, caps hold
server-side, errors stay readable, the race runs every drafter and records each run."""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
from html.parser import HTMLParser

import gradio as gr
import pytest
from tiny import byte_tokenizer, loaded, tiny_llama

from specchat import app as launcher
from specchat.core.engine import Engine
from specchat.core.events import GenerationStats, StepRecord, TokenEvent
from specchat.core.request import GenerateConfig
from specchat.drafters.model import ModelDrafter
from specchat.drafters.ngram import NgramDrafter
from specchat.engine_queue import EngineQueue
from specchat.loader import LoadReport
from specchat.stats.speedup import ESTIMATE, Speedup
from specchat.stats.store import StatsStore
from specchat.ui.handlers import BUSY, ONE_AT_A_TIME, ChatApp, first_difference, race_verdict
from specchat.ui.render import markup_ranges, render_history, render_tokens, status_html
from specchat.ui.state import Limits, ModelSlot, Session, Settings


@pytest.fixture(scope="module")
def engine():
    """Target and draft share weights, so greedy drafts are accepted: accepted + bonus kinds."""
    tok = byte_tokenizer()
    return Engine(loaded(tiny_llama(0), tok),
                  {"ngram": NgramDrafter(), "model": ModelDrafter(tiny_llama(0), len(tok))})


@pytest.fixture
def store():
    s = StatsStore(":memory:")
    yield s
    s.close()


@pytest.fixture
def spy(engine, monkeypatch):
    """Every event the engine yields, per call of engine.stream."""
    calls: list[list] = []
    real = Engine.stream

    def stream(self, *args, **kwargs):
        events = []
        calls.append(events)
        for event in real(self, *args, **kwargs):
            events.append(event)
            yield event

    monkeypatch.setattr(Engine, "stream", stream)
    return calls


def make_app(engine, store=None, **limits) -> ChatApp:
    return ChatApp(engine, store, Limits(**limits) if limits else None, min_interval=0.0)


def send(app, session, text, settings=None):
    """user() then every yield of bot(): the list of (chat, session, notice) updates. By default
    k is fixed: on this pair a draft token costs a target step, so the adaptive policy may rightly
    decode plainly, and these tests check what the page shows of drafted tokens."""
    box, chat, session, notice = app.user(text, session)
    assert box == "" and notice == "", notice
    return list(app.bot(session, settings or Settings(max_new_tokens=24, seed=0, adaptive=False)))


class Spans(HTMLParser):
    """(css classes, title, text) of every token span in rendered HTML."""

    def __init__(self, markup: str):
        super().__init__(convert_charrefs=True)
        self.spans, self._open = [], None
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "span" and "tk" in (attrs.get("class") or "").split():
            self._open = [attrs["class"].split(), attrs.get("title", ""), ""]

    def handle_data(self, data):
        if self._open is not None:
            self._open[2] += data

    def handle_endtag(self, tag):
        if tag == "span" and self._open is not None:
            self.spans.append(tuple(self._open))
            self._open = None


def char_kinds_from_html(markup: str) -> list[tuple[str, str]]:
    out = []
    for classes, _, text in Spans(markup).spans:
        kind = next(c[3:] for c in classes if c.startswith("tk-"))
        out += [(ch, kind) for ch in text]
    return out


def char_kinds_from_events(events) -> list[tuple[str, str]]:
    return [(ch, e.kind) for e in events if isinstance(e, TokenEvent) for ch in e.text]


def test_stream_grows_and_matches_engine_events(engine, store, spy):
    app = make_app(engine, store)
    session = Session()
    updates = send(app, session, "Hello <b>there</b> & welcome")
    assert len(spy) == 1
    events = spy[0]
    assert sum(isinstance(e, TokenEvent) for e in events) > 3
    lengths = []
    for chat, state, _ in updates:
        assert [m["role"] for m in chat] == ["user", "assistant"]
        assert "&lt;b&gt;there&lt;/b&gt; &amp; welcome" in chat[0]["content"]  # escaped
        lengths.append(len(char_kinds_from_html(chat[1]["content"])))
    assert lengths == sorted(lengths) and lengths[-1] > lengths[0], "the reply grows"
    assert len(set(lengths)) > 2, "several repaints while streaming"

    final = updates[-1][0][1]["content"]
    assert char_kinds_from_html(final) == char_kinds_from_events(events)
    kinds = {k for _, k in char_kinds_from_events(events)}
    assert len(kinds) >= 2, kinds  # accepted and bonus (draft = target)
    # Every span names its kind and step in a tooltip: "kind · step N · accepted a/d".
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    spec = next(t for t in tokens if t.step_drafted)
    titles = {title for _, title, _ in Spans(final).spans}
    assert (f"{spec.kind} · step {spec.step} · accepted {spec.step_accepted}/"
            f"{spec.step_drafted}") in titles
    # The conversation state holds exactly what the engine emitted, and it was recorded.
    turn = session.turns[0]
    assert turn.tokens == tokens and turn.stats is events[-1]
    assert turn.reply == "".join(t.text for t in tokens)
    assert 'class="sc-stats"' in final and f"{turn.stats.new_tokens}</b> tokens" in final
    assert app.writer.flush(10)
    rows = store.turns(session.conversation_id)
    assert [r["reply"] for r in rows] == [turn.reply] and rows[0]["speculation"]


def stats_line_of(message: dict) -> str:
    return re.search(r'<div class="sc-stats">.*?</div>', message["content"]).group(0)


def test_a_reply_shows_an_estimate_with_its_band_never_a_ratio_to_another_prompt(engine, store):
    app = make_app(engine, store)
    session = Session()
    # A plain reply of one prompt, then a speculative reply of another.
    send(app, session, "a plain reply", Settings(speculation=False, max_new_tokens=16, seed=1))
    chat = send(app, session, "another prompt", Settings(max_new_tokens=24, seed=1))[-1][0]
    plain, spec = session.turns
    figure = spec.speedup
    assert figure.basis == ESTIMATE and figure.low <= figure.value <= figure.high
    line = stats_line_of(chat[3])
    assert (f'<b>≈{figure.value:.2f}×</b> est. ({figure.low:.2f}–{figure.high:.2f}×)'
            in line)
    assert "tokens per target pass" in line and "An estimate, not a measurement" in line
    assert 'class="sc-speedup"' not in line  # not shown as a measured speedup
    # Not the two prompts' ratio, and not priced by the other reply's speed.
    cross = spec.stats.tokens_per_s / plain.stats.tokens_per_s
    estimate = f"{figure.value:.2f}×</b> est. ({figure.low:.2f}–{figure.high:.2f}×)"
    assert f"{cross:.2f}×" not in line.replace(estimate, "")
    assert "speculation off" in stats_line_of(chat[1])
    assert {k for _, k in char_kinds_from_html(chat[1]["content"])} == {"target"}


def test_a_shown_figure_is_stored_with_its_turn_and_never_changes(engine, store):
    app = make_app(engine, store)
    session = Session()
    first = stats_line_of(send(app, session, "one", Settings(max_new_tokens=16, seed=1))[-1][0][1])
    shown = session.turns[0].speedup
    send(app, session, "two", Settings(speculation=False, max_new_tokens=16, seed=1))
    send(app, session, "three", Settings(max_new_tokens=16, seed=2))
    replayed = list(app.race(session, Settings(max_new_tokens=16, seed=5)))[-1]
    assert replayed[2] == gr.skip()  # the race leaves the chat as it is
    chat = send(app, session, "four", Settings(max_new_tokens=16, seed=3))[-1][0]
    assert stats_line_of(chat[1]) == first and session.turns[0].speedup == shown
    assert app.writer.flush(10)
    row = store.turns(session.conversation_id)[0]
    assert Speedup.from_row(row) == shown


def test_stop_mid_stream_keeps_a_consistent_conversation(engine, store):
    app = make_app(engine, store)
    session = Session()
    app.user("tell me a long story", session)
    updates = app.bot(session, Settings(max_new_tokens=400, seed=3, speculation=False))
    next(updates)  # the echo with an empty reply and a cursor
    chat, _, _ = next(updates)  # a first repaint with some tokens
    assert "sc-cursor" in chat[-1]["content"]
    assert app.stop() == "Stopping after the current step…"
    rest = list(updates)
    chat = rest[-1][0]
    turn = session.turns[-1]
    assert turn.stats.stop_reason == "stopped"
    assert 0 < turn.stats.new_tokens < 400 and len(turn.tokens) == turn.stats.new_tokens
    assert "".join(ch for ch, _ in char_kinds_from_html(chat[-1]["content"])) == turn.reply
    assert "stopped by you" in chat[-1]["content"] and "sc-cursor" not in chat[-1]["content"]
    assert app.writer.flush(10)
    row = store.turns(session.conversation_id)[-1]
    assert row["interrupted"] and row["stop_reason"] == "stopped" and row["reply"] == turn.reply
    # The chat goes on: the next prompt includes the partial reply as an assistant message.
    send(app, session, "and then?")
    assert [t.user for t in session.turns] == ["tell me a long story", "and then?"]
    messages, _ = app.prompt_messages(session, 1, "")
    assert messages[1] == {"role": "assistant", "content": turn.reply}
    assert app.stop() == ""  # nothing running any more


def test_empty_and_too_long_messages_are_refused_with_the_text_kept(engine):
    app = make_app(engine, max_input_chars=20)
    session = Session()
    box, chat, session, notice = app.user("   \n", session)
    assert "empty" in notice and box == "   \n" and session.pending is None and chat == []
    long = "x" * 21
    box, chat, session, notice = app.user(long, session)
    assert box == long and session.pending is None and chat == []
    assert "21 characters" in notice and "limit here is 20" in notice
    # Nothing pending: the bot step that follows the echo does nothing.
    assert len(list(app.bot(session, Settings()))) == 1 and session.turns == []


def test_max_new_tokens_and_other_settings_are_capped_server_side(engine):
    app = make_app(engine, max_new_tokens_cap=8)
    cfg, notes = app.config(Settings(max_new_tokens=5000, temperature=9, seed=-1,
                                     drafter="model"))
    assert cfg.max_new_tokens == 8 and "capped at 8" in notes[0]
    assert cfg.temperature == 2.0 and "Temperature capped" in notes[1] and cfg.seed >= 0
    session = Session()
    updates = send(app, session, "hi", Settings(max_new_tokens=5000))
    assert session.turns[0].stats.new_tokens <= 8
    assert "capped at 8" in updates[-1][2] and "capped at 8" in updates[-1][0][1]["content"]


def test_system_prompt_is_used_and_capped(engine):
    app = make_app(engine, max_input_chars=10)
    session = Session()
    send(app, session, "hi")
    notes: list[str] = []
    system = app.system_prompt(Settings(system="be brief and kind"), notes)
    assert system == "be brief a" and "System prompt cut to 10" in notes[0]
    messages, _ = app.prompt_messages(session, 0, system)
    assert messages[0] == {"role": "system", "content": "be brief a"}


def test_missing_draft_model_falls_back_to_ngram(engine):
    tok = engine.tokenizer
    ngram_only = Engine(engine.target, {"ngram": NgramDrafter()})
    assert tok is ngram_only.tokenizer
    cfg, notes = make_app(ngram_only).config(Settings(drafter="model"))
    assert cfg.drafter == "ngram" and "N-gram" in notes[0] and "Draft model" in notes[0]


def test_retry_undo_and_new_conversation(engine):
    app = make_app(engine)
    session = Session()
    send(app, session, "first")
    send(app, session, "second")
    chat, session, _ = app.retry(session)
    assert session.pending == "second" and len(session.turns) == 1 and len(chat) == 3
    list(app.bot(session, Settings(max_new_tokens=8, seed=0)))
    assert [t.user for t in session.turns] == ["first", "second"]
    box, chat, session, _ = app.undo(session)
    assert box == "second" and len(session.turns) == 1 and len(chat) == 2
    box, chat, fresh, *_ = app.new_conversation(session)
    assert chat == [] and fresh.turns == [] and fresh.conversation_id is None


def test_engine_error_is_shown_and_the_app_keeps_working(engine, monkeypatch):
    app = make_app(engine)
    session = Session()
    real = Engine.stream

    def broken(self, ids, cfg, stop_event=None):
        events = real(self, ids, cfg, stop_event)
        yield next(events)
        raise RuntimeError("CUDA error: device-side assert")

    monkeypatch.setattr(Engine, "stream", broken)
    chat = send(app, session, "boom")[-1][0]
    assert "Engine error: RuntimeError: CUDA error" in chat[-1]["content"]
    assert session.turns[0].stats.stop_reason == "error" and len(session.turns[0].tokens) == 1
    monkeypatch.setattr(Engine, "stream", real)
    chat = send(app, session, "again")[-1][0]
    assert session.turns[1].stats.stop_reason in ("length", "eos") and "Engine error" not in \
        chat[-1]["content"]


def test_out_of_memory_reported_by_the_engine_reads_well(engine, monkeypatch):
    app = make_app(engine)

    def oom(self, ids, cfg, stop_event=None):
        yield GenerationStats(stop_reason="error", error="out of memory: tried to allocate 2 GiB")

    monkeypatch.setattr(Engine, "stream", oom)
    session = Session()
    chat = send(app, session, "big")[-1][0]
    assert "Out of memory while generating" in chat[-1]["content"]
    assert "max new tokens" in chat[-1]["content"]


def test_the_race_runs_every_drafter_and_records_each_against_the_plain_run(engine, store):
    app = make_app(engine, store)
    session = Session()
    chat = send(app, session, "compare me", Settings(max_new_tokens=16, seed=0))[-1][0]
    # k fixed: on this tiny pair a draft token costs a target step, so the adaptive policy may
    # rightly decode 16 tokens plainly, and a run with speculation on would show one kind
    updates = list(app.race(session, Settings(max_new_tokens=16, seed=5, adaptive=False)))
    runs, verdict, unchanged, session, _ = updates[-1]
    # plain first, then the drafters best first: the draft model, n-gram lookup
    for mode in ("plain", "model", "ngram"):
        assert f"sc-race-run sc-race-{mode}" in runs
    assert runs.index("sc-race-plain") < runs.index("sc-race-model") < runs.index(
        "sc-race-ngram")
    plain = runs[runs.index("sc-race-plain"):runs.index("sc-race-model")]
    model = runs[runs.index("sc-race-model"):runs.index("sc-race-ngram")]
    assert {k for _, k in char_kinds_from_html(plain)} == {"target"}
    assert len({k for _, k in char_kinds_from_html(model)}) >= 2
    text = re.sub(r"<[^>]+>", " ", verdict)
    for label in ("speculation off", "draft model", "n-gram lookup"):
        assert label in text
    assert text.count("✓ identical") == 2  # fp32 greedy: exact
    assert app.writer.flush(10)
    rows = store.turns(session.conversation_id)
    assert [(r["speculation"], r["drafter"]) for r in rows[1:]] == [
        (False, "none"), (True, "model"), (True, "ngram")]
    for row in rows[2:]:  # each drafter's run timed against the race's plain run
        assert row["baseline_turn_id"] == rows[1]["id"] and row["speedup_basis"] == "ab"
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / rows[1]["tokens_per_s"])
        assert f"{row['speedup']:.2f}×" in text  # the figure stored with it
    assert {r["seed"] for r in rows[1:]} == {5}
    # The chat is unchanged: its reply keeps the figure it was shown with.
    assert unchanged == gr.skip() and render_history(session)[1] == chat[1]
    assert len(session.turns) == 1 and rows[0]["speedup_basis"] != "ab"


def test_the_race_drafts_from_the_prompt_alone(engine):
    """The reply a race replays is in its owner's drafting history: no run may copy it."""
    app = make_app(engine)
    session = Session()
    send(app, session, "the cat sat on the mat", Settings(max_new_tokens=16, seed=0))
    seen = []
    lookup = engine.history.lookup
    engine.history.lookup = lambda *a, **k: seen.append(a) or lookup(*a, **k)
    try:
        list(app.race(session, Settings(max_new_tokens=16, seed=5, adaptive=False)))
    finally:
        engine.history.lookup = lookup
    assert seen == []


def test_the_race_needs_a_prompt(engine):
    *_, notice = list(make_app(engine).race(Session(), Settings()))[-1]
    assert "Send a message first" in notice


def test_the_race_names_a_winner_only_where_its_band_clears_the_others():
    from specchat.core.race import Lane
    from specchat.stats.race import Entry

    def run(mode, seconds, accepted, tokens):
        steps = [StepRecord(i + 1, accepted, accepted, accepted + 1, 0.0, t)
                 for i, t in enumerate(seconds)]
        n = sum(s.emitted for s in steps)
        stats = GenerationStats(new_tokens=n, seconds=sum(seconds), tokens_per_s=n / sum(seconds),
                                stop_reason="length", speculation=mode != "plain",
                                drafted=accepted * len(steps), accepted=accepted * len(steps),
                                mean_accepted_len=accepted + 1.0, drafter=mode)
        return Entry(mode, stats, steps, tokens)

    plain = run("plain", [0.01, 0.012, 0.011, 0.0105, 0.0098, 0.0102] * 4, 0, [(1, "a")])
    fast = run("ngram", [0.012, 0.013, 0.0125, 0.0118, 0.0121, 0.0124] * 4, 1, [(1, "a")])
    same = run("model", [0.02, 0.024, 0.022, 0.021, 0.0196, 0.0204] * 4, 1, [(2, "b")])
    lanes = [Lane(m, m, GenerateConfig()) for m in ("plain", "ngram", "model")]
    verdict = race_verdict(lanes, [plain, fast, same], GenerateConfig(), "none")
    assert "Fastest: ngram" in verdict and "★" in verdict
    assert "≠ differs" in verdict and "should match" in verdict  # model's text is not plain's
    close = run("ngram", [0.02, 0.024, 0.022, 0.021, 0.0196, 0.0204] * 4, 1, [(1, "a")])
    verdict = race_verdict(lanes, [plain, close, same], GenerateConfig(), "none")
    assert "No run is measurably ahead" in verdict and "★" not in verdict
    slow = run("ngram", [0.03] * 24, 0, [(1, "a")])
    lanes = lanes[:2]
    assert "Fastest: speculation off" in race_verdict(lanes, [plain, slow], GenerateConfig(),
                                                      "none")
    stopped = race_verdict(lanes + lanes[1:], [plain, fast], GenerateConfig(), "none")
    assert "no winner is named" in stopped


def test_the_race_has_a_lane_for_each_drafter_and_draft_shape(engine):
    from specchat.core.race import lanes
    modes = [lane.mode for lane in lanes(engine, GenerateConfig(owner="local"))]
    assert modes == ["plain", "model", "ngram"]
    assert all(lane.cfg.owner is None and not lane.cfg.remember
               for lane in lanes(engine, GenerateConfig(owner="local")))

    class Trees:
        drafters = {"ngram": type("D", (), {"supports_trees": False})(),
                    "head": type("D", (), {"supports_trees": True})()}
        greedy_trees, trees_ok = ("head",), True
    greedy = {lane.mode: lane.cfg.tree_nodes for lane in lanes(Trees(), GenerateConfig())}
    assert list(greedy) == ["plain", "head", "head-chain", "ngram"]
    assert greedy["head"] > 0 and greedy["head-chain"] == 0
    sampled = [lane.mode for lane in lanes(Trees(), GenerateConfig(temperature=0.7))]
    assert sampled == ["plain", "head", "ngram"]  # trees pay only greedy


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def ev(text, kind="accepted", step=1):
    return TokenEvent(0, text, kind, step, 4, 2)


def test_markup_code_fences_inline_code_and_escaping():
    text_tokens = [ev("Run "), ev("`ls`", "bonus"), ev(" **now**:\n``"), ev("`py\nif a<b"),
                   ev(":\n  x()\n``", "resampled"), ev("`\n<script>", "target")]
    markup = render_tokens(text_tokens)
    assert "<script>" not in markup and "&lt;script&gt;" in markup and "a&lt;b" in markup
    assert '<pre class="sc-code"><code>' in markup
    assert 'class="tk tk-bonus sc-icode"' in markup and "sc-bold" in markup
    assert markup.count("sc-fence") == 4  # both fence lines are split over two tokens
    # A token that crosses into the fence is split, each piece keeping its kind and tooltip.
    text = "".join(t.text for t in text_tokens)
    assert "".join(ch for ch, _ in char_kinds_from_html(markup)) == text
    blocks, _ = markup_ranges(text)
    assert [b[2] for b in blocks] == ["text", "code", "text"]
    # While streaming, an unclosed fence runs to the end, and a cursor shows.
    live = render_tokens(text_tokens[:4], streaming=True)
    assert live.endswith('<span class="sc-cursor"></span></code></pre></div>')


def test_page_while_loading_and_after_a_failed_load(engine):
    release = threading.Event()
    slot = ModelSlot(description="target tiny")

    def loader(progress):
        progress("Loading target tiny…")
        release.wait(10)
        return LoadReport(engine, None, ["Draft model x refused: vocabulary differs."])

    thread = slot.load(loader)
    app = make_app(slot)
    box, _, session, notice = app.user("hi", Session())
    assert "still loading" in notice and box == "hi" and session.pending is None
    assert "Loading models" in status_html(slot) and "Loading target tiny" in status_html(slot)
    release.set()
    thread.join(10)
    assert slot.state == "ready" and "Ready" in status_html(slot)

    failed = ModelSlot()

    def bad(progress):
        from specchat.models.loaded import ModelLoadError
        raise ModelLoadError("Could not load 'nope/nope': offline.")

    failed.load(bad).join(10)
    assert failed.state == "failed" and "offline" in status_html(failed)
    notice = make_app(failed).user("hi", Session())[3]
    assert "failed to load" in notice and "offline" in notice


def test_the_still_loading_notice_goes_once_the_models_are_ready(engine):
    from specchat.ui.page import build_ui
    release = threading.Event()
    slot = ModelSlot(description="target tiny")
    thread = slot.load(lambda progress: release.wait(10) and LoadReport(engine, None, []))
    app = make_app(slot)
    # An example clicked (or a message sent) while loading is refused with this notice...
    notice = app.user("Water is a chemical compound made of", Session())[3]
    assert "still loading" in notice
    assert app.notice_once_ready(notice) == gr.skip()  # still true while loading
    release.set()
    thread.join(10)
    # ...which the page's next look at the slot clears; other notices stay.
    assert app.notice_once_ready(notice) == ""
    assert app.notice_once_ready("Type a message first: an empty message was not sent.") == \
        gr.skip()
    # The page's load and loading timer read the notice and write it.
    demo = build_ui(slot)
    notice_box = next(b for b in demo.blocks.values() if getattr(b, "elem_id", "") == "sc-notice")
    page_events = [d for d in demo.config["dependencies"]
                   if {event for _, event in d["targets"]} & {"load", "tick"}
                   and notice_box._id in d["outputs"]]
    assert page_events and all(notice_box._id in d["inputs"] for d in page_events)


def test_every_element_id_on_the_page_is_unique(engine):
    from specchat.ui.page import build_ui
    from specchat.ui.render import race_panel, race_placeholders
    demo = build_ui(engine)
    ids = [b.elem_id for b in demo.blocks.values() if getattr(b, "elem_id", None)]
    assert len(ids) == len(set(ids)), collections.Counter(ids).most_common(3)
    # gradio writes a Group's id on two nested elements: no Group carries one.
    assert not [b for b in demo.blocks.values() if isinstance(b, gr.Group) and b.elem_id]
    # The race's HTML names its runs by class, never by id.
    for panel in (*race_placeholders(), race_panel("plain", "speculation off", [], None, False)):
        assert " id=" not in panel


def test_a_base_model_starts_at_the_examples_samplers_with_a_switch_to_none(engine,
                                                                             monkeypatch):
    from dataclasses import asdict

    from specchat.core.settings import ANTI_LOOP, SETTINGS, build_config
    from specchat.ui.examples import EXAMPLES, NO_SAMPLERS, SAMPLER_FIELDS, sampler_preset
    from specchat.ui.page import build_ui, page_defaults
    assert not engine.chats  # no chat template: a base model, as the embedded default is
    defaults = page_defaults(ModelSlot.of(engine))
    assert {name: getattr(defaults, name) for name in ANTI_LOOP} == ANTI_LOOP
    # The very samplers every example uses.
    assert {sampler_preset({**asdict(Settings()), **e.settings}) for e in EXAMPLES} == \
        {sampler_preset(asdict(defaults))} == {"examples"}
    demo = build_ui(engine)
    blocks = list(demo.blocks.values())
    switch = next(b for b in blocks if getattr(b, "elem_id", "") == "sc-samplers")
    assert switch.value == "examples" and "none" in [value for _, value in switch.choices]
    by_label = {getattr(b, "label", None): b for b in blocks}
    for name, value in ANTI_LOOP.items():
        assert by_label[SETTINGS[name].label].value == value, name
    # The switch's "None" sets every sampler control off: the request then has no sampler.
    on_samplers = next(fn for fn in demo.fns.values() if fn.name == "on_samplers")
    off = dict(zip(SAMPLER_FIELDS, on_samplers.fn("none")))
    assert off == NO_SAMPLERS
    cfg, _ = build_config({**off, "temperature": 0.7}, ["ngram"])
    assert cfg.samplers() == ["temperature 0.7"]
    cfg, _ = build_config({**asdict(defaults), "temperature": 0.7}, ["ngram"])
    assert any(name.startswith("DRY") for name in cfg.samplers())
    # A visitor's own values read as "custom"; the explicit defaults of a caller stay as given.
    assert sampler_preset({**off, "min_p": 0.1}) == "custom"
    assert page_defaults(ModelSlot.of(engine), Settings(seed=3)) == Settings(seed=3)
    # A chat-tuned model keeps neutral defaults.
    monkeypatch.setattr(Engine, "chats", property(lambda self: True))
    assert page_defaults(ModelSlot.of(engine)) == Settings()


def test_warm_up_and_build_ui(engine):
    from specchat.stats.speedup import RECENT_PLAIN_STEPS, plain_step_times
    from specchat.ui.handlers import warm_up
    from specchat.ui.page import build_ui
    before = len(plain_step_times(engine).recent())
    warm_up(engine)  # the launcher runs it right after loading
    # Its plain steps (but the first) price the first replies' estimated speedups.
    assert len(plain_step_times(engine).recent()) > before or before == RECENT_PLAIN_STEPS
    demo = build_ui(engine)
    kinds = collections.Counter(type(b).__name__ for b in demo.blocks.values())
    assert kinds["Chatbot"] >= 1 and kinds["Textbox"] >= 1 and kinds["Tab"] >= 2, kinds
    assert any(getattr(b, "api_name", None) == "generate" for b in demo.fns.values())


def test_launcher_auth_and_exposure_warning():
    assert launcher.parse_auth("me:se:cret") == [("me", "se:cret")]
    assert launcher.parse_auth("a:1, b:2") == [("a", "1"), ("b", "2")]
    assert launcher.parse_auth("") is None
    with pytest.raises(ValueError):
        launcher.parse_auth("nopassword")
    assert launcher.exposure_warning("127.0.0.1", False, None) is None
    assert launcher.exposure_warning("0.0.0.0", False, [("a", "b")]) is None
    assert "WITHOUT A LOGIN" in launcher.exposure_warning("0.0.0.0", False, None)
    assert "gradio.live" in launcher.exposure_warning("localhost", True, None)
    args = launcher.build_parser().parse_args(["--preset", "embedded", "--max-new-tokens-cap",
                                               "64", "--share"])
    assert args.max_new_tokens_cap == 64 and args.share and args.host == "127.0.0.1"


@pytest.mark.parametrize("drafter, tree_nodes, replays", [
    ("ngram", 0, True), ("combined", 10, True), ("head", 10, True), ("head", 0, True),
    ("combined", 0, True), ("model", 0, False)])
def test_the_race_explains_a_sampled_difference_by_how_drafts_were_made(drafter, tree_nodes,
                                                                        replays):
    from specchat.core.race import Lane
    from specchat.stats.race import Entry
    off = GenerationStats(new_tokens=2, seconds=1.0, tokens_per_s=2.0, stop_reason="length")
    on = GenerationStats(new_tokens=2, seconds=0.5, tokens_per_s=4.0, stop_reason="length",
                         drafter=drafter, tree_nodes=tree_nodes, speculation=True)
    runs = [Entry("plain", off, [], [(5, "a"), (6, "b")]), Entry(drafter, on, [], [(5, "a"), (7, "c")])]
    lanes = [Lane("plain", "speculation off", GenerateConfig()),
             Lane(drafter, drafter, GenerateConfig())]
    cfg = GenerateConfig(temperature=0.7, drafter=drafter)
    text = race_verdict(lanes, runs, cfg, "none")
    assert "differs from token 1" in text and "&#x27;b&#x27;" in text
    assert ("should match" in text) == replays
    assert ("Leviathan's test with random numbers of their own" in text) != replays
    greedy = GenerateConfig(temperature=0.0, drafter=drafter)
    assert "should match" in race_verdict(lanes, runs, greedy, "nf4", row_exact=True)
    assert "near-tie can flip" in race_verdict(lanes, runs, greedy, "nf4", row_exact=False)


@pytest.mark.parametrize(("settings", "message"), [
    (Settings(seed=2**63), "Seed must be a whole number between 0 and 9223372036854775807"),
    (Settings(seed=1.5), "Seed must be a whole number"),
    (Settings(temperature=float("nan")), "Temperature must be a finite number"),
    (Settings(top_p=float("inf")), "Top-p must be a finite number"),
    (Settings(top_p=0), "Top-p must be a number in (0, 1]"),
    (Settings(top_k=-3), "Top-k must be a whole number between 0 and 1000000"),
    (Settings(draft_len=99), "Draft length k must be a whole number between 1 and 16"),
    (Settings(max_new_tokens=float("nan")), "Max new tokens must be a finite number"),
])
def test_bad_settings_are_refused_with_the_message_kept_and_the_chat_goes_on(engine, settings,
                                                                              message):
    app = make_app(engine)
    session = Session()
    box, _, session, notice = app.user("keep me", session, settings=settings)
    assert box == "keep me" and message in notice and "still in the box" in notice
    assert session.pending is None and not session.turns
    # Sent anyway (a direct call): refused the same way, nothing half-done.
    session.pending = "keep me"
    chat, session, notice = list(app.bot(session, settings))[-1]
    assert message in notice and not session.turns
    send(app, session, "fine now")  # the session keeps working
    assert session.turns[-1].stats.stop_reason != "error"


def test_a_lone_surrogate_is_replaced_and_the_session_keeps_working(engine, store):
    app = make_app(engine, store)
    session = Session()
    send(app, session, "bad \ud800 text")
    assert session.turns[0].user == "bad \ufffd text"
    assert session.turns[0].stats.stop_reason != "error"
    send(app, session, "and the next one", Settings(max_new_tokens=8, seed=0,
                                                    system="sys \udfff"))
    assert [t.stats.stop_reason != "error" for t in session.turns] == [True, True]
    assert app.writer.flush(10)
    assert store.turns(session.conversation_id)[0]["prompt"] == "bad \ufffd text"


def test_a_closed_page_records_the_reply_as_interrupted(engine, store):
    """gradio closes a handler's generator when its page goes away (a closed tab, /cancel)."""
    app = make_app(engine, store)
    session = Session()
    app.user("tell me a long story", session)
    updates = app.bot(session, Settings(max_new_tokens=400, seed=3, speculation=False))
    next(updates)
    next(updates)  # some tokens streamed
    updates.close()
    turn = session.turns[-1]
    assert turn.stats.stop_reason == "cancelled" and 0 < turn.stats.new_tokens < 400
    assert app.writer.flush(10)
    row = store.turns(session.conversation_id)[-1]
    assert row["interrupted"] and row["stop_reason"] == "cancelled" and row["reply"] == turn.reply
    send(app, session, "still there?")  # the engine is free and consistent
    assert session.turns[-1].stats.stop_reason != "error"


def test_one_reply_at_a_time_in_a_tab(engine, store):
    """While a tab's reply runs, its next message, Retry and Undo wait (the message stays in
    the box), and a second reply asked for directly is refused: each reply's prompt holds the
    whole of the replies before it."""
    app = make_app(engine, store)
    session = Session()
    app.user("tell me a long story", session)
    updates = app.bot(session, Settings(max_new_tokens=400, seed=3, speculation=False))
    next(updates)
    assert app.busy()
    box, _, _, notice = app.user("and then?", session)
    assert box == "and then?" and notice == ONE_AT_A_TIME and session.pending is None
    assert app.retry(session)[2] == app.undo(session)[3] == BUSY
    other = Session(pending="sent around the box")  # as a client skipping `user` might
    assert list(app.bot(other, Settings(max_new_tokens=4)))[-1][2] == BUSY
    assert other.turns == [] and len(session.turns) == 1
    updates.close()
    assert not app.busy()
    send(app, session, "and then?")
    assert [t.user for t in session.turns] == ["tell me a long story", "and then?"]


def test_a_reply_past_its_owners_places_in_line_is_not_sent_nor_saved(engine, store):
    """The page joins the engine's line with the API's limits: a visitor with 2 replies
    waiting already (other tabs, the API) while another visitor waits too is told so in the
    chat; nothing is saved, and Retry sends it once there is room."""
    app = make_app(engine, store)
    queue = EngineQueue.of(engine)
    holder = queue.join(owner="someone else")
    mine = [queue.join(owner="local") for _ in range(2)]  # this page's owner (no login)
    other = queue.join(owner="another visitor")  # waits too: the per-owner cap binds
    try:
        session = Session()
        chat, _, notice = send(app, session, "<b>hi</b>")[-1]
    finally:
        for ticket in (holder, *mine, other):
            ticket.leave()
    turn = session.turns[-1]
    assert turn.stats.stop_reason == "refused" and not turn.tokens
    assert notice.startswith("Not sent: 2 replies of yours are waiting")
    assert '<div class="sc-error">⚠ Not sent' in chat[-1]["content"]
    assert "sc-stats" not in chat[-1]["content"]  # it never ran: no figures
    assert "&lt;b&gt;hi&lt;/b&gt;" in chat[-2]["content"]
    assert app.writer.flush(10) and store.conversations() == []
    app.retry(session)
    list(app.bot(session, Settings(max_new_tokens=4, seed=0)))
    assert session.turns[-1].stats.stop_reason != "refused" and session.turns[-1].tokens
    assert app.writer.flush(10)  # saved before the store closes


def test_page_replies_wait_in_the_fair_line_not_in_gradios_queue(engine):
    """The events that generate share one gradio lane wide enough for many visitors' places,
    so the engine's line, fair between visitors, is where they wait."""
    from specchat.ui.page import ENGINE_LANE, build_ui

    demo = build_ui(engine)
    lanes = {getattr(fn.fn, "__name__", ""): (fn.concurrency_id, fn.concurrency_limit)
             for fn in demo.fns.values()}
    assert ENGINE_LANE > 1
    for name in ("on_bot", "on_race", "generate"):
        assert lanes[name] == ("engine", ENGINE_LANE), name


def test_an_exposed_page_names_models_without_their_paths(engine):
    from specchat.loader import LoadReport
    from specchat.ui.render import header_html
    from specchat.ui.state import hide_paths

    assert hide_paths("target /home/me/models/qwen-7b (nf4)") == "target qwen-7b (nf4)"
    assert hide_paths("Stats database /srv/x/stats.db is locked") == \
        "Stats database stats.db is locked"
    assert hide_paths("Qwen/Qwen2.5-7B-Instruct from https://hf.co/a/b") == \
        "Qwen/Qwen2.5-7B-Instruct from https://hf.co/a/b"  # hub ids and URLs stay
    slot = ModelSlot(LoadReport(engine, None, ["note about /home/me/models/tiny"]))
    slot.redact = hide_paths
    engine.target.name, name = "/home/me/models/tiny", engine.target.name
    try:
        header = header_html(slot)
    finally:
        engine.target.name = name
    assert "/home/me" not in header and "tiny" in header


def test_step_cards_and_ghosts_escape_model_text():
    from specchat.core.events import Candidate, Evidence, StepRecord
    from specchat.ui.inspector import ghost_html, step_card, step_charts
    evil = '<img src="http://127.0.0.1:1/x">'
    record = StepRecord(3, 2, 0, 1, 0.01, 0.02, proposal=[1, 2], proposal_text=[evil, "b"],
                        path=[], k=2, alpha=0.5, expected_gain=1.2,
                        evidence=Evidence(0, 9, evil, 1, evil, 0.00002, 1.0, 0.00002, False,
                                          [Candidate(9, evil, 0.9)], [Candidate(1, evil, 0.8)]))
    card, ghost = step_card(record), ghost_html(record)
    for markup in (card, ghost, step_charts([record], None)):
        assert "<img" not in markup
    assert "&lt;img" in card and "&lt;img" in ghost
    assert "p = 2.0e-05" in card and "sc-card-3" in card and "hidden" in card


def test_a_replys_one_tab_stop_is_on_a_token_that_shows_something():
    from specchat.core.events import StepRecord, TokenEvent

    steps = {1: StepRecord(1, 2, 1, 2, 0.0, 0.0), 2: StepRecord(2, 2, 2, 3, 0.0, 0.0)}
    tokens = [TokenEvent(10, "\n\n", "accepted", 1, 2, 1),
              TokenEvent(11, "Hi", "resampled", 1, 2, 1),
              TokenEvent(12, " there", "accepted", 2, 2, 2)]
    html = render_tokens(tokens, steps=steps)
    assert html.count('tabindex="0"') == 1
    assert re.search(r'tabindex="0">Hi<', html), html
    blank = render_tokens(tokens[:1], steps=steps)  # nothing visible: the first drafted token
    assert blank.count('tabindex="0"') == 1


def test_a_message_builds_its_request_once_and_its_reply_runs_with_it(engine):
    """`user` builds the message's request (a random seed drawn there) and `bot` runs the reply
    with that very request: no second build, no seed drawn and thrown away."""
    app = make_app(engine)
    built = []
    config = app.config
    app.config = lambda s: (lambda r: (built.append(r[0]), r)[1])(config(s))
    settings = Settings(max_new_tokens=6, seed=None, adaptive=False)
    session = Session()
    box, _, session, notice = app.user("hello there", session, settings=settings)
    assert box == "" and notice == "" and len(built) == 1
    list(app.bot(session, settings))
    assert len(built) == 1 and session.pending_request is None
    assert session.turns[-1].stats.seed == built[0].seed  # the seed the message was sent with
    with pytest.raises(dataclasses.FrozenInstanceError):
        built[0].seed = 1  # a request is never edited after it is built


def test_a_message_sent_before_the_models_changed_is_answered_by_the_new_ones(engine):
    """Its request was built with the drafters loaded then: a drafter gone since is replaced
    by a loaded one, with a note, rather than failing the reply."""
    from specchat.loader import LoadReport
    app = make_app(engine)
    session = Session()
    settings = Settings(max_new_tokens=8, seed=0, drafter="model")
    _, _, session, notice = app.user("hello there", session, settings=settings)
    assert notice == ""
    tok = byte_tokenizer()
    app.slot.swap(LoadReport(Engine(loaded(tiny_llama(0), tok), {"ngram": NgramDrafter()}),
                             None, []))
    chat, session, _ = list(app.bot(session, settings))[-1]
    turn = session.turns[-1]
    assert turn.stats.error == "" and turn.stats.new_tokens == 8
    assert turn.stats.drafter == "ngram" and "is not loaded" in " ".join(turn.notes)
