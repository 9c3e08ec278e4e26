"""What a README renders as, read by a CommonMark parser with GitHub's tables (markdown-it-py):
the markup a page holds, counted by kind, so that a render from hostile values can be compared
with the render of the same files holding plain values. Bare URLs, which GitHub links without
markup, are counted from the text."""

from __future__ import annotations

import re
from collections import Counter

from markdown_it import MarkdownIt

_PARSER = MarkdownIt("commonmark").enable("table")
# what a value must never add to a page: tags and comments, code blocks, headings, quotes, lists,
# rules, images and links (a link the renderer writes, to its source file, is in both renders)
LIVE = ("html_block", "html_inline", "fence", "code_block", "heading_open", "blockquote_open",
        "bullet_list_open", "ordered_list_open", "hr", "image", "link_open", "table_open")
_AUTOLINKED = re.compile(r"://|www\.|\w@\w", re.I)


def markup(text: str, rows: bool = True) -> Counter:
    """The page's markup of each ``LIVE`` kind, its table rows (unless ``rows`` is False: a file
    that says it is of another benchmark or device moves its rows), and its bare-URL starts."""
    counts: Counter = Counter()
    pending = list(_PARSER.parse(text))
    while pending:
        token = pending.pop()
        if token.type in LIVE or (rows and token.type == "tr_open"):
            counts[token.type] += 1
        if token.type == "html_block" or token.type == "html_inline":
            counts[f"{token.type}: {token.content.strip()}"] += 1
        pending.extend(token.children or ())
    counts["autolink"] = len(_AUTOLINKED.findall(text))
    return counts


def live_in_a_value(escaped: str) -> list[str]:
    """The markup ``escaped`` (one value as a renderer writes it) makes where a README may put
    it: alone on a line, after text, in a table cell, in a code span. Empty: none."""
    found = []
    for context in ("{}\n", "text {} text\n", "| a |\n|---|\n| {} |\n", "`cmd {}` and [`x`](x)\n",
                    "para\n{}\n"):
        extra = markup(context.format(escaped)) - markup(context.format("value"))
        found += [f"{kind} in {context.format(escaped)!r}" for kind in extra]
    return found
