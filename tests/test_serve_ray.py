"""``mie serve --replicas N``: the routers and metrics merging (no Ray needed), then two
stories260K replicas on a local Ray with two CPUs, spoken to over loopback.

The Ray tests share one cluster (starting Ray and two engines costs seconds) and run in file
order: the replica-killing test comes late because it restarts a replica, and the last test
runs the real CLI in a subprocess to check that its shutdown leaves no process behind. Under
CI (the ``CI`` variable set) a missing Ray is a failure, not a skip.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import pytest
from conftest import require_module
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mie import LLM, EngineConfig, SamplingParams

# The server stack and its clients: without them, skip (not in CI). Ray itself is checked by
# the live-cluster fixture, so the routing tests run without it.
httpx = require_module("httpx")
openai = require_module("openai")
require_module("mie.serve")  # starlette, uvicorn

import test_serve_fuzz as fuzz  # noqa: E402  (its generated corpus of bad requests)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mie.serve import cluster_metrics  # noqa: E402
from mie.serve.metrics import ServerMetrics  # noqa: E402
from mie.serve.router import (  # noqa: E402
    HashRing,
    LeastLoadedRouter,
    PrefixRouter,
    RoundRobinRouter,
    make_router,
)

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
BACKEND = "python"
BLOCK = 16
TIMEOUT = 60.0  # seconds, for any one HTTP exchange
RECOVERY_TIMEOUT = 90.0  # seconds for Serve to bring a killed replica back
ENGINE = {"block_size": BLOCK, "num_blocks": 256, "max_num_seqs": 4, "backend": BACKEND}
MAX_QUEUE = 2  # per replica: a burst of 16 long requests overflows 2 x (4 running + 2 waiting)


# -- bad flags: refused before Ray starts ----------------------------------------------------------
@pytest.mark.parametrize(
    "flags",
    [
        ["--block-size", "0"],
        ["--max-num-seqs", "-1"],
        ["--num-blocks", "0"],
        ["--max-queue", "0"],
        ["--seed", "-2"],
    ],
    ids=lambda flags: flags[0],
)
def test_replicas_with_a_bad_engine_flag_fail_in_one_line_before_ray_starts(flags):
    # Before: Ray started, the replicas failed to deploy, and a dozen tracebacks came first.
    require_module("ray")
    command = [sys.executable, "-m", "mie", "serve", "--model", str(STORIES), "--replicas", "2"]
    command += ["--port", "0", *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    setting = flags[0].removeprefix("--").replace("-", "_")
    assert result.stderr.startswith(f"mie: error: {setting} must be"), result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr  # no Ray output, no traceback


def test_the_cluster_checks_its_settings_before_starting_ray(monkeypatch):
    ray = require_module("ray")
    from mie import cli
    from mie.serve import cluster

    def start(self):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(cluster.Cluster, "start", start)
    was_initialized = ray.is_initialized()
    args = cli.build_parser().parse_args(
        ["serve", "--model", str(STORIES), "--replicas", "2", "--max-num-seqs", "-1"]
    )
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int, got -1"):
        cli.run_serve(args)
    assert ray.is_initialized() == was_initialized
    with pytest.raises(ValueError, match="max_queue must be at least 1, got 0"):
        cluster.EngineSettings(str(STORIES), max_queue=0)


def ingress_over(handles: list):
    """A ``RayIngress`` over stand-in replica handles: stories260K's tokenizer and settings."""
    from mie.engine.tokenizer import Tokenizer
    from mie.serve.cluster import RayIngress

    return RayIngress(
        handles,
        Tokenizer(STORIES),
        STORIES,
        512,
        BLOCK,
        eos_token_ids=(2,),
        vocab_size=512,
        sampling_defaults={},
    )


def test_the_ingress_health_reports_stuck_replicas_from_their_stats():
    # The replicas' stats carry EngineLoop.stalled(); faked here (the loop's own detection is
    # tested under a live server in test_serve_lifecycle.py). One stuck replica of two: 200
    # "degraded" naming it; both: 503 engine_stalled; none: 200 "ok", as before.
    require_module("ray")

    class Handle:
        def __init__(self, index: int) -> None:
            self.index, self.stalled = index, None
            self.stats = self  # handle.stats.remote()

        async def remote(self) -> dict:
            return {"healthy": True, "pid": 1, "stalled": self.stalled}

    handles = [Handle(0), Handle(1)]
    ingress = ingress_over(handles)

    async def health(stalled: list[str | None]) -> tuple[int, dict]:
        for handle, why in zip(handles, stalled, strict=True):
            handle.stalled = why
        for replica in ingress.replicas:
            await ingress._stats(replica)
        response = await ingress.health(None)
        return response.status_code, json.loads(response.body)

    why = "no progress for 31 s with 3 requests waiting"
    status, body = asyncio.run(health([None, why]))
    assert status == 200 and body["status"] == "degraded", body
    assert body["replicas"]["stalled"] == {"1": why}
    status, body = asyncio.run(health([why, why]))
    assert status == 503 and body["error"]["code"] == "engine_stalled", body
    assert body["error"]["message"] == f"every engine replica is stuck (replica 0: {why})"
    status, body = asyncio.run(health([None, None]))
    assert (status, body) == (200, {"status": "ok", "replicas": {"up": 2, "total": 2, "down": []}})


