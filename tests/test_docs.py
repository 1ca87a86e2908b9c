"""The shipped text as a reader meets it: figures have one home, and nothing points at a tracker
the repository does not contain.

* bench/RESULTS.md is where measured figures live; the docs link to its sections instead of
  copying numbers (copies drift: two sources disagree sooner or later). Every link into it
  with a ``#fragment`` must name one of its headings, as GitHub spells a heading's anchor, so a
  renamed section breaks a test rather than a reader's click.
* No "issue N" in code, messages, docstrings, tests or docs: the tracker is not shipped, so
  such a number tells a reader nothing (git keeps the history of why a thing is there).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

# A Markdown link into RESULTS.md with a fragment; the link text may span lines.
RESULTS_LINK = re.compile(r"\]\((?:\.\./)?bench/RESULTS\.md#([^)\s]+)\)")
TRACKER_NUMBER = re.compile(r"issues?\s?#?[0-9]+", re.IGNORECASE)
SHIPPED = ("mie", "tests", "docs", "bench", "scripts", "cuda")
SUFFIXES = {".py", ".pyx", ".pxd", ".md", ".h", ".cu", ".sh"}


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped (hyphens and
    underscores kept), each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def results_anchors() -> set[str]:
    text = RESULTS.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # a "# comment" in a code block is no heading
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_github_anchor_spells_headings_as_github_does():
    assert github_anchor("Chunked vs whole prefill") == "chunked-vs-whole-prefill"
    assert (
        github_anchor("Fast backend (Cython) against the Python reference")
        == "fast-backend-cython-against-the-python-reference"
    )
    assert (
        github_anchor("Reduced precision: throughput per weight format, and llama.cpp on it")
        == "reduced-precision-throughput-per-weight-format-and-llamacpp-on-it"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_into_the_results_name_sections_that_exist(doc):
    anchors = results_anchors()
    links = RESULTS_LINK.findall(doc.read_text(encoding="utf-8"))
    missing = [fragment for fragment in links if fragment not in anchors]
    assert not missing, f"{doc.name} links to sections RESULTS.md does not have: {missing}"


def test_the_docs_link_to_the_results_sections_they_rely_on():
    """The docs explain these sections' figures: they link to them instead of restating them."""
    linked = {f for doc in DOCS for f in RESULTS_LINK.findall(doc.read_text(encoding="utf-8"))}
    for section in (
        "paged-attention-per-instruction-set-and-cache-dtype",
        "reduced-precision-matrix-products-per-instruction-set",
        "accuracy-per-weight-format-and-kv-cache",
        "chunked-vs-whole-prefill",
        "routing-across-replicas-ray-serve",
        "grammar-engines-llguidance-and-xgrammar",
    ):
        assert section in linked, section


def shipped_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in SHIPPED:
        files += [p for p in sorted((ROOT / top).rglob("*")) if p.suffix in SUFFIXES]
    return [p for p in files if p.is_file() and "__pycache__" not in p.parts]


def test_no_tracker_numbers_in_shipped_text():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in shipped_files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if TRACKER_NUMBER.search(line)
    ]
    assert not found, "say what the thing is, not which ticket asked for it:\n" + "\n".join(found)
