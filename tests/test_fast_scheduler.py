"""The Cython scheduler mirror against the reference: same operations, same observable state.

A hypothesis state machine drives ``mie.scheduler.Scheduler`` over a reference pool and
``mie._fast.Scheduler`` over a fast pool with the same random operations -- submissions (some
invalid or too long), steps, commits with the answers of a model that reads its KV back through
the block tables (and some wrong answers), aborts at any time, prefix-cache lookups and
clears -- and requires after every operation the same return values or the same exceptions,
and the same state: running and waiting, every sequence, every block table, every refcount,
the free list, the prefix cache's entries and LRU order. Some runs shrink the block hash to a
few bits on both sides, so that hash collisions, which the 64-bit hash never produces in a
test, really happen.
"""

import subprocess
import sys

import pytest
from conftest import needs_fast, require_fast
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from scheduler_model import STOP, VOCAB, KVModel, kv_pool

from mie.backend import select
from mie.bench import mechanisms
from mie.bench.simulate import simulate
from mie.bench.workload import BLOCK_SIZE, mixed_requests, spread_out, with_system_prompt
from mie.scheduler import prefix_cache

PREFIXES = [[], [5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 12], [20] * 9, [5, 6, 7]]
prompts = st.builds(
    lambda prefix, tail: PREFIXES[prefix] + tail,
    st.integers(0, len(PREFIXES) - 1),
    st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6),
)
bad_prompts = st.sampled_from([[], [1, -2], [1, True], [1, 2.5], (1, None)])
MODES = {
    "no sharing": {"prefix_sharing": False},
    "running sharing": {},
    "prefix cache": {"prefix_caching": True},
    "chunked, no sharing": {"prefix_sharing": False, "enable_chunked_prefill": True},
    "chunked, running sharing": {"enable_chunked_prefill": True},
    "chunked, prefix cache": {"prefix_caching": True, "enable_chunked_prefill": True},
}


def outcome(call):
    """What a call did, comparable across backends: its value or its exception."""
    try:
        return "ok", call()
    except Exception as exc:  # noqa: BLE001 -- the exception is the observable result
        return type(exc), str(exc)


def seq_state(seq) -> tuple:
    return (
        seq.seq_id,
        seq.token_ids,
        seq.num_prompt_tokens,
        seq.max_tokens,
        seq.stop_token_ids,
        seq.num_computed,
        seq.finish_reason,
        seq.num_preemptions,
        seq.peak_computed,
        seq.cache_cursor,
        seq.table.blocks,
        seq.table.num_tokens,
        seq.table.num_released,
        repr(seq),
    )


def batch_state(batch) -> tuple:
    entries = [
        (e.seq.seq_id, e.start, e.num_tokens, e.is_prefill, e.token_ids, e.positions, e.samples)
        for e in batch.entries
    ]
    return (
        batch.step,
        entries,
        [s.seq_id for s in batch.preempted],
        batch.trace.to_dict(),
        len(batch),
        batch.num_prefill_tokens,
        batch.num_decode_tokens,
        batch.num_sampling,
    )


