"""``/metrics`` scraped from a live server and read with ``prometheus_client``'s own parser.

Every name documented in docs/serving.md's metrics tables is exposed; vLLM's with vLLM's
type, labels and histogram buckets (vllm/v1/metrics/loggers.py, ``PrometheusStatLogger``),
so a dashboard built for vLLM reads mie; and the values move as requests run.
"""

import math
import re
import time
from pathlib import Path

import pytest
from conftest import require_module

from mie.engine.llm_engine import LLMEngine

httpx = require_module("httpx")
parser = require_module("prometheus_client.parser")
serve = require_module("mie.serve")  # the server stack: starlette, uvicorn, prometheus_client

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "models" / "stories260K"
DOCS = ROOT / "docs" / "serving.md"
SERVED_NAME = "tiny-stories"
TIMEOUT = 60.0
PROMPT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park with her friends and her dog."
)

LATENCY = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TTFT = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# vLLM's families as vLLM v1 writes them: name (as the parser names the family: a counter
# without its _total) -> (type, labels beyond model_name and engine, buckets). Copied from
# vLLM's source, not from mie's, so a slip in mie's names, labels or buckets shows here.
VLLM = {
    "vllm:num_requests_running": ("gauge", set(), None),
    "vllm:num_requests_waiting": ("gauge", set(), None),
    "vllm:kv_cache_usage_perc": ("gauge", set(), None),
    "vllm:gpu_cache_usage_perc": ("gauge", set(), None),
    "vllm:prompt_tokens": ("counter", set(), None),
    "vllm:generation_tokens": ("counter", set(), None),
    "vllm:num_preemptions": ("counter", set(), None),
    "vllm:prefix_cache_queries": ("counter", set(), None),
    "vllm:prefix_cache_hits": ("counter", set(), None),
    "vllm:request_success": ("counter", {"finished_reason"}, None),
    "vllm:spec_decode_num_drafts": ("counter", set(), None),
    "vllm:spec_decode_num_draft_tokens": ("counter", set(), None),
    "vllm:spec_decode_num_accepted_tokens": ("counter", set(), None),
    "vllm:time_to_first_token_seconds": ("histogram", set(), TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", set(), ITL),
    "vllm:time_per_output_token_seconds": ("histogram", set(), ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", set(), LATENCY),
}


@pytest.fixture(scope="module")
def url():
    engine = LLMEngine(STORIES, backend="python", num_blocks=256, prefix_caching=True)
    with serve.serve_in_thread(serve.build_app(engine, STORIES, model_name=SERVED_NAME)) as url:
        yield url


def scrape(url: str) -> dict:
    """The families of ``/metrics``, by name, as ``prometheus_client`` parses them."""
    response = httpx.get(url + "/metrics", timeout=TIMEOUT)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    return {f.name: f for f in parser.text_string_to_metric_families(response.text)}


def value(families: dict, sample: str, **labels) -> float:
    """The sample named ``sample`` whose labels include ``labels`` (exactly one)."""
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    found = [
        s.value
        for s in families[family].samples
        if s.name == sample and labels.items() <= s.labels.items()
    ]
    assert len(found) == 1, (sample, labels, found)
    return found[0]


def documented_names() -> set[str]:
    """Every metric name in docs/serving.md's metrics tables, as written there."""
    section = DOCS.read_text().split("## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`((?:vllm:|mie_)[a-z0-9_]+)", row)}


def family_name(documented: str, families: dict) -> str:
    """The parser's family name for a documented name (counters lose their ``_total``)."""
    bare = documented.removesuffix("_total")
    return bare if bare in families and families[bare].type == "counter" else documented


def test_every_documented_name_is_exposed(url):
    families = scrape(url)
    names = documented_names()
    assert {n for n in names if n.startswith("vllm:")} == {
        n + "_total" if kind == "counter" else n for n, (kind, _, _) in VLLM.items()
    }
    assert len([n for n in names if n.startswith("mie_")]) >= 20
    for name in names:
        assert family_name(name, families) in families, f"{name} is documented, not exposed"


def test_vllm_families_have_vllms_types_labels_and_buckets(url):
    families = scrape(url)
    for name, (kind, extra_labels, buckets) in VLLM.items():
        assert name in families, f"{name} missing"
        family = families[name]
        assert family.type == kind, name
        assert family.samples, name
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == SERVED_NAME, sample
            assert labels.pop("engine") == "0", sample
            labels.pop("le", None) if sample.name.endswith("_bucket") else None
            assert set(labels) == extra_labels, sample
        if buckets is not None:
            bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
            assert bounds == [*buckets, math.inf], name
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error"}


def wait_for_tokens(url: str, before: dict, tokens: int) -> dict:
    """Metrics once the engine's snapshot counts ``tokens`` more generated (bounded)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        after = scrape(url)
        generated = value(after, "vllm:generation_tokens_total")
        if generated - value(before, "vllm:generation_tokens_total") >= tokens:
            return after
        assert time.monotonic() < deadline, "the generated tokens were never counted"
        time.sleep(0.02)


def complete(url: str, max_tokens: int) -> dict:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def test_vllm_values_move_as_requests_run(url):
    before = scrape(url)
    answer = complete(url, max_tokens=6)
    prompt, generated = answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]
    reason = answer["choices"][0]["finish_reason"]
    after = wait_for_tokens(url, before, generated)

    def delta(sample: str, **labels) -> float:
        return value(after, sample, **labels) - value(before, sample, **labels)

    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == generated
    assert delta("vllm:request_success_total", finished_reason=reason) == 1
    other = {"stop", "length", "abort", "error"} - {reason}
    assert all(delta("vllm:request_success_total", finished_reason=r) == 0 for r in other)
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:time_to_first_token_seconds_sum") > 0
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    e2e = delta("vllm:e2e_request_latency_seconds_sum")
    assert e2e >= delta("vllm:time_to_first_token_seconds_sum") > 0
    for itl in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert delta(itl + "_count") == generated - 1
    # mie's and vLLM's views of the same state agree
    assert value(after, "vllm:num_requests_running") == value(after, "mie_num_requests_running")
    usage = value(after, "vllm:kv_cache_usage_perc")
    assert 0 <= usage <= 1 and usage == value(after, "mie_kv_cache_usage_ratio")
    assert value(after, "vllm:gpu_cache_usage_perc") == usage
    assert delta("mie_request_finished_total", finish_reason=reason) == 1


def test_vllm_prefix_cache_counters_count_tokens_looked_up_and_found(url):
    complete(url, max_tokens=2)  # the prompt's blocks now in the prefix cache
    before = scrape(url)
    answer = complete(url, max_tokens=2)
    after = wait_for_tokens(url, before, answer["usage"]["completion_tokens"])

    def delta(sample: str) -> float:
        return value(after, sample) - value(before, sample)

    hits, queries = delta("vllm:prefix_cache_hits_total"), delta("vllm:prefix_cache_queries_total")
    assert hits > 0, "the repeated prompt found nothing in the prefix cache"
    assert queries == answer["usage"]["prompt_tokens"] > hits
    assert hits == delta("mie_prefix_cache_hit_tokens_total")
    assert queries == hits + delta("mie_prompt_tokens_total")
