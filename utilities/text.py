"""Text for a terminal: how wide it is, long lines folded at spaces, a command folded as a shell
reads it, and argparse help that keeps hyphenated names whole. The one home of the course's wrapping,
and of its markdown: a value from a file made inert text (``markdown_escape``, ``markdown_inert``),
and a table."""

from __future__ import annotations

import argparse
import re
import shutil
import textwrap
from typing import Any


def width() -> int:
    """Columns a printed table or note may take: the terminal's (``COLUMNS`` first, as the
    launcher passes its own terminal's width to the ranks), 120 where there is none (a pipe, a
    notebook), never less than 60. The full detail is always in results.json."""
    return max(60, shutil.get_terminal_size((120, 24)).columns)


def wrap_lines(text: str, columns: int | None = None, indent: str | None = None) -> str:
    """``text`` with every line longer than ``columns`` (default ``width()``) folded at spaces,
    never inside a word or a hyphenated name; a folded line goes on indented by its own leading
    spaces plus two (or by ``indent``). Lines that fit, table rows among them, are left as they are."""
    columns = columns or width()
    out = []
    for line in text.split("\n"):
        if len(line) <= columns:
            out.append(line)
            continue
        hang = indent if indent is not None else " " * (len(line) - len(line.lstrip(" "))) + "  "
        out += textwrap.wrap(line, columns, subsequent_indent=hang, break_long_words=False,
                             break_on_hyphens=False) or [line]
    return "\n".join(out)


_BARE_AMPERSAND = re.compile(r"&(?!#?\w+;)")
# Characters that start markup anywhere in a line, as character references (which markdown always
# shows as the character, never reads as markup): HTML tags and comments, code spans (and a fence's
# backticks), links and images, backslash escapes (a ``\\|`` that would end a table cell), autolinks.
_INLINE = str.maketrans({"<": "&lt;", "`": "&#96;", "[": "&#91;", "]": "&#93;", "\\": "&#92;"})
_AUTOLINK = re.compile(r"(:)(?=//)|(?<=www)(\.)|(?<=\w)(@)(?=\w)", re.I)
# What starts a block when it begins a line: an ATX heading, a quote, a list item, a thematic break
# or setext underline, a ~~~ fence (a ``` fence has its backticks escaped above).
_LINE_START = re.compile(r"#{1,6}(?=[ \t]|$)|>|[-+*](?=[ \t]|$)|\d{1,9}[.)](?=[ \t]|$)"
                         r"|([-_*])[ \t]*(?:\1[ \t]*){2,}$|=+[ \t]*$|~{3,}")


def markdown_escape(text: str) -> str:
    """``text`` (a value read from a file: a device name, a note, a key) made inert wherever a
    markdown file puts it, in a table cell, inside a line, at a line's start or in a code span:
    no HTML can start in it (``<`` and a bare ``&`` become entities, so no tag, and no comment
    such as a README's ``<!-- /results -->`` marker), no code span or fence (backticks), no link,
    image or autolink (``[``, ``]``, ``://``, ``www.``, ``@``), no backslash escape, and it stays on
    one line that starts no heading, quote, list item, rule or fence. Text without those
    characters is left as it is (``->``, ``|``, ``_`` inside words: a table cell's ``|`` is
    ``markdown``'s to escape); escaping twice gives the same text."""
    text = _BARE_AMPERSAND.sub("&amp;", str(text))
    text = text.translate(_INLINE)
    text = _AUTOLINK.sub(lambda m: f"&#{ord(m.group(0))};", text)
    text = " ".join(text.replace("\r", "\n").split("\n")).lstrip(" \t")
    lead = _LINE_START.match(text)
    if lead:
        i = next(k for k, c in enumerate(lead.group(0)) if not c.isdigit())
        text = f"{text[:i]}&#{ord(text[i])};{text[i + 1:]}"
    return text


def markdown_inert(value: Any) -> Any:
    """A JSON value read from a file with every string in it (keys too) ``markdown_escape``d: what
    the file holds is shown as text, never read as markup or as a README's marker. Every renderer
    of a README passes what it loads through this before a string of it reaches the page."""
    if isinstance(value, str):
        return markdown_escape(value)
    if isinstance(value, dict):
        return {markdown_inert(k): markdown_inert(v) for k, v in value.items()}
    if isinstance(value, list):
        return [markdown_inert(v) for v in value]
    return value


def rate_text(per_second: float) -> str:
    """A rate as text: a whole number with thousands separators from 100 up, three significant
    digits below (``0.0123``), so a rate that is not zero never reads as 0."""
    if per_second >= 100 or per_second == 0:
        return f"{per_second:,.0f}"
    return f"{per_second:.3g}"


def markdown(rows: list[list[str]]) -> str:
    """A markdown table: ``rows[0]`` its header, the rest its rows. A cell is markdown already
    (the renderer's own bold or code around values that ``markdown_inert`` made text); here it is
    kept on one line and a ``|`` in it escaped, so that it stays one cell."""
    cells = [[" ".join(str(cell).splitlines()).replace("|", "\\|") for cell in row] for row in rows]
    lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells[1:]])


def shell_lines(words: list[str], columns: int | None = None) -> str:
    """A command as a user would paste it: ``$ words...``, continued with `` \\`` at the width."""
    columns = columns or width()
    lines, current = [], "$"
    for word in words:
        if len(current) + 1 + len(word) + 2 > columns and current not in ("$", "   "):
            lines.append(current + " \\")
            current = "   "
        current += " " + word
    return "\n".join([*lines, current])


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's, wrapping flag help only at spaces: names like ``fsdp1-limit-all-gathers`` stay
    whole (the stock wrap breaks after any hyphen); the description keeps its own lines (lists,
    commands), each folded at spaces when wider than the terminal."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False,
                             break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line for line in fold_paragraphs(text, width).splitlines())


def fold_paragraphs(text: str, columns: int | None = None) -> str:
    """A docstring at the terminal's width: a paragraph of plain lines (none indented, none a list
    item) is refilled as one; indented lines, lists and commands keep their lines, each folded at
    spaces when too wide (``wrap_lines``)."""
    columns = columns or width()
    blocks = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        plain = all(line and not line[0].isspace() and not line.startswith(("* ", "- ", "$ "))
                    for line in lines)
        if plain and max(len(line) for line in lines) > columns:
            blocks.append(textwrap.fill(" ".join(lines), columns, break_long_words=False,
                                        break_on_hyphens=False))
        else:
            blocks.append(wrap_lines(block, columns))
    return "\n\n".join(blocks)