# -- routers: plain Python, property-tested -------------------------------------------------------
replica_sets = st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True)
token_ids = st.lists(st.integers(0, 511), min_size=0, max_size=80)
loads = st.dictionaries(st.integers(0, 15), st.integers(0, 100))


@settings(max_examples=200, deadline=None)
@given(replica_sets, token_ids, loads, st.sampled_from(["prefix", "round-robin", "least-loaded"]))
def test_every_router_ranks_each_live_replica_once(live, ids, load, name):
    router = make_router(name, range(16), BLOCK)
    order = router.order(ids, live, load)
    assert sorted(order) == sorted(live)


# loads that never make a replica "much busier" than another (8 ahead at most)
calm_loads = st.dictionaries(st.integers(0, 15), st.integers(0, 8))


@settings(max_examples=200, deadline=None)
@given(
    replica_sets,
    st.lists(st.integers(0, 511), min_size=BLOCK, max_size=80),
    token_ids,
    calm_loads,
    calm_loads,
)
def test_prefix_router_sends_the_same_first_block_to_the_same_replica(
    live, ids, other_tail, load, other_load
):
    router = PrefixRouter(range(16), BLOCK)
    same_block = ids[:BLOCK] + other_tail  # differs after the first block only
    owner = router.ring.owner(router.key(ids), live)
    assert router.order(ids, live, load)[0] == owner  # whatever the (calm) loads
    assert router.order(same_block, live, other_load)[0] == owner


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=32), min_size=1, max_size=50, unique=True),
    replica_sets,
    st.data(),
)
def test_hash_ring_moves_only_the_keys_of_a_replica_that_leaves(keys, live, data):
    assume(len(live) >= 2)
    ring = HashRing(range(16))
    gone = data.draw(st.sampled_from(live))
    rest = [r for r in live if r != gone]
    for key in keys:
        before, after = ring.owner(key, live), ring.owner(key, rest)
        assert after in rest
        if before != gone:
            assert after == before  # consistent hashing: the others' keys stay put


def test_hash_ring_spreads_keys_over_replicas():
    ring = HashRing(range(2))
    owners = [ring.owner(f"system prompt {i}".encode(), [0, 1]) for i in range(400)]
    assert 120 <= owners.count(0) <= 280  # 64 virtual nodes each: roughly even


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 60), st.integers(0, 60))
def test_prefix_router_falls_back_only_when_the_owner_is_much_busier(owner_load, other_load):
    router = PrefixRouter(range(2), BLOCK)
    ids = list(range(BLOCK))
    owner = router.order(ids, [0, 1], {})[0]
    other = 1 - owner
    order = router.order(ids, [0, 1], {owner: owner_load, other: other_load})
    # The documented rule, restated: more than 8 beyond the other and more than twice it.
    much_busier = owner_load - other_load > 8 and owner_load > 2 * max(other_load, 1)
    assert order[0] == (other if much_busier else owner)
    assert router.fallbacks == int(much_busier)  # counted for mie_router_fallbacks_total


def test_prefix_router_fallback_examples():
    router = PrefixRouter(range(2), BLOCK)
    assert not router.much_busier(8, 0)  # 8 ahead: not yet
    assert router.much_busier(9, 0)
    assert not router.much_busier(20, 10)  # 10 ahead but only twice as busy
    assert router.much_busier(21, 10)


@settings(max_examples=100, deadline=None)
@given(replica_sets, st.lists(st.integers(0, 511), max_size=BLOCK - 1), loads)
def test_prompts_shorter_than_a_block_go_to_the_least_loaded(live, ids, load):
    order = PrefixRouter(range(16), BLOCK).order(ids, live, load)
    assert load.get(order[0], 0) == min(load.get(r, 0) for r in live)


@settings(max_examples=100, deadline=None)
@given(replica_sets, st.integers(1, 40))
def test_round_robin_spreads_evenly(live, n):
    router = RoundRobinRouter()
    firsts = [router.order([1] * BLOCK, live, {})[0] for _ in range(n)]
    counts = [firsts.count(r) for r in live]
    assert max(counts) - min(counts) <= 1


