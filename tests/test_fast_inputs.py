"""The Cython ``prepare_inputs`` (``mie._fast.inputs``) against the reference
(``mie.model.inputs.prepare_inputs``).

Random batches of the fast scheduler's entries -- decodes, prompt chunks, verifications
with proposed tokens, every ``all_positions`` form -- over tables that borrow each other's
blocks (shared blocks the reference refuses to write) and release leading blocks (a sliding
window): the mirror must give the reference's arrays, dtypes and shapes included, and
wherever the reference raises, the same exception with the same message.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mie.backend import select
from mie.model.inputs import prepare_inputs as reference


def fast_modules(fast):
    """The mirror and the fast allocator and scheduler (``fast``: conftest's fixture, a skip
    without the compiled backend, a failure under CI)."""
    from mie._fast import inputs, memory, scheduler

    return inputs, memory, scheduler


def arrays_of(inputs) -> dict:
    """Every field as comparable values (arrays with their dtype and shape)."""
    fields = {
        name: getattr(inputs, name)
        for name in (
            "token_ids",
            "positions",
            "slot_mapping",
            "decode_rows",
            "decode_block_tables",
            "decode_context_lens",
            "logits_rows",
        )
    }
    out = {name: (a.dtype.str, a.shape, a.tolist()) for name, a in fields.items()}
    out["prefills"] = [
        (s.rows, s.block_ids.dtype.str, s.block_ids.tolist(), s.start) for s in inputs.prefills
    ]
    return out


def outcome(prepare, entries, all_positions):
    try:
        return "ok", arrays_of(prepare(entries, all_positions=all_positions))
    except Exception as exc:  # the error is part of the contract
        return type(exc).__name__, str(exc)


@st.composite
def batches(draw, memory, scheduler):
    block_size = draw(st.integers(1, 4))
    pool = memory.BlockPool(48, 8)
    sequences = []
    for seq_id in range(draw(st.integers(1, 4))):
        num_tokens = draw(st.integers(1, 12))
        tokens = draw(st.lists(st.integers(-5, 600), min_size=num_tokens, max_size=num_tokens))
        table = pool.new_table(block_size)
        whole = [s.table for s in sequences if not s.table.num_released]
        if whole and draw(st.booleans()):  # a shared prefix: blocks with refcount 2
            source = draw(st.sampled_from(whole))
            shared = min(source.num_tokens, num_tokens) // block_size * block_size
            table.borrow_prefix(source, shared)
        table.append_tokens(num_tokens - table.num_tokens + draw(st.integers(0, 3)))
        if draw(st.booleans()):  # a sliding window gave some leading blocks back
            table.release_before(draw(st.integers(0, num_tokens)))
        sequences.append(scheduler.Sequence(seq_id, tokens, 8, (), table))
    entries = []
    for _ in range(draw(st.integers(1, 5))):
        seq = draw(st.sampled_from(sequences))
        n = draw(st.integers(1, 5))
        start = draw(st.integers(0, seq.num_tokens + 1))
        spec = tuple(draw(st.lists(st.integers(0, 600), max_size=n - 1)))
        entries.append(scheduler.BatchEntry(seq, start, n, n > 1, spec))
    form = draw(st.sampled_from(["bool", "list", "tuple", "short"]))
    flags = [draw(st.booleans()) for _ in entries]
    all_positions = {
        "bool": draw(st.booleans()),
        "list": flags,
        "tuple": tuple(flags),
        "short": flags[:-1],
    }[form]
    return entries, all_positions


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fast_prepare_inputs_gives_the_reference_inputs_and_errors(fast, data):
    inputs, memory, scheduler = fast_modules(fast)
    entries, all_positions = data.draw(batches(memory, scheduler))
    expected = outcome(reference, entries, all_positions)
    assert outcome(inputs.prepare_inputs, entries, all_positions) == expected


def test_the_one_pass_takes_the_engines_batches(fast):
    """The common batches (decodes, a chunk, a verification) are the one pass's, not handed
    to the reference -- which would pass the test above too, only slower."""
    inputs, memory, scheduler = fast_modules(fast)
    pool = memory.BlockPool(16, 8)
    entries = []
    for seq_id, (start, n, spec) in enumerate([(9, 1, ()), (0, 6, ()), (7, 3, (5, 6))]):
        table = pool.new_table(4)
        table.append_tokens(start + n)
        seq = scheduler.Sequence(seq_id, list(range(start + n - len(spec))), 8, (), table)
        entries.append(scheduler.BatchEntry(seq, start, n, n > 1, spec))
    original = inputs.reference_prepare_inputs

    def refuse(*args, **kwargs):
        raise AssertionError("handed to the reference")

    inputs.reference_prepare_inputs = refuse
    try:
        prepared = inputs.prepare_inputs(entries, all_positions=[False, False, True])
    finally:
        inputs.reference_prepare_inputs = original
    assert arrays_of(prepared) == arrays_of(reference(entries, all_positions=[False, False, True]))


def test_each_backend_prepares_with_its_own_function(fast):
    from mie._fast.inputs import prepare_inputs

    assert select("fast").prepare_inputs is prepare_inputs
    assert select("python").prepare_inputs is reference


def test_the_reference_schedulers_entries_over_a_fast_table_too(fast):
    """The one pass reads entries by their attributes, as the reference does: the reference
    scheduler's entries over a fast table give the same inputs, and a start no table can
    hold the reference's own error (not an overflow of the mirror's C integers)."""
    from mie.scheduler import BatchEntry, Sequence

    inputs, memory, _ = fast_modules(fast)
    table = memory.BlockPool(8, 8).new_table(4)
    table.append_tokens(10)
    seq = Sequence(0, list(range(9)), 8, (), table)
    entries = [BatchEntry(seq, 6, 4, False, (7,))]
    expected = outcome(reference, entries, True)
    assert expected[0] == "ok"
    assert outcome(inputs.prepare_inputs, entries, True) == expected
    huge = [BatchEntry(seq, 2**70, 1, False)]
    expected = outcome(reference, huge, False)
    assert expected[0] == "ValueError"
    assert outcome(inputs.prepare_inputs, huge, False) == expected
