"""Text for a terminal: how wide it is, long lines folded at spaces, a command folded as a shell
reads it, and argparse help that keeps hyphenated names whole. The one home of the course's wrapping."""

from __future__ import annotations

import argparse
import re
import shutil
import textwrap


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


def markdown_escape(text: str) -> str:
    """``text`` made inert in a markdown file: no HTML can start in it (``<`` and a bare ``&``
    become entities, so no tag, and no comment such as a README's ``<!-- /results -->`` marker),
    and it stays on one line. Escaping twice gives the same text."""
    return _BARE_AMPERSAND.sub("&amp;", text).replace("<", "&lt;").replace("\r", " ").replace("\n", " ")


def rate_text(per_second: float) -> str:
    """A rate as text: a whole number with thousands separators from 100 up, three significant
    digits below (``0.0123``), so a rate that is not zero never reads as 0."""
    if per_second >= 100 or per_second == 0:
        return f"{per_second:,.0f}"
    return f"{per_second:.3g}"


def markdown(rows: list[list[str]]) -> str:
    """A markdown table: ``rows[0]`` its header, the rest its rows (each cell ``markdown_escape``d,
    a ``|`` in it escaped)."""
    cells = [[markdown_escape(cell).replace("|", "\\|") for cell in row] for row in rows]
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
