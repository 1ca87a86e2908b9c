"""The speculative-decoding section, --quick on the Python backend (the full run takes a minute
or two): its JSON's structure, every figure consistent with the counts it comes from, the
targets with their rows; and ``replay_ngram`` on hand-checked sequences."""

import json

import numpy as np
import pytest

from mie.bench import __main__ as bench
from mie.bench import speculative
from mie.bench.speculative import replay_ngram

ROW_KEYS = {
    "config",
    "tokens",
    "seconds",
    "tokens_per_s",
    "ms_per_token",
    "steps",
    "tokens_per_step",
    "proposed",
    "accepted",
    "acceptance_rate",
    "speedup",
    "speedup_interval",
    "speedup_bound",
    "round_speedups",
    "round_seconds",
    "identical",
    "rounds",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The section's JSON and printed report."""
    path = tmp_path_factory.mktemp("bench") / "speculative.json"
    argv = ["--only", "speculative", "--quick", "--backend", "python", "--json", str(path)]
    assert bench.main(argv) == 0
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def result(run):
    return run["speculative"]


def tables(result: dict) -> list[list[dict]]:
    """Every table of rows measured against the plain row first in it."""
    return [result["grounded"], *result["free"].values(), result["batch16"]]


def test_registered_as_a_default_section():
    assert bench.SECTIONS["speculative"] is speculative.run


def test_every_table_has_plain_first_then_speculation(result):
    assert result["backend"] == "python"
    sweep = [speculative.ngram_label(k, lookup) for k, lookup in speculative.NGRAM_SWEEP[:2]]
    draft = f"draft model (itself), k={speculative.DRAFT_K}"
    assert [row["config"] for row in result["grounded"]] == ["plain", *sweep, draft]
    chosen = speculative.chosen_label(result)
    assert chosen in sweep
    assert list(result["free"]) == ["greedy", "temperature 0.8, seeded"]
    for rows in [*result["free"].values(), result["batch16"]]:
        assert [row["config"] for row in rows] == ["plain", chosen]
    for rows in tables(result):
        for row in rows:
            assert set(row) >= ROW_KEYS
            assert row["rounds"] == result["rounds"] == 1


def test_figures_follow_from_the_counts(result):
    for rows in tables(result):
        plain = rows[0]
        for row in rows:
            assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
            assert row["ms_per_token"] == pytest.approx(row["seconds"] / row["tokens"] * 1e3)
            assert row["tokens_per_step"] == pytest.approx(row["tokens"] / row["steps"])
            ratios = [
                (row["tokens"] / mine) / (plain["tokens"] / theirs)
                for mine, theirs in zip(row["round_seconds"], plain["round_seconds"], strict=True)
            ]
            assert row["round_speedups"] == pytest.approx(ratios)
            assert row["speedup"] == pytest.approx(float(np.median(ratios)))
            assert 0 <= row["accepted"] <= row["proposed"]
            expected = row["accepted"] / row["proposed"] if row["proposed"] else 0.0
            assert row["acceptance_rate"] == pytest.approx(expected)
        assert plain["proposed"] == 0 and plain["speedup"] == pytest.approx(1.0)


def test_a_speed_up_pairs_each_round_with_plain_decodings_same_round():
    """The median of the rounds' ratios, not the ratio of the medians: plain ran 1, 2, 1 s
    and the other 2, 2, 0.5 s (the same tokens): rounds of 0.5x, 1x, 2x, so 1x -- where the
    medians' ratio, 1 s against 2 s, would say 0.5x."""
    plain = speculative.Configuration("plain", make=None, seconds=[1.0, 2.0, 1.0], tokens=10)
    other = speculative.Configuration("other", make=None, seconds=[2.0, 2.0, 0.5], tokens=10)
    for each in (plain, other):
        each.steps, each.outputs = 10, [[[1, 2]]] * 3
    row = other.summary(plain)
    assert row["round_speedups"] == pytest.approx([0.5, 1.0, 2.0])
    assert row["speedup"] == pytest.approx(1.0)
    assert row["tokens_per_s"] == pytest.approx(10 / 2.0)  # its median round, as before


def test_every_round_runs_on_an_engine_of_its_own():
    """An engine keeps its speed for its lifetime (where its memory landed), so each round
    builds one rather than carrying one engine's luck into every round."""
    model_dir = speculative.default_model()
    config = speculative.build("plain", model_dir, "python", 0, None, 1)
    engines, make = [], config.make
    config.make = lambda: engines.append(make()) or engines[-1]
    for _ in range(2):
        config.run(["Once upon a time"], speculative.greedy(1, 4), batch=False)
    assert len(engines) == 2 and engines[0] is not engines[1]
    assert config.outputs[0] == config.outputs[1] and config.steps == 4


def test_outputs_are_plain_decodings(result):
    """Speculation never changes the tokens: every row is identical, so every row generated
    as many tokens as plain decoding did; at batch 1 plain decoding yields one token a step."""
    for rows in tables(result):
        for row in rows:
            assert row["identical"] is True
            assert row["tokens"] == rows[0]["tokens"]
    for rows in [result["grounded"], *result["free"].values()]:
        assert rows[0]["steps"] == rows[0]["tokens"]


def test_the_draft_that_is_the_target_is_accepted(result):
    draft = result["grounded"][-1]
    assert draft["proposed"] > 0
    assert draft["acceptance_rate"] > 0.9
    assert draft["tokens_per_step"] > 2


def test_replay_bound_is_reported_for_every_ngram_row(result):
    for row in result["grounded"][1:-1]:
        assert row["oracle_tokens_per_step"] >= 1
        assert 0 <= row["oracle_acceptance_rate"] <= 1
    assert "oracle_tokens_per_step" not in result["grounded"][0]


def test_verification_rows_follow_from_their_step_times(result):
    rows = result["verification"]
    assert [row["positions"] for row in rows] == list(speculative.POSITIONS)
    for row in rows:
        n, step_s = row["positions"], row["step_ms"] / 1e3
        assert row["step_ratio"] == pytest.approx(row["step_ms"] / rows[0]["step_ms"])
        assert row["perfect_tokens_per_s"] == pytest.approx(n / step_s)
        assert row["perfect_speedup"] == pytest.approx(n / row["step_ratio"])


def test_targets_are_the_rows_against_their_goals(result):
    grounded, free, batch = result["targets"]
    row = next(r for r in result["grounded"] if r["config"] == speculative.chosen_label(result))
    assert grounded["value"] == row["speedup"]
    assert grounded["goal"] == speculative.TARGET_GROUNDED
    free_rows = [rows[1] for rows in result["free"].values()]
    assert free["value"] == min(r["speedup"] for r in free_rows)
    assert free["goal"] == pytest.approx(1 - speculative.TARGET_FREE_SLOWDOWN)
    assert batch["value"] == result["batch16"][1]["speedup"] and batch["goal"] == 1.0
    # --quick runs one round: too few for an interval, so nothing is met; missed when the
    # tokens differ or the tokens per step cannot reach the goal, whatever the speed
    for target in result["targets"]:
        assert target["interval"] is None and target["met"] == (target["status"] == "met")
    plain = result["grounded"][0]
    assert row["speedup_bound"] == pytest.approx(row["tokens_per_step"] / plain["tokens_per_step"])
    reachable = row["identical"] and row["speedup_bound"] >= grounded["goal"]
    assert grounded["status"] == ("not resolved" if reachable else "missed")
    assert free["status"] == batch["status"] == "not resolved"
    chosen = max(result["grounded"][1:-1], key=lambda r: r["speedup"])
    assert chosen["config"] == speculative.chosen_label(result)


def test_report_names_every_target_met_missed_or_not_resolved(result):
    text = speculative.report(result)
    assert text.startswith("Speculative decoding: stories260K, backend python")
    words = {"met": "met (", "missed": "MISSED", "not resolved": "NOT RESOLVED"}
    for target in result["targets"]:
        line = next(line for line in text.splitlines() if target["name"] in line)
        assert [status for status, word in words.items() if word in line] == [target["status"]]
    assert len(result["load_average"]) == 2 and all(len(a) == 3 for a in result["load_average"])


def test_replay_accepts_what_the_lookup_gets_right():
    # Step 1: nothing to look up, yields 1; step 2: [1] was followed by [2, 3]: both right,
    # yields 3; the last token has no room for proposals.
    assert replay_ngram([1, 2, 3, 4], [1, 2, 3, 4, 5], 2, (1, 3)) == {
        "steps": 3,
        "proposed": 2,
        "accepted": 2,
    }


def test_replay_cuts_proposals_to_the_output_and_counts_wrong_ones():
    # Step 2 has room for one proposal before the output's last token: [2], right.
    assert replay_ngram([1, 2, 3, 4], [1, 2, 7], 4, (1, 3)) == {
        "steps": 2,
        "proposed": 1,
        "accepted": 1,
    }
    # The same proposal, wrong: the step yields the model's token only.
    assert replay_ngram([1, 2, 3, 4], [1, 5, 6], 4, (1, 3)) == {
        "steps": 3,
        "proposed": 1,
        "accepted": 0,
    }


def test_replay_looks_up_only_the_lengths_asked_for():
    # The last 1 token [1] occurs earlier, but a lookup of 2 or more finds nothing.
    assert replay_ngram([1, 2, 3, 4], [1, 2], 4, (2, 3)) == {
        "steps": 2,
        "proposed": 0,
        "accepted": 0,
    }


def row(interval: list[float] | None, identical: bool = True, bound: float = 16.0) -> dict:
    """A speed-up row with just what ``targets`` reads: its interval, the median inside, the
    bound its tokens per step set."""
    median = 1.0 if interval is None else sum(interval) / 2
    return {
        "speedup": median,
        "speedup_interval": interval,
        "speedup_bound": bound,
        "identical": identical,
    }


def synthetic(grounded: dict, free: list[dict], batch: dict) -> dict:
    """A result with just what ``targets`` reads: the chosen n-gram row, the free and batch
    rows."""
    label = speculative.ngram_label(4, (1, 3))
    return {
        "chosen_ngram": {"k": 4, "lookup": [1, 3]},
        "grounded": [dict(grounded, config=label)],
        "free": {"greedy": [{}, free[0]], "seeded": [{}, free[1]]},
        "batch16": [{}, batch],
        "batch": 16,
    }


@pytest.mark.parametrize(
    ("grounded", "free", "batch", "status"),
    [
        # every interval at or above its goal (the goals themselves included): met
        (row([1.8, 2.0]), [row([0.95, 1.1]), row([1.0, 1.2])], row([1.0, 1.1]), ["met"] * 3),
        # every interval below its goal: missed
        (
            row([1.5, 1.79]),
            [row([0.9, 0.94]), row([1.0, 1.2])],
            row([0.8, 0.99]),
            ["missed"] * 3,
        ),
        # every interval holding its goal, or no interval: not resolved
        (
            row([1.7, 1.9]),
            [row([0.9, 1.0]), row(None)],
            row([0.99, 1.01]),
            ["not resolved"] * 3,
        ),
        # fast but not plain's tokens: missed; one free row below its goal, the other above
        (
            row([2.5, 3.0], identical=False),
            [row([1.0, 1.1]), row([0.8, 0.9])],
            row(None),
            [
                "missed",
                "missed",
                "not resolved",
            ],
        ),
        # the intervals hold the goals, but the tokens per step cannot reach them: missed
        (
            row([1.7, 1.9], bound=1.74),
            [row([0.9, 1.0]), row([0.9, 1.0], bound=0.94)],
            row(None),
            [
                "missed",
                "missed",
                "not resolved",
            ],
        ),
    ],
)
def test_targets_judge_the_intervals_against_the_goals(grounded, free, batch, status):
    found = speculative.targets(synthetic(grounded, free, batch))
    assert [t["status"] for t in found] == status
    assert [t["met"] for t in found] == [s == "met" for s in status]
    slowest = min(free, key=lambda r: r["speedup"])
    assert [t["value"] for t in found] == [
        grounded["speedup"],
        slowest["speedup"],
        batch["speedup"],
    ]
    assert found[1]["interval"] == slowest["speedup_interval"]
    assert found[1]["bound"] == min(r["speedup_bound"] for r in free)


@pytest.mark.parametrize(
    ("n", "ranks"),
    # the 95% interval's ranks in the published tables of the sign test's median interval
    [
        (5, None),
        (6, (1, 6)),
        (8, (1, 8)),
        (9, (2, 8)),
        (10, (2, 9)),
        (15, (4, 12)),
        (20, (6, 15)),
        (30, (10, 21)),
    ],
)
def test_median_interval_takes_the_tables_order_statistics(n, ranks):
    values = np.random.default_rng(n).permutation(np.arange(1.0, n + 1) * 10)
    expected = None if ranks is None else [ranks[0] * 10.0, ranks[1] * 10.0]
    assert speculative.median_interval(values) == expected


def test_median_interval_holds_the_median_as_often_as_it_says():
    """Drawn from a skewed distribution whose median is 1 (lognormal), nine rounds at a time:
    the interval (2nd to 8th) holds 1 in 96.1% of the draws, not in 82% (3rd to 7th) nor in
    99.6% (1st to 9th)."""
    rng = np.random.default_rng(0)
    draws = rng.lognormal(0.0, 0.5, size=(20_000, 9))
    held = [lo <= 1.0 <= hi for lo, hi in map(speculative.median_interval, draws)]
    assert 0.955 <= np.mean(held) <= 0.967
