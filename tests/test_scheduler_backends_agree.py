"""Both backends accept and refuse exactly the same inputs, with the same exception.

The side-by-side state machines (``test_fast_scheduler.py``, ``test_fast_memory.py``) drive
the two backends with mostly sensible operations. Here every argument of the public API --
``Scheduler(...)``, ``submit``, ``commit``, ``abort``, ``BlockPool(...)``, ``BlockTable(...)``
and the table's and pool's methods -- is drawn from a corpus of bad and extreme values: ints
far outside int64, the boundaries of the documented ranges (token ids below 2**63, sizes and a
pool's capacity below 2**61), NumPy integers (signed, unsigned, 0-d and 1-d arrays), floats
(NaN, infinities), bools, None, strings, bytes, int subclasses and enums, objects with only
``__index__``, fractions, decimals, complex numbers, and containers of them (lists, tuples,
iterators, generators, sets, dicts, ranges, NumPy arrays, strings). The reference and the
Cython mirror must both accept (and then behave the same: a few steps are run and compared)
or both refuse with the same exception class and message.

Regression: token ids of 2**63 and more were accepted by the reference and refused by the
mirror; a block size of 2**63 - 1 crashed the mirror (a C overflow, then a segfault).
"""

import enum
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from conftest import require_fast
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from mie.backend import select
from mie.checks import MAX_TOKEN_COUNT, MAX_TOKEN_ID, is_int
from mie.memory import BlockTable
from mie.scheduler.scheduler import RequestTooLongError

BACKENDS = ("python", "fast")


