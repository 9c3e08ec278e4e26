"""One kind of error for bad user input, so every entry point can answer it in one line."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn


class UsageError(ValueError):
    """A value the user gave is not allowed. The message names the value and what is allowed."""


def bad_value(what: str, value: object, allowed: Iterable[object] | str) -> UsageError:
    """Build the one-line error for ``what=value`` given the allowed values."""
    if isinstance(allowed, str):
        allowed_text = allowed
    else:
        allowed_text = ", ".join(str(a) for a in allowed)
    return UsageError(f"{what} {value!r} is not allowed; allowed: {allowed_text}")


def exit_on_usage_error(exc: UsageError, code: int = 2) -> NoReturn:
    """Print the error as one line on stderr and exit with ``code`` (2, like argparse)."""
    print(f"error: {exc}", file=sys.stderr)
    raise SystemExit(code)


class OneLineParser(argparse.ArgumentParser):
    """argparse that answers a bad flag with one line and exit 2, not a usage dump; a number that
    is not finite (``nan``, ``inf``: ``float()`` accepts both) is refused for every flag whose type
    gives a float, whatever that type checks itself (every comparison with NaN is false).

    A flag may be shortened to any prefix that names one flag, as argparse allows (``--batch 4``
    for ``--batch-size 4``); an error about it names the flag as typed and the one it stands for
    (``argument --batch (short for --batch-size): -3 is not allowed``)."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        self._shortened = self.shortened_flags(args)
        return super().parse_known_args(args, namespace)

    def shortened_flags(self, args: list[str]) -> dict[str, str]:
        """The flags in ``args`` typed as a prefix of exactly one of this parser's: by the name
        argparse's messages give its flag (``--batch-size``, or ``-n/--nproc``), what was typed."""
        typed = {}
        for arg in args:
            if arg == "--":
                break
            name = arg.split("=", 1)[0]
            if not name.startswith("--") or name in self._option_string_actions:
                continue
            actions = {id(a): a for flag, a in self._option_string_actions.items() if flag.startswith(name)}
            if len(actions) == 1:
                typed["/".join(next(iter(actions.values())).option_strings)] = name
        return typed

    def error(self, message: str) -> NoReturn:
        for flag, typed in getattr(self, "_shortened", {}).items():
            message = message.replace(f"argument {flag}:", f"argument {typed} (short for {flag}):", 1)
        self.exit(2, f"error: {message} (see --help)\n")

    def _get_value(self, action: argparse.Action, arg_string: str):
        value = super()._get_value(action, arg_string)
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentError(action, f"{arg_string!r} is not allowed; allowed: finite "
                                                 "numbers")
        return value


def bounded(kind: type = int, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> Callable[[str], Any]:
    """An argparse ``type``: a number of ``kind`` within bounds. A bad value is refused in one
    line naming it and the allowed range ("integers >= 1", "finite numbers in (0, 1]", ...);
    ``nan`` and ``inf`` too, which ``float()`` accepts and NaN passes every comparison."""
    noun = "integers" if kind is int else "finite numbers"
    if low is not None and high is not None:
        allowed = f"{noun} in {'(' if low_open else '['}{low}, {high}]"
    elif low is not None:
        allowed = f"{noun} {'>' if low_open else '>='} {low}"
    else:
        allowed = noun

    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: {allowed}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: {allowed}")
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is not allowed; allowed: {allowed}")
        return value

    parse.__name__ = f"{noun} ({allowed})"
    return parse


positive_int = bounded(int, 1)
positive_float = bounded(float, 0, low_open=True)
# a seed every generator the course seeds takes (numpy's and Python's included), with room for the
# offsets lessons add to it
seed_value = bounded(int, 0, 2**32 - 1)
