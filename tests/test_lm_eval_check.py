"""``scripts/lm_eval_check.py`` without lm-eval: its task data and its comparison.

lm-evaluation-harness itself is not in the test extras (see bench/RESULTS.md, "lm-evaluation-
harness"): the check against a live server and transformers is that documented command. What
can rot without it running -- the committed task data, and the rule by which the script
judges two runs equal -- is tested here.
"""

import json
from pathlib import Path

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "tests" / "data" / "lm_eval"


def test_the_tasks_name_their_committed_data_and_every_document_is_coherent():
    script = load_script("lm_eval_check")
    for task in script.TASKS:
        text = (TASK_DIR / f"{task}.yaml").read_text()
        assert f"task: {task}\n" in text and "test: tests/data/lm_eval/stories.jsonl" in text
    docs = [json.loads(line) for line in (TASK_DIR / "stories.jsonl").read_text().splitlines()]
    assert len(docs) == 32 and [d["id"] for d in docs] == list(range(32))
    for doc in docs:
        assert len(set(doc["choices"])) == 4 and 0 <= doc["label"] < 4
        # The story goes on with the right choice (what the multiple-choice task scores).
        assert doc["text"].startswith(f"{doc['context']} {doc['choices'][doc['label']]}")


def test_the_comparison_allows_only_rounding_and_the_decoded_alone_leading_space():
    script = load_script("lm_eval_check")
    tasks = script.TASKS
    runs = {
        tasks[0]: {0: [(-1.0, True), (-2.5, False)]},
        tasks[1]: {0: [-30.25]},
        tasks[2]: {0: [" mom"]},
    }
    reference = {
        "samples": {  # transformers: rounding apart, the same; its text decoded alone
            tasks[0]: {0: [(-1.0 + 5e-5, True), (-2.5, False)]},
            tasks[1]: {0: [-30.25 - 5e-5]},
            tasks[2]: {0: ["mom"]},
        }
    }
    problems, figures = script.compare({"samples": runs}, reference, 1e-4)
    assert problems == []
    assert figures["loglikelihoods"] == 3 and figures["is_greedy"] == 2
    assert figures["strings"] == 1 and figures["greedy_true"] == 1

    def problems_with(task, response) -> list[str]:
        changed = {t: dict(docs) for t, docs in reference["samples"].items()}
        changed[task] = {0: response}
        return script.compare({"samples": runs}, {"samples": changed}, 1e-4)[0]

    assert problems_with(tasks[1], [-30.25 + 2e-4])  # beyond the tolerance
    assert problems_with(tasks[0], [(-1.0, False), (-2.5, False)])  # is_greedy differs
    assert problems_with(tasks[2], ["dad"])
    assert problems_with(tasks[2], ["mom "])  # only one leading space may differ
    assert script.same_continuation(" mom", "mom") and not script.same_continuation("mom", " mom")