class IndexOnly:
    """Has ``__index__`` (so ``operator.index`` takes it) but no ordering."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"IndexOnly({self.value})"


class SubInt(int):
    """An int subclass: an int for ``isinstance``, not for ``type(x) is int``."""


class Color(enum.IntEnum):
    RED = 3
    HUGE = 2**64


EDGES = [
    0,
    1,
    -1,
    2**31,
    2**32,
    MAX_TOKEN_COUNT,
    MAX_TOKEN_COUNT + 1,
    2**62,
    MAX_TOKEN_ID,
    MAX_TOKEN_ID + 1,
    2**64 - 1,
    2**64,
    10**30,
    -(2**63),
    -(2**63) - 1,
]


def branch(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """``strategy`` as one branch of an enclosing ``st.one_of``: hypothesis flattens nested
    ``one_of``s, which would give each inner branch the weight of a whole outer one."""
    return strategy.map(lambda x: x)


ints = branch(st.one_of(st.integers(-3, 60), st.sampled_from(EDGES), st.integers(-(2**70), 2**70)))
odd_values = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.integers(-128, 127).map(np.int8),
    st.sampled_from([np.bool_(True), np.bool_(False), np.array(3), np.array([3]), np.float64(2)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.integers(-5, 2**64).map(SubInt),
    st.sampled_from(list(Color)),
    st.integers(-(2**65), 2**65).map(IndexOnly),
    st.integers(-3, 3).map(Fraction),
    st.integers(-3, 3).map(Decimal),
    st.complex_numbers(max_magnitude=10, allow_nan=False),
)
values = branch(st.one_of(ints, ints, branch(odd_values)))  # any single argument
sizes = st.one_of(st.integers(1, 8), st.integers(1, 8), values)  # mostly valid, often not
flags = st.one_of(st.booleans(), st.booleans(), values)

# A container of token ids, as a recipe: each backend gets its own fresh copy, so an iterator
# consumed by one is not empty for the other.
CONTAINERS = {
    "list": list,
    "tuple": tuple,
    "iterator": iter,
    "generator": lambda items: (x for x in items),
    "set": lambda items: set(items) if all(_hashable(x) for x in items) else list(items),
    "dict": lambda items: dict.fromkeys(items) if all(_hashable(x) for x in items) else items,
}


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


token_items = st.lists(
    st.one_of(st.integers(1, 40), st.integers(1, 40), st.sampled_from(EDGES), values),
    min_size=1,
    max_size=5,
)
containers = st.tuples(st.sampled_from(sorted(CONTAINERS)), token_items).map(
    lambda kind_items: lambda: CONTAINERS[kind_items[0]](kind_items[1])
)
token_lists = st.one_of(
    containers,
    containers,
    containers,
    st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=4).map(
        lambda xs: lambda: np.array(xs, dtype=np.int64)
    ),
    st.lists(
        st.one_of(st.integers(0, 40), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1])),
        min_size=1,
        max_size=4,
    ).map(lambda xs: lambda: np.array(xs, dtype=np.uint64)),
    st.lists(st.floats(0, 50), max_size=4).map(lambda xs: lambda: np.array(xs)),
    st.sampled_from(["ab", b"ab", "", [], range(1, 4), range(2**63 - 2, 2**63 + 1)]).map(
        lambda x: lambda: x
    ),
    values.map(lambda x: lambda: x),  # not a container at all
)


def outcome(call):
    """What a call did, comparable across backends: its value or its exception."""
    try:
        return "ok", call()
    except Exception as exc:  # noqa: BLE001 -- the exception is the observable result
        return type(exc), str(exc)


def agree(fn, *per_backend) -> tuple[bool, list]:
    """``fn(*args)`` for each backend, ``args`` taken from ``per_backend`` (one sequence per
    argument, one item per backend). Both must return, or both raise the same exception class
    with the same message. Returns whether they returned, and the two values."""
    results = [outcome(lambda a=args: fn(*a)) for args in zip(*per_backend, strict=True)]
    (kind_a, value_a), (kind_b, value_b) = results
    assert kind_a == kind_b, results
    if kind_a != "ok":
        assert value_a == value_b, results
        return False, []
    return True, [value_a, value_b]


def seq_state(seq) -> tuple:
    return (
        seq.seq_id,
        seq.token_ids,
        seq.max_tokens,
        seq.stop_token_ids,
        seq.finish_reason,
        seq.num_computed,
        seq.table.blocks,
    )


def step_state(batch) -> tuple:
    entries = [
        (e.seq.seq_id, e.start, e.num_tokens, e.is_prefill, e.spec_token_ids, e.token_ids)
        for e in batch.entries
    ]
    return entries, [s.seq_id for s in batch.preempted], batch.trace.to_dict()


def answers(batch) -> list[int]:
    """The runner's answer: a token per sampling entry, derived from its sequence (never 0)."""
    return [1 + (e.seq.num_tokens * 7 + e.seq.seq_id) % 40 for e in batch.entries if e.samples]


def run_both(scheds, steps: int, bad_tokens=None, bad_ids=()) -> None:
    """Step both schedulers ``steps`` times with the same answers, first aborting ``bad_ids``
    and offering ``bad_tokens()`` to ``commit`` each step; the batches, traces and finished
    sequences must be the same."""
    for _ in range(steps):
        if not scheds[0].has_unfinished():
            break
        idle_with_work = bool(scheds[0].waiting) and not scheds[0].running
        ok, batches = agree(lambda s: s.step(), scheds)
        assert ok and step_state(batches[0]) == step_state(batches[1])
        # an idle scheduler with requests waiting admits one (no livelock)
        assert batches[0].entries or not idle_with_work
        for seq_id in bad_ids:
            agree(lambda s, i: s.abort(i), scheds, [seq_id, seq_id])
        if bad_tokens is not None:
            tokens = [bad_tokens(), bad_tokens()]
            if agree(lambda s, b, t: s.commit(b, t), scheds, batches, tokens)[0]:
                continue
        ok, finished = agree(lambda s, b: s.commit(b, answers(b)), scheds, batches)
        assert ok and [seq_state(x) for x in finished[0]] == [seq_state(x) for x in finished[1]]
        for s in scheds:
            s.check_integrity()