@settings(max_examples=100, deadline=None)
@given(replica_sets, loads)
def test_least_loaded_picks_a_least_loaded_replica(live, load):
    first = LeastLoadedRouter().order([], live, load)[0]
    assert load.get(first, 0) == min(load.get(r, 0) for r in live)


def test_unknown_router_and_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random", range(2), BLOCK)
    with pytest.raises(ValueError, match="block_size"):
        PrefixRouter(range(2), 0)


# -- metrics merging: plain text in, plain text out -----------------------------------------------
def replica_metrics(prompt: int, hits: int, blocks: int, free: int, finished: int) -> str:
    m = ServerMetrics()
    m.engine.prompt_tokens, m.engine.prefix_hit_tokens = prompt, hits
    m.engine.blocks_total, m.engine.blocks_free = blocks, free
    for _ in range(finished):
        m.count_finished("stop")
    m.observe_token(0.02, None)
    return m.render()


def samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, read with prometheus_client's parser; ``replica`` is the
    first label, the others follow in name order (as prometheus_client writes them)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            first = [("replica", labels.pop("replica"))] if "replica" in labels else []
            shown = ",".join(f'{k}="{v}"' for k, v in [*first, *sorted(labels.items())])
            out[f"{sample.name}{{{shown}}}" if shown else sample.name] = sample.value
    return out


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 10**6),  # prompt tokens computed
            st.integers(0, 10**6),  # prompt tokens borrowed from the cache
            st.integers(1, 10**4),  # blocks
            st.integers(0, 10**4),  # free blocks
            st.integers(0, 50),  # requests finished
        ),
        min_size=1,
        max_size=4,
    )
)
def test_merged_metrics_label_each_replica_and_total_them(replicas):
    texts = {}
    for i, (prompt, hits, blocks, free, finished) in enumerate(replicas):
        texts[i] = replica_metrics(prompt, hits, blocks, min(free, blocks), finished)
    merged = samples(cluster_metrics.render(cluster_metrics.merge(texts)))
    for i, text in texts.items():  # every replica's sample, unchanged, under its label
        for name, value in samples(text).items():
            base, _, labels = name.partition("{")
            label = f'replica="{i}"' + ("," + labels[:-1] if labels else "")
            assert merged[f"{base}{{{label}}}"] == pytest.approx(value)
    prompt = sum(r[0] for r in replicas)
    hits = sum(r[1] for r in replicas)
    finished = sum(r[4] for r in replicas)
    total = 'replica="total"'
    assert merged[f'mie_request_finished_total{{{total},finish_reason="stop"}}'] == finished
    assert merged[f"mie_prefix_cache_hit_tokens_total{{{total}}}"] == hits
    expected_rate = hits / (prompt + hits) if prompt + hits else 0.0
    assert merged[f"mie_prefix_cache_hit_rate{{{total}}}"] == pytest.approx(expected_rate)
    blocks = sum(r[2] for r in replicas)
    in_use = sum(r[2] - min(r[3], r[2]) for r in replicas)
    assert merged[f"mie_kv_cache_usage_ratio{{{total}}}"] == pytest.approx(in_use / blocks)
    count = f"mie_time_to_first_token_seconds_count{{{total}}}"
    assert merged[count] == len(replicas)


def test_merged_vllm_families_are_per_engine_with_the_served_name_and_no_total():
    texts = {}
    for i in range(2):
        m = ServerMetrics("directory-name", engine_index=i)
        for _ in range(i + 1):
            m.count_finished("stop", e2e=0.5)
        texts[i] = m.render()
    merged = samples(cluster_metrics.render(cluster_metrics.merge(texts, "served")))
    for i in range(2):
        labels = f'replica="{i}",engine="{i}"'
        success = (
            f'vllm:request_success_total{{{labels},finished_reason="stop",model_name="served"}}'
        )
        assert merged[success] == i + 1
        e2e = f'vllm:e2e_request_latency_seconds_count{{{labels},model_name="served"}}'
        assert merged[e2e] == i + 1
    assert not [k for k in merged if k.startswith("vllm:") and 'replica="total"' in k]
    assert not [k for k in merged if "directory-name" in k]
    assert not [k for k in merged if "_created{" in k and 'replica="total"' in k]  # times
    assert merged['mie_request_finished_total{replica="total",finish_reason="stop"}'] == 3


def test_a_malformed_metrics_line_is_refused():
    with pytest.raises(ValueError, match="not a Prometheus sample"):
        cluster_metrics.parse("mie_x{oops 1 2\n")


