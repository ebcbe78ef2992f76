"""A page of results: a title and a list of blocks (headings, paragraphs, tables, lists, code, figures, folded
details), rendered to Markdown and to HTML by one renderer each, so the two say the same thing.

Inline content (:data:`Span`) is plain text, or :class:`Em`, :class:`Strong`, :class:`Code`, :class:`Link`, or a
tuple of spans. Plain text is written as it is in Markdown paragraphs (a page's author may use Markdown there),
flattened to one line with ``|`` escaped in table cells and list items, and always escaped in HTML. A table cell
may carry a CSS class (:class:`Cell`: a verdict's colour), which only the HTML shows.

>>> p = Page("Results", [Para("Two runs."), Table(["run", "hit"], [["a", "0.9"], [Cell(Strong("b"), "x"), "0.2"]])])
>>> print(p.markdown(), end="")
# Results
<BLANKLINE>
Two runs.
<BLANKLINE>
| run | hit |
|---|---|
| a | 0.9 |
| **b** | 0.2 |
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Em:
    text: Span


@dataclass(frozen=True)
class Strong:
    text: Span


@dataclass(frozen=True)
class Code:
    text: str


@dataclass(frozen=True)
class Link:
    text: Span
    href: str
    html_href: str | None = None
    """Where the HTML page links (e.g. a sibling page's ``index.html`` for the Markdown's ``index.md``)."""


Span = Union[str, Em, Strong, Code, Link, tuple["Span", ...]]  # noqa: UP007 (a recursive alias needs Union)


@dataclass(frozen=True)
class Cell:
    """A table cell with a CSS class (the HTML's alone)."""

    text: Span
    css: str = ""


@dataclass(frozen=True)
class Heading:
    text: Span
    level: int = 2


@dataclass(frozen=True)
class Para:
    text: Span


@dataclass(frozen=True)
class Table:
    header: Sequence[Span]
    rows: Sequence[Sequence[Span | Cell]]


@dataclass(frozen=True)
class Bullets:
    items: Sequence[Span]


@dataclass(frozen=True)
class Pre:
    """A block of preformatted text (a text table, a command)."""

    text: str


@dataclass(frozen=True)
class Figure:
    """An image with its caption below it."""

    path: str
    caption: str


@dataclass(frozen=True)
class Image:
    """An image alone (``alt`` its text)."""

    path: str
    alt: str


@dataclass(frozen=True)
class Details:
    """Blocks folded under a summary line (HTML's ``<details>``, which Markdown passes through)."""

    summary: str
    blocks: Sequence[Block]


Block = Union[Heading, Para, Table, Bullets, Pre, Figure, Image, Details]  # noqa: UP007


@dataclass
class Page:
    """A title (the page's first heading) and its blocks. ``head`` is the HTML ``<title>`` (default: the title);
    ``back`` a link the HTML page opens with (the site's navigation, not part of the Markdown)."""

    title: Span
    blocks: list[Block] = field(default_factory=list)
    head: str | None = None
    back: Link | None = None
    css: str = ""

    def markdown(self) -> str:
        parts = ["# " + _md(self.title)]
        parts += [_md_block(b) for b in self.blocks]
        return "\n\n".join(parts) + "\n"

    def html(self) -> str:
        head = html.escape(self.head if self.head is not None else _plain(self.title))
        style = f"<style>{self.css}</style>" if self.css else ""
        back = f"<p>{_html(self.back)}</p>" if self.back is not None else ""
        body = "".join(_html_block(b) for b in self.blocks)
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>{head}</title>{style}</head><body>{back}"
                f"<h1>{_html(self.title)}</h1>{body}</body></html>\n")


# -- Markdown --------------------------------------------------------------------------------------------------
def _md(x: Span, cell: bool = False) -> str:
    if isinstance(x, str):
        return x.replace("|", "\\|").replace("\n", " ") if cell else x
    if isinstance(x, tuple):
        return "".join(_md(y, cell) for y in x)
    if isinstance(x, Em):
        return f"*{_md(x.text, cell)}*"
    if isinstance(x, Strong):
        return f"**{_md(x.text, cell)}**"
    if isinstance(x, Code):
        return f"`{x.text}`"
    return f"[{_md(x.text, cell)}]({x.href})"


def _md_cell(c: Span | Cell) -> str:
    return _md(c.text if isinstance(c, Cell) else c, cell=True)


def _md_block(b: Block) -> str:
    if isinstance(b, Heading):
        return "#" * b.level + " " + _md(b.text)
    if isinstance(b, Para):
        return _md(b.text)
    if isinstance(b, Table):
        lines = ["| " + " | ".join(_md_cell(h) for h in b.header) + " |", "|" + "---|" * len(b.header)]
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
        return "\n".join(lines)
    if isinstance(b, Bullets):
        return "\n".join("- " + _md(i, cell=True) for i in b.items)
    if isinstance(b, Pre):
        return f"```\n{b.text}\n```"
    if isinstance(b, Image):
        return f"![{b.alt}]({b.path})"
    if isinstance(b, Details):
        inner = "\n\n".join(_md_block(x) for x in b.blocks)
        return f"<details><summary>{html.escape(b.summary, quote=False)}</summary>\n\n{inner}\n</details>"
    return f"![{b.caption}]({b.path})\n\n*{b.caption}*"


# -- HTML ------------------------------------------------------------------------------------------------------
def _plain(x: Span) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, tuple):
        return "".join(_plain(y) for y in x)
    return _plain(x.text)


def _html(x: Span) -> str:
    e = html.escape
    if isinstance(x, str):
        return e(x)
    if isinstance(x, tuple):
        return "".join(_html(y) for y in x)
    if isinstance(x, Em):
        return f"<em>{_html(x.text)}</em>"
    if isinstance(x, Strong):
        return f"<strong>{_html(x.text)}</strong>"
    if isinstance(x, Code):
        return f"<code>{e(x.text)}</code>"
    return f"<a href='{e(x.html_href or x.href)}'>{_html(x.text)}</a>"


def _html_cell(c: Span | Cell, tag: str = "td") -> str:
    if isinstance(c, Cell):
        css = f" class='{html.escape(c.css)}'" if c.css else ""
        return f"<{tag}{css}>{_html(c.text)}</{tag}>"
    return f"<{tag}>{_html(c)}</{tag}>"


def _html_block(b: Block) -> str:
    e = html.escape
    if isinstance(b, Heading):
        return f"<h{b.level}>{_html(b.text)}</h{b.level}>"
    if isinstance(b, Para):
        return f"<p>{_html(b.text)}</p>"
    if isinstance(b, Table):
        head = "<tr>" + "".join(_html_cell(h, "th") for h in b.header) + "</tr>"
        rows = "".join("<tr>" + "".join(_html_cell(c) for c in row) + "</tr>" for row in b.rows)
        return f"<table>{head}{rows}</table>"
    if isinstance(b, Bullets):
        return "<ul>" + "".join(f"<li>{_html(i)}</li>" for i in b.items) + "</ul>"
    if isinstance(b, Pre):
        return f"<pre>{e(b.text)}</pre>"
    if isinstance(b, Image):
        return f"<p><img src='{e(b.path)}' alt='{e(b.alt)}'></p>"
    if isinstance(b, Details):
        return f"<details><summary>{e(b.summary)}</summary>{''.join(_html_block(x) for x in b.blocks)}</details>"
    return f"<figure><img src='{e(b.path)}' alt='{e(b.caption)}'><figcaption>{e(b.caption)}</figcaption></figure>"