def scheduler_pair(num_blocks=32, block_size=4, max_num_seqs=3, budget=64, **flags) -> list:
    require_fast()
    return [
        select(name).Scheduler(
            select(name).BlockPool(num_blocks, 1), block_size, max_num_seqs, budget, **flags
        )
        for name in BACKENDS
    ]


@settings(max_examples=500, deadline=None)
@given(
    prompt=token_lists,
    max_tokens=sizes,
    stops=st.one_of(st.none(), token_lists),
    caching=st.booleans(),
    chunked=st.booleans(),
    bad_tokens=st.one_of(st.none(), token_lists),
    bad_ids=st.lists(values, max_size=2),
)
def test_submit_commit_and_abort_agree_on_any_input(
    prompt, max_tokens, stops, caching, chunked, bad_tokens, bad_ids
):
    budget = 3 if chunked else 64  # a tiny budget: prompts are computed in chunks
    scheds = scheduler_pair(budget=budget, prefix_caching=caching, enable_chunked_prefill=chunked)
    for s in scheds:
        s.submit([1, 2, 3, 4, 5], 3)  # something running, for commit to refuse or take

    def submit(s):
        if stops is None:
            return s.submit(prompt(), max_tokens)
        return s.submit(prompt(), max_tokens, stops())

    ok, seqs = agree(submit, scheds)
    if ok:
        assert seq_state(seqs[0]) == seq_state(seqs[1])
    run_both(scheds, 12, bad_tokens, bad_ids)


def oracle_token(seq, offset: int = 0) -> int:
    """``answers``' token for ``seq`` once ``offset`` more tokens follow its newest one: the
    continuation a proposer would have to guess."""
    return 1 + ((seq.num_tokens + offset) * 7 + seq.seq_id) % 40


@settings(max_examples=300, deadline=None)
@given(
    config=st.fixed_dictionaries(
        {
            "num_blocks": st.integers(4, 16),
            "block_size": st.integers(1, 4),
            "max_num_seqs": st.integers(1, 4),
            "prefix_caching": st.booleans(),
            "enable_chunked_prefill": st.booleans(),
            "sliding_window": st.one_of(st.none(), st.integers(2, 6)),
        }
    ),
    prompts=st.lists(
        st.tuples(st.lists(st.integers(1, 6), min_size=1, max_size=8), st.integers(1, 8)),
        min_size=1,
        max_size=5,
    ),
    data=st.data(),
)
def test_speculative_steps_agree(config, prompts, data):
    """Random proposals -- each token the oracle's continuation or a random one, for decoding
    sequences and others, sometimes not token ids at all -- passed to both backends' ``step``,
    and random accepted prefixes (then the oracle's token) to ``commit``, sometimes a wrong
    answer: the same batches (proposals kept, token ids), traces, errors, states and outputs."""
    chunked = config.pop("enable_chunked_prefill")
    # chunked: a budget that proposals often exceed, so they are trimmed to it
    budget = max(config["max_num_seqs"], data.draw(st.integers(2, 10))) if chunked else 64
    scheds = scheduler_pair(budget=budget, enable_chunked_prefill=chunked, **config)
    for prompt, max_tokens in prompts:
        agree(lambda s, p=prompt, m=max_tokens: s.submit(p, m), scheds)
    for _ in range(40):
        if not scheds[0].has_unfinished():
            break
        proposals = {}
        for seq in scheds[0].running:
            right = [oracle_token(seq, i) for i in range(data.draw(st.integers(0, 5)))]
            proposals[seq.seq_id] = [
                t if data.draw(st.booleans()) else data.draw(st.integers(1, 40)) for t in right
            ]
        odd = {}  # seq_id -> a recipe: each backend gets its own copy (an iterator, say)
        if data.draw(st.integers(0, 9)) == 0:  # a bad proposal, or an unknown seq_id
            odd[data.draw(st.integers(0, 9))] = data.draw(token_lists)
        ok, batches = agree(
            lambda s, p=proposals, o=odd: s.step({**p, **{i: make() for i, make in o.items()}}),
            scheds,
        )
        if not ok:
            continue
        assert step_state(batches[0]) == step_state(batches[1])
        answer = []
        for e in batches[0].entries:
            if not e.samples:
                continue
            accepted = data.draw(st.integers(0, len(e.spec_token_ids)))
            tokens = [*e.spec_token_ids[:accepted], oracle_token(e.seq, accepted)]
            if data.draw(st.integers(0, 19)) == 0:  # a wrong answer: refused by both
                tokens = data.draw(st.one_of(st.just([]), st.lists(st.integers(0, 40))))
            answer.append(tokens if len(tokens) != 1 or data.draw(st.booleans()) else tokens[0])
        ok, finished = agree(lambda s, b, a=answer: s.commit(b, list(a)), scheds, batches)
        if not ok:  # refused, nothing changed: every proposal rejected goes through
            answer = [[oracle_token(e.seq)] for e in batches[0].entries if e.samples]
            ok, finished = agree(lambda s, b, a=answer: s.commit(b, list(a)), scheds, batches)
        assert ok and [seq_state(x) for x in finished[0]] == [seq_state(x) for x in finished[1]]
        assert [seq_state(x) for x in scheds[0].running] == [
            seq_state(x) for x in scheds[1].running
        ]
        for s in scheds:
            s.check_integrity()