# -- a live cluster -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    """Two stories260K replicas on a local Ray with two CPUs (skipped without Ray, except
    under CI, where a missing Ray fails)."""
    require_module("ray")
    from mie import EngineConfig
    from mie.serve.cluster import Cluster, EngineSettings

    settings_ = EngineSettings(str(STORIES), EngineConfig(**ENGINE), max_queue=MAX_QUEUE)
    cluster = Cluster(settings_, 2, num_cpus=2, log_to_driver=False).start()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def offline():
    llm = LLM(STORIES, **ENGINE)

    def generate(prompt, **params) -> str:
        return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].text

    return generate


class Ingress:
    """An ingress over the shared replicas, served on loopback, with its clients."""

    def __init__(self, cluster, router: str):
        from mie.engine.tokenizer import Tokenizer
        from mie.serve import serve_in_thread

        self.tokenizer = Tokenizer(STORIES)
        self.server = cluster.ingress(self.tokenizer, router=router)
        self._serving = serve_in_thread(self.server.app())

    def __enter__(self):
        self.url = self._serving.__enter__()
        self.client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT
        )
        self.wait_up(2)
        return self

    def __exit__(self, *exc):
        return self._serving.__exit__(*exc)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT
        )

    def metrics(self) -> dict[str, float]:
        return samples(httpx.get(self.url + "/metrics", timeout=TIMEOUT).text)

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=TIMEOUT)

    def wait_up(self, n: int, timeout: float = RECOVERY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while (r := self.health()).json().get("replicas", {}).get("up") != n:
            assert time.monotonic() < deadline, f"not {n} replicas up: {r.text}"
            time.sleep(0.1)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = sum(
                m.get(f'mie_num_requests_{k}{{replica="{i}"}}', 0)
                for k in ("running", "waiting")
                for i in (0, 1)
            )
            if busy == 0:
                return m
            assert time.monotonic() < deadline, "the replicas did not become idle"
            time.sleep(0.05)


def finished(m: dict[str, float], replica: int) -> float:
    return sum(
        m.get(f'mie_request_finished_total{{replica="{replica}",finish_reason="{r}"}}', 0)
        for r in ("stop", "length", "abort", "error")
    )


PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]


def test_openai_client_gets_the_offline_answers(ray_cluster, offline):
    with Ingress(ray_cluster, "round-robin") as ingress:
        for prompt in PROMPTS:
            want = offline(prompt, temperature=0, max_tokens=24)
            got = ingress.client.completions.create(
                model="stories260K", prompt=prompt, max_tokens=24, temperature=0
            )
            assert got.choices[0].text == want
            streamed = ingress.client.completions.create(
                model="stories260K", prompt=prompt, max_tokens=24, temperature=0, stream=True
            )
            assert "".join(c.choices[0].text for c in streamed) == want
        messages = [{"role": "user", "content": "Tell me a story"}]
        rendered = ingress.server.chat_template.apply(messages)
        ids = ingress.server.chat_template.encode(rendered)
        want = offline({"prompt_token_ids": ids}, temperature=0, max_tokens=20)
        chat = ingress.client.chat.completions.create(
            model="stories260K", messages=messages, max_tokens=20, temperature=0
        )
        assert chat.choices[0].message.content == want
        chunks = ingress.client.chat.completions.create(
            model="stories260K", messages=messages, max_tokens=20, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
        models = ingress.client.models.list()
        assert [m.id for m in models.data] == ["stories260K"]
        health = ingress.health().json()
        assert health == {"status": "ok", "replicas": {"up": 2, "total": 2, "down": []}}


def test_beam_search_through_the_ingress_gives_the_offline_beams(ray_cluster):
    """The ingress drives the search with the replicas' EOS ids (from their ``info``); each
    step's requests go where the router sends them, and the beams are ``LLM.beam_search``'s."""
    from mie import BeamSearchParams

    llm = LLM(STORIES, **ENGINE)
    params = BeamSearchParams(beam_width=2, max_tokens=40, length_penalty=0.5)
    want = llm.beam_search(PROMPTS[0], params, use_tqdm=False)
    with Ingress(ray_cluster, "prefix") as ingress:
        got = ingress.client.completions.create(
            model="stories260K",
            prompt=PROMPTS[0],
            n=2,
            max_tokens=40,
            extra_body={"use_beam_search": True, "length_penalty": 0.5},
        )
        eos = ingress.server.eos_token_ids
    assert [(c.text, c.finish_reason) for c in got.choices] == [
        (s.text, s.finish_reason) for out in want for s in out.sequences
    ]
    assert eos == llm.engine.model.config.eos_token_ids and eos


def test_bad_requests_are_4xx_in_openai_shape(ray_cluster):
    """The ingress validates with the single-process server's code: a few spot checks."""
    with Ingress(ray_cluster, "prefix") as ingress:
        cases = [
            (b"{not json", 400, "invalid_json"),
            (json.dumps({"model": "nope", "prompt": "a"}).encode(), 404, "model_not_found"),
            (
                json.dumps({"model": "stories260K", "prompt": "a", "stop": ["x"] * 17}).encode(),
                400,
                "stop_limit",
            ),
            (json.dumps({"model": "stories260K", "prompt": [1, 2, 99999]}).encode(), 400, None),
            (
                json.dumps({"model": "stories260K", "prompt": "a", "max_tokens": 10**6}).encode(),
                400,
                None,
            ),
        ]
        for body, status, code in cases:
            r = httpx.post(ingress.url + "/v1/completions", content=body, timeout=TIMEOUT)
            assert r.status_code == status, r.text
            assert r.json()["error"]["code"] == code
        r = httpx.get(ingress.url + "/v1/nothing", timeout=TIMEOUT)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_the_ingress_takes_structured_outputs_and_tools_like_the_server(ray_cluster):
    """Same fields, same answers' shapes, same 400s: there the replica compiles the constraint,
    and its refusal names the field the client used."""
    with Ingress(ray_cluster, "prefix") as ingress:
        regex = r"(yes|no), [a-z]{1,6}\."
        answer = ingress.client.completions.create(
            model="stories260K",
            prompt="Is it sunny?",
            max_tokens=20,
            seed=1,
            extra_body={"structured_outputs": {"regex": regex}},
        ).choices[0]
        assert answer.finish_reason == "stop" and re.fullmatch(regex, answer.text)
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "pick",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"enum": ["Paris", "Rome"]}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                },
            }
        ]
        named = {"type": "function", "function": {"name": "pick"}}
        chat = ingress.client.chat.completions.create(
            model="stories260K",
            messages=[{"role": "user", "content": "Where?"}],
            tools=tools,
            tool_choice=named,
            max_tokens=30,
            seed=1,
        ).choices[0]
        (call,) = chat.message.tool_calls
        assert call.function.name == "pick" and chat.finish_reason == "stop"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        lookbehind = {"type": "string", "pattern": "(?<=a)b"}
        for body, param in [
            ({"structured_outputs": {"regex": "(a|b"}}, "structured_outputs"),
            (
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": lookbehind},
                    }
                },
                "response_format",
            ),
            ({"response_format": {"type": "xml"}}, "response_format"),
        ]:
            r = httpx.post(
                ingress.url + "/v1/completions",
                json={"model": "stories260K", "prompt": "a", "max_tokens": 4, **body},
                timeout=TIMEOUT,
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_batch_through_the_ingress_answers_each_prompt_or_refuses_all(ray_cluster, offline):
    """Batches cross the ingress one engine request per prompt, each routed on its own; a
    refused prompt takes back those already accepted (the ingress cannot queue them all or
    none at once, as the single-process server does), so nothing stays running."""
    from mie.engine.llm_engine import LLMEngine
    from mie.serve.app import system_fingerprint

    share = EngineConfig(**ENGINE).max_samples_per_request  # 2 of a replica's 4 slots
    with Ingress(ray_cluster, "round-robin") as ingress:
        got = ingress.client.completions.create(
            model="stories260K", prompt=PROMPTS[:share], max_tokens=12, temperature=0
        )
        assert [c.text for c in got.choices] == [
            offline(p, temperature=0, max_tokens=12) for p in PROMPTS[:share]
        ]
        assert [c.index for c in got.choices] == list(range(share))
        assert got.system_fingerprint == system_fingerprint(LLMEngine(STORIES, **ENGINE))

        # A batch is held to one request's share of a replica, as on one engine.
        over = {"model": "stories260K", "prompt": PROMPTS[: share + 1], "max_tokens": 4}
        r = httpx.post(ingress.url + "/v1/completions", json=over, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_limit", r.text

        def aborted() -> float:
            m = ingress.wait_idle()
            return sum(
                m.get(f'mie_request_finished_total{{replica="{i}",finish_reason="abort"}}', 0)
                for i in (0, 1)
            )

        before = aborted()
        bad = {
            "model": "stories260K",
            "prompt": [[1, 400], [1, 99999]],
            "max_tokens": 400,
            "ignore_eos": True,
        }
        r = httpx.post(ingress.url + "/v1/completions", json=bad, timeout=TIMEOUT)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "prompt", r.text
        assert error["message"].startswith("prompt[1]: token id 99999 is outside")
        assert aborted() - before == 1  # the one accepted before the second was refused


def two_prefixes_on_two_replicas(tokenizer) -> list[str]:
    """Two system prompts whose first blocks the ring gives to different replicas."""
    router = PrefixRouter(range(2), BLOCK)
    owners = {}
    for name in ("Lily", "Tom", "Sue", "Ben", "Max", "Mia", "Sam", "Tim"):
        system = (
            f"Once upon a time, there was a little child named {name}. {name} liked to "
            "play outside in the park with friends. "
        )
        assert len(tokenizer.encode(system)) >= 2 * BLOCK
        owners.setdefault(router.ring.owner(router.key(tokenizer.encode(system)), [0, 1]), system)
        if len(owners) == 2:
            return [owners[0], owners[1]]
    raise AssertionError("no two prompts on two replicas")


@pytest.fixture(scope="module")
def ingress_url(ray_cluster):
    with Ingress(ray_cluster, "prefix") as ingress:
        yield ingress.url


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    route=st.sampled_from(
        [
            ("/v1/completions", fuzz.COMPLETION_BASE, fuzz.COMPLETION_FIELDS),
            ("/v1/chat/completions", fuzz.CHAT_BASE, fuzz.CHAT_FIELDS),
        ]
    ),
    data=st.data(),
    raw=fuzz.raw_field_values(),
)
def test_the_ingress_answers_the_serve_fuzz_corpus_never_a_500(
    ingress_url, offline, route, data, raw
):
    """tests/test_serve_fuzz.py's generated bad values for every field, sent to the Ray
    ingress: a 4xx in OpenAI's shape (or an answer), and the keep-alive connection then
    answers a correct request with the offline text."""
    path, base, fields = route
    field = data.draw(st.sampled_from(fields))
    connection = fuzz.Connection(ingress_url)
    try:
        fuzz.assert_answered(*connection.request(path, fuzz.body_with(base, field, raw)))
        expected = offline(fuzz.CHECK_PROMPT, temperature=0, max_tokens=fuzz.CHECK_TOKENS)
        fuzz.check_still_serves(connection, expected)
    finally:
        connection.close()


def test_prefix_routing_keeps_a_prefix_on_one_replica_and_round_robin_spreads_it(ray_cluster):
    tails = ("One day", "Then", "Her dog", "The sun", "A bird", "At night")
    with Ingress(ray_cluster, "prefix") as ingress:
        systems = two_prefixes_on_two_replicas(ingress.tokenizer)  # owned by 0, then by 1
        for owner, system in enumerate(systems):
            before = ingress.wait_idle()
            for tail in tails:
                ingress.client.completions.create(
                    model="stories260K", prompt=system + tail, max_tokens=4
                )
            after = ingress.wait_idle()
            deltas = [finished(after, r) - finished(before, r) for r in (0, 1)]
            expected = [0, 0]
            expected[owner] = len(tails)
            assert deltas == expected  # all on the replica owning the prefix
            hits = f'mie_prefix_cache_hit_tokens_total{{replica="{owner}"}}'
            # every request after the first borrows at least the system prompt's two blocks
            assert after[hits] - before[hits] >= (len(tails) - 1) * 2 * BLOCK
            assert after[f'mie_prefix_cache_hit_rate{{replica="{owner}"}}'] > 0
    with Ingress(ray_cluster, "round-robin") as ingress:
        before = ingress.wait_idle()
        for tail in tails:
            ingress.client.completions.create(
                model="stories260K", prompt=systems[0] + tail, max_tokens=4
            )
        after = ingress.wait_idle()
        deltas = [finished(after, r) - finished(before, r) for r in (0, 1)]
        assert deltas == [len(tails) // 2] * 2


def test_a_disconnect_aborts_the_request_on_its_replica(ray_cluster):
    """A request of 480 tokens takes about half a second here; each client hangs up within
    milliseconds of its start, so its abort reaches the replica while it runs."""
    with Ingress(ray_cluster, "round-robin") as ingress:  # replica 0, then replica 1
        before = ingress.wait_idle()
        body = {
            "model": "stories260K",
            "prompt": "Once upon a time",
            "max_tokens": 480,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", ingress.url + "/v1/completions", json=body, timeout=TIMEOUT
        ) as response:
            assert next(response.iter_lines()).startswith("data: ")  # it runs: hang up
        # the non-streaming kind: send the request and hang up at once
        request = json.dumps({**body, "stream": False}).encode()
        address = urlparse(ingress.url)
        with socket.create_connection((address.hostname, address.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(request), request)
            )
        deadline = time.monotonic() + TIMEOUT
        while True:
            m = ingress.metrics()
            aborts = [
                m[f'mie_request_finished_total{{replica="{r}",finish_reason="abort"}}']
                - before[f'mie_request_finished_total{{replica="{r}",finish_reason="abort"}}']
                for r in (0, 1)
            ]
            in_use = [m[f'mie_kv_cache_usage_ratio{{replica="{r}"}}'] for r in (0, 1)]
            done = finished(m, 0) + finished(m, 1) - finished(before, 0) - finished(before, 1)
            if done == 2 and in_use == [0.0, 0.0]:
                break
            assert time.monotonic() < deadline, f"aborts {aborts}, blocks in use {in_use}"
            time.sleep(0.05)
        # each was aborted, and its blocks freed, on the replica that ran it
        assert aborts == [1, 1]
        generated = [
            m[f'mie_generation_tokens_total{{replica="{r}"}}']
            - before[f'mie_generation_tokens_total{{replica="{r}"}}']
            for r in (0, 1)
        ]
        assert all(0 < n < 480 for n in generated), generated


def test_a_full_cluster_answers_503_with_retry_after(ray_cluster):
    with Ingress(ray_cluster, "prefix") as ingress:
        ingress.wait_idle()

        async def burst():
            client = ingress.async_client()

            async def one(i):
                try:
                    r = await client.completions.with_raw_response.create(
                        model="stories260K",
                        prompt=f"Story {i}: once upon a time",
                        max_tokens=150,
                        extra_body={"ignore_eos": True},
                    )
                    return r.status_code, r.parse().choices[0].finish_reason
                except openai.APIStatusError as exc:
                    return exc.status_code, exc.response

            return await asyncio.gather(*(one(i) for i in range(16)))

        results = asyncio.run(burst())
        refused = [r for status, r in results if status == 503]
        served = [r for status, r in results if status == 200]
        assert refused and served and len(refused) + len(served) == 16
        for response in refused:
            assert response.headers["Retry-After"] == "1"
            assert response.json()["error"]["code"] == "queue_full"
        assert served == ["length"] * len(served)
        assert ingress.metrics()["mie_cluster_rejected_total"] == len(refused)


def test_a_killed_replica_fails_only_its_requests_and_comes_back(ray_cluster, offline):
    prompt = "Once upon a time"  # 490 tokens: about half a second each, killed well before
    want = offline(prompt, temperature=0, max_tokens=490, ignore_eos=True)
    with Ingress(ray_cluster, "round-robin") as ingress:
        ingress.wait_idle()
        pids = ray_cluster.replica_pids()

        async def run():
            client = ingress.async_client()
            streams, first_chunks = [], []
            for _ in range(4):  # round-robin from a fresh ingress: replicas 0, 1, 0, 1
                stream = await client.completions.create(
                    model="stories260K",
                    prompt=prompt,
                    max_tokens=490,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                first_chunks.append(await stream.__anext__())
                streams.append(stream)
            # and a non-streaming one, the fifth: on replica 0 again
            routed = 'mie_router_requests_total{replica="0"}'
            before = (await asyncio.to_thread(ingress.metrics))[routed]
            waiting = asyncio.ensure_future(
                client.completions.with_raw_response.create(
                    model="stories260K",
                    prompt=prompt,
                    max_tokens=490,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            )
            deadline = time.monotonic() + TIMEOUT
            while (await asyncio.to_thread(ingress.metrics))[routed] == before:  # accepted?
                assert time.monotonic() < deadline
            os.kill(pids[0], signal.SIGKILL)
            with pytest.raises(openai.APIStatusError) as refused:
                await waiting
            error = refused.value
            assert error.status_code == 502, error
            assert error.response.json()["error"]["code"] == "replica_failed"
            assert "replica 0" in error.response.json()["error"]["message"]

            async def rest(stream, first):
                text = first.choices[0].text
                try:
                    async for chunk in stream:
                        text += chunk.choices[0].text
                except openai.APIError as exc:
                    return "error", str(exc)
                return "done", text

            return await asyncio.wait_for(
                asyncio.gather(*(rest(s, f) for s, f in zip(streams, first_chunks, strict=True))),
                TIMEOUT,
            )

        results = asyncio.run(run())
        for i in (0, 2):
            assert results[i][0] == "error" and "replica 0" in results[i][1], results[i]
        for i in (1, 3):
            assert results[i] == ("done", want)
        # routing goes around the dead replica at once
        health = ingress.health().json()
        assert health["status"] == "degraded" and health["replicas"]["down"] == [0], health
        for _ in range(2):  # both on replica 1, the one up
            got = ingress.client.completions.create(
                model="stories260K", prompt=prompt, max_tokens=8, temperature=0
            )
            assert got.choices[0].text == want[: len(got.choices[0].text)]
        assert ingress.metrics()['mie_replica_failed_requests_total{replica="0"}'] == 3
        # Serve restarts it; the ingress routes to it again
        ingress.wait_up(2)
        assert ray_cluster.replica_pids()[0] != pids[0]
        before = ingress.wait_idle()
        for _ in range(4):
            ingress.client.completions.create(model="stories260K", prompt=prompt, max_tokens=4)
        after = ingress.wait_idle()
        assert [finished(after, r) - finished(before, r) for r in (0, 1)] == [2, 2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_cli_serves_and_its_shutdown_leaves_no_process_behind(ray_cluster, offline):
    from mie.serve.cluster import _descendants, _running

    port = free_port()
    command = [sys.executable, "-m", "mie", "serve", "--model", str(STORIES), "--replicas", "2"]
    command += ["--port", str(port), "--num-blocks", "256", "--backend", BACKEND]
    command += ["--router", "round-robin", "--shutdown-grace", "0", "--max-num-seqs", "1"]
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=5).json()["replicas"]["up"] == 2:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            assert time.monotonic() < deadline, "the CLI's cluster did not come up"
            time.sleep(0.25)
        body = {
            "model": "stories260K",
            "prompt": "Once upon a time",
            "max_tokens": 16,
            "temperature": 0,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.json()["choices"][0]["text"] == offline(
            "Once upon a time", temperature=0, max_tokens=16
        )
        children = _descendants(process.pid)
        assert len(children) >= 3  # Ray's own processes and the two replicas, at least

        # Sixteen long streams, eight per replica, each replica running one at a time
        # (--max-num-seqs 1, about 0.3 s a stream here): once all are accepted, SIGTERM. With
        # no grace period each stream ends at once with an "abort" chunk and [DONE], as in one
        # process, except those that finished first.
        def stream() -> list:
            body = {
                "model": "stories260K",
                "prompt": "Once upon a time",
                "max_tokens": 480,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream(
                "POST", url + "/v1/completions", json=body, timeout=TIMEOUT
            ) as response:
                assert response.status_code == 200
                return [line for line in response.iter_lines() if line]

        def accepted() -> float:
            metrics = samples(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
            return sum(metrics[f'mie_router_requests_total{{replica="{r}"}}'] for r in (0, 1))

        before = accepted()
        with ThreadPoolExecutor(16) as pool:
            streams = [pool.submit(stream) for _ in range(16)]
            deadline = time.monotonic() + TIMEOUT
            while accepted() < before + 16:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            reasons = []
            for lines in (s.result(TIMEOUT) for s in streams):
                assert lines[-1] == "data: [DONE]", lines[-3:]
                reasons.append(json.loads(lines[-2][6:])["choices"][0]["finish_reason"])
        assert set(reasons) <= {"abort", "length"} and "abort" in reasons, reasons
        output, _ = process.communicate(timeout=90)
        assert process.returncode == 0, output
        assert "Traceback" not in output, output
        deadline = time.monotonic() + 10
        while alive := [p for p in children if _running(p)]:
            assert time.monotonic() < deadline, f"left running: {alive}"
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


class UnreachableHandle:
    """A stand-in Serve handle: every ``generate`` call fails at once, as when the replica
    cannot be reached; ``stats`` answers (the replica looks up) unless ``answers`` is False."""

    def __init__(self, index: int, answers: bool) -> None:
        self.index, self.answers = index, answers

    def options(self, **kwargs):
        return self

    def __getattr__(self, method: str):
        handle = self

        class Method:
            def remote(self, *args, **kwargs):
                if method != "stats" or not handle.answers:
                    raise RuntimeError(f"replica {handle.index} cannot be reached")

                async def stats():
                    metrics = ServerMetrics().render()
                    return {"index": handle.index, "pid": 1, "healthy": True, "metrics": metrics}

                return stats()

        return Method()


@pytest.mark.parametrize("answers", [True, False])
def test_with_no_replica_reachable_requests_are_503_with_retry_after(ray_cluster, answers):
    """Replicas that look up but fail every call (``answers``), or are down outright: each
    request is tried on every replica, then refused with a 503, never a 500."""
    from mie.serve import serve_in_thread

    handles = [UnreachableHandle(i, answers) for i in range(2)]
    ingress = ingress_over(handles)
    with serve_in_thread(ingress.app()) as url:
        body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4}
        for stream in (False, True):
            r = httpx.post(
                url + "/v1/completions", json={**body, "stream": stream}, timeout=TIMEOUT
            )
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "no_replica"
        if not answers:
            health = httpx.get(url + "/health", timeout=TIMEOUT)
            assert health.status_code == 503
            assert health.json()["replicas"] == {"up": 0, "total": 2, "down": [0, 1]}
            assert health.json()["error"]["code"] == "engine_unavailable"
            metrics = samples(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
            assert metrics["mie_replicas_up"] == 0 and metrics["mie_replicas"] == 2


def test_without_replicas_the_server_does_not_import_ray():
    code = (
        "import sys; from mie.cli import build_parser; import mie.serve, mie.serve.app; "
        "build_parser().parse_args(['serve', '--model', 'x']); "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_ray_flags_are_checked():
    from mie.cli import main

    assert main(["serve", "--model", str(STORIES), "--replicas", "0"]) == 1
    assert main(["serve", "--model", str(STORIES), "--ray-address", "auto"]) == 1
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(STORIES), "--replicas", "2", "--router", "random"])