class SideBySide(RuleBasedStateMachine):
    @initialize(
        mode=st.sampled_from(sorted(MODES)),
        capacity=st.integers(6, 40),  # token slots; some requests will not fit
        block_size=st.integers(1, 4),
        max_num_seqs=st.integers(1, 4),
        extra_budget=st.integers(0, 24),
        hash_mask=st.sampled_from([-1, -1, 0, 1, 7]),
        first=st.lists(st.tuples(prompts, st.integers(1, 12)), min_size=1, max_size=8),
        window=st.one_of(st.none(), st.integers(1, 9)),
    )
    def setup(
        self, mode, capacity, block_size, max_num_seqs, extra_budget, hash_mask, first, window
    ):
        """``window``: a sliding window (blocks released as sequences advance) or none."""
        import mie._fast.prefix_cache as fast_prefix_cache

        self.restore = (prefix_cache.block_hash, fast_prefix_cache._set_hash_mask)
        if hash_mask != -1:
            reference_hash = prefix_cache.block_hash

            def few_bits(parent_hash, token_ids):
                return reference_hash(parent_hash, token_ids) & hash_mask

            prefix_cache.block_hash = few_bits
            fast_prefix_cache._set_hash_mask(hash_mask)
        self.scheds, self.models = [], []
        for backend in (select("python"), select("fast")):
            pool = kv_pool(-(-capacity // block_size), block_size, backend.BlockPool)
            budget = max_num_seqs + extra_budget
            self.scheds.append(
                backend.Scheduler(
                    pool, block_size, max_num_seqs, budget, **MODES[mode], sliding_window=window
                )
            )
            self.models.append(KVModel(pool, block_size, window))
        self.seqs = ([], [])  # every sequence either side handed out, by seq_id
        self.batches = None  # the last step's batches, until committed ...
        self.answers = None  # ... and the model's answers, computed right after the step
        for prompt, max_tokens in first:
            self.submit(prompt, max_tokens, [STOP])

    def both(self, call):
        """``call(scheduler)`` on each side; the outcomes must agree. Returns whether it
        succeeded, and the two return values."""
        results = [outcome(lambda s=s: call(s)) for s in self.scheds]
        kinds = [r[0] for r in results]
        assert kinds[0] == kinds[1], results
        if kinds[0] != "ok":
            assert results[0][1] == results[1][1]  # the same message
        return kinds[0] == "ok", [r[1] for r in results]

    @rule(
        prompt=st.one_of(prompts, prompts, prompts, bad_prompts),
        max_tokens=st.sampled_from([1, 2, 3, 5, 8, 12, 40, 0, True]),
        stops=st.sampled_from([[STOP], [], [STOP, 3]]),
        reuse_prefix=st.sampled_from([True, True, True, False, 1]),
    )
    def submit(self, prompt, max_tokens, stops, reuse_prefix=True):
        ok, seqs = self.both(
            lambda s: s.submit(prompt, max_tokens, stops, reuse_prefix=reuse_prefix)
        )
        if ok:
            for mine, seq in zip(self.seqs, seqs, strict=True):
                mine.append(seq)

    @rule()
    def step(self):
        reference = self.scheds[0]
        idle_with_work = bool(reference.waiting) and not reference.running
        ok, batches = self.both(lambda s: s.step())
        if not ok:  # both raised the same: only because a batch is still out
            assert self.batches is not None, batches
            return
        assert batch_state(batches[0]) == batch_state(batches[1])
        # No step may be one every later step would repeat (a livelock): an idle
        # scheduler with requests waiting admits the head of the queue.
        if idle_with_work:
            assert batches[0].entries, "an idle scheduler admitted nothing"
        answers = [model(batch) for model, batch in zip(self.models, batches, strict=True)]
        assert answers[0] == answers[1]  # the KV read back through both tables agrees
        self.batches, self.answers = batches, answers[0]
        if batches[0].preempted:
            event("preemption")
        if batches[0].trace.prefix_hit_tokens:
            event("prefix reused")
        if any(e.seq.table.num_released for e in batches[0].entries):
            event("blocks released")

    @precondition(lambda self: self.batches is None)
    @rule(num_steps=st.integers(1, 12))
    def run(self, num_steps):
        """Steps answered by the model: the common path, deep enough to fill the pool."""
        for _ in range(num_steps):
            self.step()
            self.commit("model")
            self.same_state()

    @precondition(lambda self: self.batches is not None)
    @rule(how=st.sampled_from(["model", "model", "model", "short", "negative"]))
    def commit(self, how):
        tokens = {
            "model": self.answers,
            "short": self.answers[1:],
            "negative": [-1] * len(self.answers),
        }[how]
        batches = iter(self.batches)
        ok, finished = self.both(lambda s: s.commit(next(batches), tokens))
        if ok and any(s.finish_reason == "abort" for s in self.seqs[0]):
            event("commit after an abort")
        if ok:
            assert [s.seq_id for s in finished[0]] == [s.seq_id for s in finished[1]]
            batches = iter(self.batches)
            ok, _ = self.both(lambda s: s.commit(next(batches), tokens))  # exactly once
            assert not ok
            self.batches = None

    @rule(data=st.data())
    def abort(self, data):
        num_seqs = len(self.seqs[0])
        seq_id = data.draw(st.one_of(st.integers(-1, num_seqs), st.sampled_from([True, "0"])))
        self.both(lambda s: s.abort(seq_id))

    @rule(tokens=prompts, max_blocks=st.integers(0, 6))
    def lookup(self, tokens, max_blocks):
        if self.scheds[0].prefix_cache is not None:
            self.both(lambda s: s.prefix_cache.lookup(tokens, max_blocks))

    @rule()
    def clear_prefix_cache(self):
        self.both(lambda s: s.clear_prefix_cache())

    @invariant()
    def same_state(self):
        if not hasattr(self, "scheds"):
            return
        states = []
        for sched, seqs in zip(self.scheds, self.seqs, strict=True):
            sched.check_integrity()
            pool, cache = sched.pool, sched.prefix_cache
            states.append(
                (
                    [s.seq_id for s in sched.running],
                    [s.seq_id for s in sched.waiting],
                    [seq_state(s) for s in seqs],
                    [pool.refcount(b) for b in range(pool.num_blocks)],
                    pool.free_ids,
                    cache and (cache.cached_blocks, cache.evictable_blocks, cache.num_cached),
                    sched.num_steps,
                    sched.has_unfinished(),
                )
            )
        assert states[0] == states[1]

    def teardown(self):
        if hasattr(self, "restore"):
            prefix_cache.block_hash, set_hash_mask = self.restore
            set_hash_mask(-1)


TestSideBySide = needs_fast(SideBySide.TestCase)
TestSideBySide.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


@settings(max_examples=300, deadline=None)
@given(
    parent=st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-5, 5)),
    tokens=st.lists(st.one_of(st.integers(0, 2**63 - 1), st.integers(0, 200_000)), max_size=20),
)
def test_block_hash_is_cpythons_tuple_hash(parent, tokens):
    require_fast()
    from mie._fast.prefix_cache import py_block_hash

    assert py_block_hash(parent, tokens) == prefix_cache.block_hash(parent, tuple(tokens))


