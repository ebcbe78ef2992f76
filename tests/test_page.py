"""One page renderer (kvgate.page): the same blocks to Markdown and to HTML; the experiment pages under docs/results
are what it renders from their result.json."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

import kvgate.page
from kvgate.experiments.runner import experiment_page, index_page
from kvgate.page import Bullets, Cell, Code, Details, Em, Figure, Heading, Link, Page, Para, Pre, Strong, Table

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def test_the_module_example() -> None:
    assert doctest.testmod(kvgate.page).failed == 0


def test_one_page_two_renderings() -> None:
    page = Page("A <page>", [
        Heading("Claims"),
        Para(("Read ", Link("the notes", "notes/index.md", "notes/index.html"), ", then ", Em("this"), ".")),
        Table(["claim", "verdict"], [["a | b", Cell(Strong("reproduced"), "reproduced")], ["c\nd", ""]]),
        Bullets([(Code("kvgate sim"), " runs one")]),
        Pre("x < y"),
        Figure("figures/a.png", "hit ratio"),
    ], head="head", back=Link("up", "../index.md", "../index.html"), css="td{}")
    md = page.markdown()
    assert md == (
        "# A <page>\n\n## Claims\n\nRead [the notes](notes/index.md), then *this*.\n\n"
        "| claim | verdict |\n|---|---|\n| a \\| b | **reproduced** |\n| c d |  |\n\n- `kvgate sim` runs one\n\n"
        "```\nx < y\n```\n\n![hit ratio](figures/a.png)\n\n*hit ratio*\n"
    )
    h = page.html()
    assert h.startswith("<!doctype html><html><head><meta charset='utf-8'><title>head</title><style>td{}</style>")
    assert "<p><a href='../index.html'>up</a></p><h1>A &lt;page&gt;</h1>" in h
    assert "<a href='notes/index.html'>the notes</a>" in h and "<em>this</em>" in h
    assert "<td class='reproduced'><strong>reproduced</strong></td>" in h and "<td>a | b</td>" in h
    assert "<pre>x &lt; y</pre>" in h and "<figcaption>hit ratio</figcaption>" in h and h.endswith("</html>\n")


PAGES = sorted(p for p in RESULTS.glob("*/result.json") if "verdicts" in json.loads(p.read_text()))


@pytest.mark.skipif(not PAGES, reason="no experiment pages under docs/results")
@pytest.mark.parametrize("result", PAGES, ids=[p.parent.name for p in PAGES])
def test_an_experiment_page_is_rendered_from_its_results(result: Path) -> None:
    page = experiment_page(json.loads(result.read_text()))
    assert page.markdown() == (result.parent / "index.md").read_text()
    assert "← all experiments" in page.html()


@pytest.mark.skipif(not PAGES, reason="no experiment pages under docs/results")
def test_the_index_counts_every_claim_once() -> None:
    pages = {p.parent.name: json.loads(p.read_text()) for p in PAGES}
    md = index_page(RESULTS, pages, quick=False).markdown()
    paper = sum(v for n, p in pages.items() if p.get("group", "paper") == "paper" for v in p["verdicts"].values())
    assert f"Of {paper} claims:" in md or paper == 0
    for name in pages:
        assert f"({name}/index.md)" in md


def test_details_fold_their_blocks_under_a_summary() -> None:
    p = Page("T", [Details("a <b> & c's", [Pre("x: 1")]), Para("after")])
    assert p.markdown() == ("# T\n\n<details><summary>a &lt;b&gt; &amp; c's</summary>\n\n```\nx: 1\n```\n</details>"
                            "\n\nafter\n")
    assert "<details><summary>a &lt;b&gt; &amp; c&#x27;s</summary><pre>x: 1</pre></details><p>after</p>" in p.html()