# Pool sizes: small, or too large for any machine (NumPy refuses them at once); never an
# integer in between (a NumPy one included: both backends take those as the same int), which
# a backend might really try to allocate.
pool_sizes = st.one_of(
    st.integers(-1, 40),
    st.sampled_from([2**50, 2**63, 2**64]),
    branch(odd_values.filter(lambda v: not is_int(v) or v <= 40 or v >= 2**50)),
)


BIG_BLOCKS = [2**58, 2**59, 2**60, MAX_TOKEN_COUNT // 4, MAX_TOKEN_COUNT // 3]
valid_config = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(1, 40),
        "block_size": st.one_of(st.integers(1, 8), st.sampled_from(BIG_BLOCKS)),
        "max_num_seqs": st.integers(1, 8),
        "max_num_batched_tokens": st.integers(8, 64),
        "prefix_sharing": st.booleans(),
        "prefix_caching": st.booleans(),
        "enable_chunked_prefill": st.booleans(),
        "sliding_window": st.one_of(st.none(), st.integers(1, 8)),
    }
)


@settings(max_examples=400, deadline=None)
@given(
    config=valid_config,
    bad=st.one_of(
        st.none(),  # all valid (some sizes huge)
        st.tuples(
            st.sampled_from(
                [
                    "block_size",
                    "max_num_seqs",
                    "max_num_batched_tokens",
                    "prefix_sharing",
                    "prefix_caching",
                    "enable_chunked_prefill",
                    "sliding_window",
                ]
            ),
            values,
        ),
        st.tuples(st.just("num_blocks"), pool_sizes),
    ),
)
def test_constructors_agree_on_any_size(config, bad):
    """``BlockPool(num_blocks, 1)`` then ``Scheduler(pool, ...)`` with one argument replaced
    by a bad or extreme value: accepted or refused alike, and an accepted configuration
    schedules alike (no C overflow for huge sizes, whose pools hold up to 2**61 - 1 tokens)."""
    require_fast()
    if bad is not None:
        config = {**config, bad[0]: bad[1]}
    num_blocks = config.pop("num_blocks")
    sizes = [config.pop(name) for name in ("block_size", "max_num_seqs", "max_num_batched_tokens")]
    backends = [select(name) for name in BACKENDS]
    ok, pools = agree(lambda b: b.BlockPool(num_blocks, 1), backends)
    if not ok:
        return
    ok, scheds = agree(lambda b, p: b.Scheduler(p, *sizes, **config), backends, pools)
    event(f"accepted: {ok}")
    if not ok:
        return
    for name in (
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "prefix_sharing",
        "enable_chunked_prefill",
        "sliding_window",
    ):
        assert getattr(scheds[0], name) == getattr(scheds[1], name), name
    assert (scheds[0].prefix_cache is None) == (scheds[1].prefix_cache is None)
    for prompt in ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9]):
        agree(lambda s, p=prompt: s.submit(p, 4), scheds)
    run_both(scheds, 10)


