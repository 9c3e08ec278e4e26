"""JSON the course reads from files it did not write itself (a ``--model`` config.json, a committed
or user-edited results file), read within bounds: a regular file of at most ``MAX_JSON_BYTES``
(its size is checked before a byte is read, so a huge sparse file costs nothing), nested at most
``MAX_JSON_DEPTH`` deep, its numbers at most ``MAX_JSON_NUMBER_CHARS`` characters long (no
4,000-digit integer that no count reaches and no float converts). Anything else is one
``UsageError`` line saying which bound it broke."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from utilities.errors import UsageError

# A Hugging Face config.json is a few KiB (with a large id2label map, under 1 MiB); a lesson's
# results.json tens of KiB.
MAX_JSON_BYTES = 16 * 2**20
# Configs nest a sub-config or two (text_config, rope_scaling); results a variant's fields.
MAX_JSON_DEPTH = 64
# The largest count the course writes (bytes of a cluster, tokens of a run) has under 20 digits; a
# float's shortest repr under 25 characters.
MAX_JSON_NUMBER_CHARS = 40


def read_json(path: str | os.PathLike, max_bytes: int = MAX_JSON_BYTES,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value in ``path``; ``UsageError`` (its message: why, without the path) for a file
    that is not a regular file, is larger than ``max_bytes``, is not UTF-8 JSON, or nests deeper
    than ``max_depth``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise UsageError(f"it cannot be opened ({type(e).__name__}: {e.strerror or e})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UsageError("it is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if info.st_size > max_bytes:
            raise UsageError(f"it holds {info.st_size:,} bytes, more than the {max_bytes:,} a JSON "
                             "file here may hold")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew after the size was read
        raise UsageError(f"it holds more than the {max_bytes:,} bytes a JSON file here may hold")
    try:
        value = json.loads(data.decode("utf-8"), parse_int=_bounded(int), parse_float=_bounded(float))
    except RecursionError:
        raise UsageError(f"it is nested deeper than {max_depth} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"it is not JSON ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if json_depth(value) > max_depth:
        raise UsageError(f"it is nested deeper than {max_depth} levels")
    return value


def _bounded(kind: type) -> Any:
    def parse(literal: str) -> Any:
        if len(literal) > MAX_JSON_NUMBER_CHARS:
            raise UsageError(f"it holds a number of {len(literal):,} characters ({literal[:12]}...); "
                             f"numbers here have at most {MAX_JSON_NUMBER_CHARS}")
        return kind(literal)
    return parse


def json_depth(value: Any) -> int:
    """How deeply ``value``'s dicts and lists nest (a scalar: 0), counted without recursion."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest
