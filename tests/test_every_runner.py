"""Every drafter on every runner kind: transformers' forward (`HFRunner`) with float32 and bf16
features, and specchat's own CPU forward (`CpuRunner`) on every kernels path this machine runs.
A request repeated, another in between and a second turn each give plain decoding's text with no
error; the same through the API and the bench. A reply that fails in the engine is answered with
an OpenAI error object, and the server serves the next request."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from tiny import byte_tokenizer, loaded, served_on_loopback, tiny_llama

from specchat import kernels, runners
from specchat.api.server import create_app
from specchat.bench.config import BenchSettings
from specchat.bench.run import bench as run_bench
from specchat.core.engine import Engine
from specchat.core.events import GenerationStats, TokenEvent
from specchat.core.request import GenerateConfig
from specchat.drafters.combined import CombinedDrafter
from specchat.drafters.head import PENDING_FEATURES, HeadDrafter
from specchat.drafters.ngram import NgramDrafter
from specchat.loader import LoadReport
from specchat.models import runtime
from specchat.models.eagle import DraftHead, HeadConfig
from specchat.models.load import load_model
from specchat.models.synthetic import save, tiny_gemma3
from specchat.runners.cpu import runner as cpu_runner
from specchat.runners.hf.runner import HFRunner
from specchat.stats.store import StatsStore

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = byte_tokenizer()
TEXT = "the cat sat on the mat. the dog sat on the log. the cat"
OTHER = "a bird flew over the hill and the bird sang. a bird"
# More draft steps than the head keeps observed features before storing them (and the head drafts
# at none of them when lookup drafts): the store then runs outside any propose call.
NEW_TOKENS = 3 * PENDING_FEATURES
KERNEL_PATHS = [p.name for p in runtime.candidates(forced="")
                if p.kernels and not p.fused_nf4 and kernels.load(p.kernels) is not None]


def ids_of(text):
    return TOK(text)["input_ids"]


def with_drafters(model) -> Engine:
    """An engine over `model` (a LoadedModel) with lookup, a random head and both combined."""
    target = model.model
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target(target, 64))
    head.vocab_ids = torch.arange(40, 104)
    drafter = HeadDrafter(head.attach(target).eval(), target, len(TOK))
    return Engine(model, {"ngram": NgramDrafter(), "head": drafter,
                          "combined": CombinedDrafter(NgramDrafter(), drafter)})


@pytest.fixture(scope="module")
def gemma_checkpoint(tmp_path_factory):
    """A Gemma 3 whose every layer specchat's NF4 kernel takes (see test_cpu_runner.py)."""
    pytest.importorskip("bitsandbytes")
    model = tiny_gemma3(0, hidden=128, head_dim=64)
    for m in model.modules():
        if type(m).__name__ == "Gemma3RMSNorm":
            torch.nn.init.normal_(m.weight, std=0.5)
    return save(model.to(torch.bfloat16), TOK, tmp_path_factory.mktemp("gemma3"))


RUNNERS = ["hf-float32", "hf-bf16"] + [f"cpu-runner:{p}" for p in KERNEL_PATHS] \
    + [f"hf-nf4:{p}" for p in KERNEL_PATHS[:1]]


@pytest.fixture
def model(request, gemma_checkpoint, monkeypatch):
    """The target (a LoadedModel) on the runner kind `request.param` names."""
    kind = request.param
    if kind.startswith("hf-") and ":" not in kind:
        dtype = torch.bfloat16 if kind == "hf-bf16" else torch.float32
        return loaded(tiny_llama(0).to(dtype), TOK)
    how, path = kind.split(":")
    monkeypatch.setenv(runtime.ENV, path)
    monkeypatch.setenv(runners.CPU_RUNNER_ENV, "transformers" if how == "hf-nf4" else "")
    model = load_model(str(gemma_checkpoint), "nf4", "cpu", progress=lambda *a: None)
    wanted = HFRunner if how == "hf-nf4" else cpu_runner.CpuRunner
    assert isinstance(model.runner, wanted), model.label
    return model


def reply(engine, ids, **cfg) -> tuple[list[int], GenerationStats]:
    events = list(engine.stream(ids, GenerateConfig(max_new_tokens=NEW_TOKENS, **cfg)))
    return [e.id for e in events if isinstance(e, TokenEvent)], events[-1]


@pytest.mark.parametrize("model", RUNNERS, indirect=True)
def test_every_drafter_repeats_a_request_and_a_second_turn_with_plain_text(model):
    """Each drafter on a fresh engine, speculating from its first request: the head's stored
    features are made while it drafts, and written again after steps it did not draft (lookup's
    in combined, every step under ngram, which still hands the head what the target computed)."""
    first, other = ids_of(TEXT), ids_of(OTHER)
    plain_engine = with_drafters(model)
    plain = {}
    for name, ids in (("first", first), ("other", other)):
        plain[name], _ = reply(plain_engine, ids, speculation=False)
    second_turn = first + plain["first"] + ids_of(" and then")
    plain["second"], _ = reply(plain_engine, second_turn, speculation=False)
    for drafter in ("combined", "head", "ngram"):
        engine = with_drafters(model)
        for name, ids in (("first", first), ("other", other), ("first", first),
                          ("second", second_turn)):
            got, stats = reply(engine, ids, drafter=drafter, draft_len=2, adaptive=False)
            assert stats.error == "" and stats.stop_reason == "length", (drafter, stats.error)
            assert got == plain[name], (drafter, name)
        head = engine.drafters["head"]
        head._flush()
        assert head.tokens[:len(second_turn)] == second_turn  # it kept what it observed


def test_the_bench_runs_every_head_mode_on_bf16_features():
    engine = with_drafters(loaded(tiny_llama(0).to(torch.bfloat16), TOK))
    questions = [{"question_id": 1, "category": "writing", "turns": [TEXT, OTHER]}]
    settings = BenchSettings(modes=("head", "combined", "plain"), max_new_tokens=NEW_TOKENS,
                             warmup_tokens=2)
    result = run_bench(engine, questions, settings, progress=False)
    assert result["greedy_identical"] == {"plain": 1.0, "head": 1.0, "combined": 1.0}


class Failing(NgramDrafter):
    """Lookup that fails at its `fail_at`th proposal: an engine error in the middle of a reply."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.fail_at, self.calls = fail_at, 0

    def propose(self, context, k, params, noise):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("a drafter failed on purpose")
        return super().propose(context, k, params, noise)


def test_the_api_repeats_requests_on_bf16_features_and_answers_a_failure_as_openai_does():
    engine = with_drafters(loaded(tiny_llama(0).to(torch.bfloat16), TOK, name="tiny"))
    failing = engine.drafters["failing"] = Failing(fail_at=3)
    key = "sk-every-runner"
    app = create_app(LoadReport(engine, None, []), StatsStore(":memory:"), {key: "tests"},
                     max_tokens_cap=NEW_TOKENS, max_input_chars=2000)
    with served_on_loopback(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

        def ask(**extra):
            return client.chat.completions.create(
                model="tiny", max_tokens=NEW_TOKENS, temperature=0, extra_body=extra,
                messages=[{"role": "user", "content": TEXT}]).choices[0].message.content

        replies = [ask(drafter="combined"), ask(drafter="combined"), ask(drafter="head")]
        plain = ask(speculation=False)
        assert replies == [plain] * 3
        # A failure after the reply began: a 500 in OpenAI's shape, whole or streamed.
        with pytest.raises(openai.InternalServerError) as failed:
            ask(drafter="failing", draft_len=1, adaptive=False)
        error = failed.value.body
        assert error["type"] == "server_error" and "failed on purpose" in error["message"]
        failing.calls = 0
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"prompt": TEXT, "max_tokens": NEW_TOKENS, "stream": True,
                                "drafter": "failing", "draft_len": 1,
                                "adaptive": False}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["error"]["type"] == "server_error"
        assert "failed on purpose" in last["error"]["message"]
        assert ask(drafter="combined") == plain  # and the server keeps serving