WORKLOADS = {
    "mixed": lambda seed: mixed_requests(seed, 32),
    "system prompt": lambda seed: with_system_prompt(mixed_requests(seed, 32), seed, 96),
    "system prompt, spread": lambda seed: spread_out(
        with_system_prompt(mixed_requests(seed, 32), seed, 96), seed, 200
    ),
}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("pool", ["generous", "floor", "below the floor"])
def test_mechanism_simulations_are_identical(workload, mode, pool):
    record = pool != "floor"  # with and without the per-token records
    """The bench's null-model simulation: the same ``RunResult`` (trace rows, latencies,
    rejections) from the reference, from the fast scheduler under the same driver, and from
    the fast scheduler under the driver's compiled mirror."""
    require_fast()
    from mie.bench.compiled import simulate as compiled_simulate

    requests = WORKLOADS[workload](0)
    floor = max(-(-r.max_kv_tokens // BLOCK_SIZE) for r in requests)  # the longest request's
    num_blocks = {"generous": 8 * floor, "floor": floor, "below the floor": floor - 1}[pool]
    results = []
    for backend, driver in [("python", simulate), ("fast", simulate), ("fast", compiled_simulate)]:
        backend = select(backend)
        pool = backend.BlockPool(num_blocks, 1)
        sched = backend.Scheduler(
            pool, BLOCK_SIZE, 8, mechanisms.MAX_NUM_BATCHED_TOKENS, **MODES[mode]
        )
        results.append(driver(sched, requests, record_tokens=record))
    assert results[0].steps > 0 and results[0].completed + results[0].rejected == len(requests)
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("mode", [m for m in sorted(MODES) if m.startswith("chunked")])
def test_windowed_mechanism_simulations_are_identical(workload, mode):
    """The same null-model simulation under a sliding window of 100 (blocks of 16: not a
    multiple) in a pool of five windows' blocks, so blocks are released all along and
    sequences are preempted: the same ``RunResult`` from the reference, the fast scheduler
    and the compiled driver."""
    require_fast()
    from mie.bench.compiled import simulate as compiled_simulate

    from mie.scheduler.scheduler import window_blocks

    requests = WORKLOADS[workload](1)
    num_blocks = 5 * window_blocks(100, BLOCK_SIZE)
    results = []
    for backend, driver in [("python", simulate), ("fast", simulate), ("fast", compiled_simulate)]:
        backend = select(backend)
        sched = backend.Scheduler(
            backend.BlockPool(num_blocks, 1),
            BLOCK_SIZE,
            8,
            512,
            **MODES[mode],
            sliding_window=100,
        )
        results.append(driver(sched, requests, record_tokens=True))
    assert results[0].completed == len(requests)
    assert results[0].total("preemptions") > 0 or "spread" in workload  # those rarely overlap
    assert results[0] == results[1] == results[2]


CACHE_IN_A_CYCLE = """
import gc
from mie.backend import select
fast = select("fast")
gc.disable()
pool = fast.BlockPool(8, 64)
sched = fast.Scheduler(pool, 4, 2, 64, prefix_caching=True)
seq = sched.submit(list(range(1, 10)), 2)
while sched.has_unfinished():
    batch = sched.step()
    sched.commit(batch, [7] * len(batch.entries))
cache = sched.prefix_cache
assert cache.num_cached == 2  # blocks whose tokens the cache holds
del sched, seq, batch  # the scheduler is freed now; the cache lives on
class Holder:
    pass
holder = Holder()  # tracked after the cache, so the collector clears the cache first
holder.me, holder.cache = holder, cache
del pool, cache, holder
gc.collect()
print("collected")
"""


def test_a_prefix_cache_freed_inside_a_reference_cycle_frees_only_its_own_memory():
    """The garbage collector clears a cycle's objects (their Python references set to None)
    before freeing them: the cache's __dealloc__ must not read its pool then (it read the
    pool's block count from None, and freed as many pointers: the interpreter aborted)."""
    require_fast()
    run = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", CACHE_IN_A_CYCLE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout.strip() == "collected", run.stderr[-2000:]