POOL_OPS = ("incref", "decref", "refcount", "block_data")
TABLE_OPS = (
    "append_tokens",
    "blocks_needed",
    "writable_block",
    "borrow_prefix",
    "borrow_blocks",
    "release_before",
    "release",
)


def table_op(op: str, first, second):
    """The call ``op`` with these arguments, as a function of (pool, table, other table)."""
    if op in POOL_OPS:
        return lambda pool, table, other: getattr(pool, op)(first)
    if op == "borrow_prefix":  # from the other table of its backend (first == 0), or anything
        return lambda pool, table, other: table.borrow_prefix(
            other if first == 0 else first, second
        )
    if op == "borrow_blocks":
        return lambda pool, table, other: table.borrow_blocks([first], second)
    if op == "release":
        return lambda pool, table, other: table.release()
    return lambda pool, table, other: getattr(table, op)(first)


@settings(max_examples=400, deadline=None)
@example(block_size=1, ops=[("append_tokens", 1, 50), ("writable_block", 0, None)])
@given(
    block_size=st.one_of(sizes, st.sampled_from([2**58, MAX_TOKEN_COUNT // 8 + 1])),
    ops=st.lists(
        st.tuples(
            st.sampled_from(POOL_OPS + TABLE_OPS), st.one_of(st.integers(0, 12), values), values
        ),
        max_size=12,
    ),
)
def test_block_tables_and_pools_agree_on_any_argument(block_size, ops):
    """``BlockTable(pool, block_size)`` over an 8-block pool, then table and pool methods with
    arbitrary arguments: same results, same errors, same refcounts and blocks after each."""
    require_fast()
    backends = [select(name) for name in BACKENDS]
    pools = [b.BlockPool(8, 2) for b in backends]
    ok, tables = agree(lambda b, p: b.BlockTable(p, block_size), backends, pools)
    if not ok:
        return
    others = [b.BlockTable(p, block_size) for b, p in zip(backends, pools, strict=True)]
    for op, first, second in ops:
        ok, results = agree(table_op(op, first, second), pools, tables, others)
        if ok and op in ("block_data", "writable_block"):  # a block's bytes, or None: no room
            first_bytes, second_bytes = (r if r is None else bytes(r) for r in results)
            assert first_bytes == second_bytes, (op, first, second)
        elif ok:
            assert results[0] == results[1], (op, first, second)
        assert tables[0].blocks == tables[1].blocks
        assert tables[0].num_tokens == tables[1].num_tokens
        assert [pools[0].refcount(b) for b in range(8)] == [pools[1].refcount(b) for b in range(8)]
        if op == "append_tokens" and ok and results[0]:  # then borrow from a table with tokens
            for other in others:
                other.release()
            agree(lambda o, t: o.borrow_prefix(t, t.num_tokens), others, tables)


# -- the examples, as plain regression tests ------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "token", [2**63, 2**64 - 1, 2**64, 10**30, np.uint64(2**63), np.uint64(2**64 - 1), -1]
)
def test_token_ids_outside_int64_are_refused_by_both(backend, token):
    require_fast()
    sched = scheduler_pair()[BACKENDS.index(backend)]
    for call in (
        lambda: sched.submit([1, token], 4),
        lambda: sched.submit((token,), 4),
        lambda: sched.submit(iter([token]), 4),
        lambda: sched.submit([1], 4, [token]),
    ):
        with pytest.raises(ValueError, match="non-negative ints below 2\\*\\*63"):
            call()
    if 0 <= token < 2**64:  # as a NumPy array of unsigned ints
        with pytest.raises(ValueError, match="non-negative ints below 2\\*\\*63"):
            sched.submit(np.array([1, token], dtype=np.uint64), 4)
    assert not sched.has_unfinished()  # nothing queued
    seq = sched.submit([1, MAX_TOKEN_ID], 4, [MAX_TOKEN_ID])  # the largest id is fine
    assert seq.token_ids == [1, MAX_TOKEN_ID]
    batch = sched.step()
    with pytest.raises(ValueError, match="next_tokens must be non-negative ints below 2\\*\\*63"):
        sched.commit(batch, [2**63])
    assert sched.commit(batch, [MAX_TOKEN_ID]) == [seq] and seq.finish_reason == "stop"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_tokens", [65, 2**61, 2**63, 2**64, 10**30])
def test_too_many_max_tokens_is_request_too_long_on_both(backend, max_tokens):
    require_fast()
    sched = scheduler_pair()[BACKENDS.index(backend)]
    with pytest.raises(RequestTooLongError, match="exceed max_num_batched_tokens 64"):
        sched.submit([1, 2], max_tokens)
    assert not sched.has_unfinished()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "args",
    [
        (2**63 - 1, 4, 64),  # crashed the mirror (C overflow in the block count)
        (2**61, 4, 64),
        (4, 4, 2**61),
        (4, 2**63, 2**64),
    ],
)
def test_sizes_beyond_the_documented_bound_are_refused_by_both(backend, args):
    require_fast()
    b = select(backend)
    with pytest.raises(ValueError, match="at most 2\\*\\*61 - 1"):
        b.Scheduler(b.BlockPool(4, 1), *args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pool_holding_more_than_the_bound_in_tokens_is_refused(backend):
    require_fast()
    b = select(backend)
    pool = b.BlockPool(4, 1)
    for make in (lambda: b.Scheduler(pool, 2**60, 4, 64), lambda: b.BlockTable(pool, 2**60)):
        with pytest.raises(
            ValueError, match="more than the 2305843009213693951 \\(2\\*\\*61 - 1\\)"
        ):
            make()
    sched = b.Scheduler(pool, MAX_TOKEN_COUNT // 4, 4, 64)  # exactly at the bound: fine
    sched.submit([1, 2, 3], 5)
    batch = sched.step()
    assert batch.trace.capacity_tokens == 4 * (MAX_TOKEN_COUNT // 4)  # no C overflow
    assert b.BlockTable(pool, MAX_TOKEN_COUNT // 4).append_tokens(2**62) is False


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("source", [None, 0, "table", BlockTable])
def test_borrowing_from_something_that_is_not_a_table_is_a_type_error(backend, source):
    require_fast()
    b = select(backend)
    table = b.BlockTable(b.BlockPool(4, 1), 2)
    with pytest.raises(TypeError, match="borrow_prefix needs a BlockTable"):
        table.borrow_prefix(source, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [float("nan"), 1.5, -1, True, np.bool_(True), "3", None])
def test_blocks_needed_checks_its_argument_like_append_tokens(backend, n):
    require_fast()
    b = select(backend)
    table = b.BlockTable(b.BlockPool(4, 1), 2)
    with pytest.raises(ValueError, match="blocks_needed needs a non-negative int"):
        table.blocks_needed(n)
    with pytest.raises(ValueError, match="append_tokens needs a non-negative int"):
        table.append_tokens(n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_numpy_token_count_is_the_python_int(backend):
    """NumPy integers are integers (mie.checks.as_int), in the allocator as everywhere."""
    require_fast()
    b = select(backend)
    table = b.BlockTable(b.BlockPool(4, 1), 2)
    assert table.blocks_needed(np.int64(3)) == table.blocks_needed(3) == 2
    assert table.append_tokens(np.uint8(3)) and table.num_tokens == 3
    assert type(table.num_tokens) is int
