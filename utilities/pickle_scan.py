"""Reading a pickle's opcodes without running them: ``scan_pickle`` refuses a pickle that is
damaged, names a global it may not, nests too deep, builds objects of more parts than its size can
honestly build, or fills a container with keys that all hash alike; the exceptions it and
``utilities.restricted_unpickler`` raise.
"""

from __future__ import annotations

import codecs
import io
import pickle
import pickletools
import re
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

# -- reading a pickle's opcodes without running them --------------------------------------------------


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a global (or asks for something) that is not admitted: written to run code."""


class RefusedChange(pickle.UnpicklingError):
    """A pickle asks to change an object it did not create (a class, a function, a shared cache)."""


class DamagedPickle(pickle.UnpicklingError):
    """A pickle that is truncated, malformed, or built to exhaust the reader."""


DISTINCT_KEYS_PER_HASH = 8  # distinct keys of one hash in one container: real data has 1 or 2
OPAQUE_KEYS = 1024  # keys of one container whose hash scan_pickle cannot know (objects)
_UNKNOWN = object()


class KeyHashes:
    """The keys one container received so far, by hash: refuses the container once more than
    ``DISTINCT_KEYS_PER_HASH`` distinct keys share a hash (each new one would be compared with all
    of them: a dict of n such keys costs n * n / 2 comparisons to build)."""

    __slots__ = ("by_hash",)

    def __init__(self):
        self.by_hash: dict[int, list[Any]] = {}

    def add(self, key: Any) -> None:
        try:
            h = hash(key)
        except TypeError:
            raise DamagedPickle(f"uses an unhashable {type(key).__name__} as a key") from None
        seen = self.by_hash.setdefault(h, [])
        if any(k is key or (type(k) is type(key) and k == key) for k in seen):
            return
        if len(seen) >= DISTINCT_KEYS_PER_HASH:
            raise DamagedPickle(f"holds more than {DISTINCT_KEYS_PER_HASH} distinct keys that hash "
                                f"alike (such as {_short(key)}): built to make reading it slow")
        seen.append(key)


def printable(text: str, limit: int = 200) -> str:
    """``text`` as one line for a message: what is not printable escaped (a name read from a file
    may hold a newline), at most ``limit`` characters."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown + ("..." if len(text) > limit else "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Node:
    """What ``scan_pickle`` knows of one object the pickle builds: how deeply it nests, whether it
    already sits inside another object (then it may no longer grow), its value where it is a plain
    hashable one (a number, a string, a tuple of them), the global it names, its items (tuples and
    lists) and the keys it received (containers)."""

    __slots__ = ("depth", "parts", "inside", "value", "name", "items", "keys", "opaque_keys")

    def __init__(self, depth: int = 0, value: Any = _UNKNOWN, name: str | None = None):
        self.depth, self.inside, self.value, self.name = depth, False, value, name
        self.parts = 1  # objects in it, each re-use of a memoized one counted again
        self.items: list[_Node] | None = None
        self.keys: KeyHashes | None = None
        self.opaque_keys = 0

    def add_keys(self, keys: Sequence[_Node]) -> None:
        if self.keys is None:
            self.keys = KeyHashes()
        for key in keys:
            if key.value is _UNKNOWN:
                self.opaque_keys += 1
                if self.opaque_keys > OPAQUE_KEYS:
                    raise DamagedPickle(f"uses more than {OPAQUE_KEYS} objects as keys of one "
                                        "container")
            else:
                self.keys.add(key.value)


def pickle_parts_budget(size: int) -> int:
    """How many objects a pickle of ``size`` bytes may build, counting each re-use of a memoized one
    again: a walk of the result (hashing a key, comparing two, reading the loaded state) visits
    that many. One opcode builds at most one object, so a pickle without shared parts stays
    under its size; sharing a tensor's storage or a name a few times stays far under this."""
    return 16 * size + (1 << 20)


_MARK = object()
_GROWS = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}  # change the object below
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_TUPLES = {"EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "TUPLE"}
_CONTAINER_CALLS = {"builtins.set", "builtins.frozenset", "builtins.dict", "collections.OrderedDict",
                    "collections.Counter"}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")

KEPT_ARGUMENT = 1 << 12  # the longest string, bytes or text line scan_pickle holds; longer ones are read past
_PIECE = 1 << 20  # how much of a long argument is read at a time
# arguments whose length comes first: the length's struct format
_COUNTED = {"bytes4": "<I", "bytes8": "<Q", "bytearray8": "<Q", "unicodestring4": "<I",
            "unicodestring8": "<Q", "string4": "<i", "long4": "<i"}
_LONG_ARGUMENT = object()  # what an argument longer than KEPT_ARGUMENT reads as: a value not known


class SourceFailed(Exception):
    """Reading the pickle's file failed (not the pickle: the file, e.g. a zip record's CRC)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class _Opcodes:
    """A pickle's opcodes and their arguments, read from ``source`` piece by piece: an argument
    longer than ``KEPT_ARGUMENT`` is read through (and checked, text as UTF-8) without being held,
    and a text line may be no longer, so reading holds at most ``_PIECE`` bytes whatever the
    file's size. Ends after ``STOP``; bytes after it are not read."""

    def __init__(self, source: BinaryIO):
        self.source = source

    def read(self, n: int) -> bytes:
        try:
            return self.source.read(n)
        except Exception as e:  # noqa: BLE001 - the file, not the pickle: the caller words it
            raise SourceFailed(e) from None

    def readline(self) -> bytes:  # pickletools' readers of text arguments call this
        try:
            line = self.source.readline(KEPT_ARGUMENT + 1)
        except Exception as e:  # noqa: BLE001
            raise SourceFailed(e) from None
        if len(line) > KEPT_ARGUMENT:
            raise DamagedPickle(f"holds a text line longer than {KEPT_ARGUMENT} bytes")
        return line

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        while True:
            code = self.read(1)
            if not code:
                raise DamagedPickle("ends before its STOP opcode")
            op = pickletools.code2op.get(code.decode("latin-1"))
            if op is None:
                raise DamagedPickle(f"holds {code!r}, which is no pickle opcode")
            yield op, None if op.arg is None else self._argument(op.arg)
            if op.name == "STOP":
                return

    def _exactly(self, n: int) -> bytes:
        data = self.read(n)
        if len(data) != n:
            raise DamagedPickle(f"ends inside an argument ({len(data)} of its {n} bytes)")
        return data

    def _argument(self, descriptor: Any) -> Any:
        length_format = _COUNTED.get(descriptor.name)
        if length_format is None:
            return descriptor.reader(self)
        n = struct.unpack(length_format, self._exactly(struct.calcsize(length_format)))[0]
        if n < 0:
            raise DamagedPickle(f"declares an argument of {n} bytes")
        if n > KEPT_ARGUMENT:
            self._read_through(n, descriptor.name.startswith("unicode"))
            return _LONG_ARGUMENT
        data = self._exactly(n)
        if descriptor.name.startswith("unicode"):
            return str(data, "utf-8", "surrogatepass")
        if descriptor.name == "string4":
            return data.decode("latin-1")
        if descriptor.name == "long4":
            return pickletools.decode_long(data)
        return bytearray(data) if descriptor.name == "bytearray8" else data

    def _read_through(self, n: int, text: bool) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("surrogatepass") if text else None
        while n:
            piece = self._exactly(min(n, _PIECE))
            n -= len(piece)
            if decoder is not None:
                decoder.decode(piece, final=not n)


class _Scan:
    """``scan_pickle``'s state: the unpickler's stack and memo as ``_Node``s, and the globals
    refused so far."""

    def __init__(self, max_depth: int, admitted: Callable[[str, str], bool], guard_keys: bool,
                 budget: int):
        self.max_depth, self.admitted, self.guard_keys, self.budget = max_depth, admitted, guard_keys, budget
        self.stack: list[Any] = []
        self.memo: dict[Any, _Node] = {}
        self.refused: list[str] = []

    def counted(self, node: _Node, children: list[_Node]) -> _Node:
        node.parts = min(node.parts + sum(c.parts for c in children), self.budget + 1)
        if node.parts > self.budget:
            raise DamagedPickle(f"builds an object of more than {self.budget} parts, counting each re-use "
                                "of a memoized one (shared through the memo to make reading it slow)")
        return node

    def pop(self) -> Any:
        if not self.stack:
            raise DamagedPickle("pops an empty stack")
        return self.stack.pop()

    def pop_node(self) -> _Node:
        node = self.pop()
        if node is _MARK:
            raise DamagedPickle("finds a mark where an object belongs")
        return node

    def pop_to_mark(self) -> list[_Node]:
        items = []
        while True:
            item = self.pop()
            if item is _MARK:
                return items[::-1]
            items.append(item)

    def nested(self, children: list[_Node]) -> int:
        for child in children:
            child.inside = True
        depth = 1 + max((c.depth for c in children), default=-1)
        if depth > self.max_depth:
            raise DamagedPickle(f"nests objects more than {self.max_depth} levels deep")
        return depth

    def named(self, module: Any, name: Any) -> str | None:
        if isinstance(module, str) and isinstance(name, str) and _IDENTIFIER.match(module) \
                and _IDENTIFIER.match(name):
            if not self.admitted(module, name):
                self.refused.append(f"{module}.{name}")
            return f"{module}.{name}"
        return None

    def step(self, op: Any, arg: Any) -> None:
        """Follow one opcode on the stack."""
        name, stack = op.name, self.stack
        if name == "STOP":
            self.pop_node()
        elif name in ("PROTO", "FRAME"):
            return
        elif name == "MARK":
            stack.append(_MARK)
        elif name == "POP":
            self.pop()
        elif name == "POP_MARK":
            self.pop_to_mark()
        elif name == "DUP":
            node = self.pop_node()
            stack += [node, node]
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            if not stack or stack[-1] is _MARK:
                raise DamagedPickle("memoizes nothing")
            self.memo[len(self.memo) if name == "MEMOIZE" else arg] = stack[-1]
        elif name in ("GLOBAL", "INST", "STACK_GLOBAL"):
            self.global_named(name, arg)
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if arg not in self.memo:
                raise DamagedPickle(f"refers to memo entry {arg!r} that was never stored")
            stack.append(self.memo[arg])
        elif name in _CONSTANTS:
            stack.append(_Node(value=_CONSTANTS[name]))
        elif not op.stack_before and len(op.stack_after) == 1 and arg is not None:
            plain = isinstance(arg, (str, bytes, int, float)) and not isinstance(arg, bytearray)
            stack.append(_Node(value=arg if plain else _UNKNOWN))
        else:
            self.operation(op)

    def global_named(self, op_name: str, arg: Any) -> None:
        if op_name == "STACK_GLOBAL":
            module_node, name_node = [self.pop_node() for _ in range(2)][::-1]
            self.stack.append(_Node(name=self.named(module_node.value, name_node.value)))
            return
        full = self.named(*(arg.split(" ", 1) if " " in arg else (arg, None)))
        if op_name == "GLOBAL":
            self.stack.append(_Node(name=full))
        else:
            children = self.pop_to_mark()
            self.stack.append(self.counted(_Node(self.nested(children)), children))

    def operation(self, op: Any) -> None:
        """An opcode that takes objects off the stack: one that changes the object below them, or
        one that builds new ones."""
        before = op.stack_before
        if pickletools.stackslice in before:  # the objects down to the last mark
            fixed = before.index(pickletools.markobject)
            sliced = self.pop_to_mark()
        else:
            sliced, fixed = [], len(before)
        operands = [self.pop_node() for _ in range(fixed)][::-1]
        if op.name in _GROWS:
            self.grown(op.name, operands[0], operands[1:] + sliced)
        else:
            children = operands + sliced
            for _ in op.stack_after:
                self.stack.append(self.built(op.name, children, operands))

    def grown(self, op_name: str, target: _Node, children: list[_Node]) -> None:
        if target.inside:
            raise DamagedPickle("changes an object after placing it in another")
        target.depth = max(target.depth, self.nested(children))
        self.counted(target, children)
        if self.guard_keys and op_name in ("SETITEM", "SETITEMS"):
            target.add_keys(children[0::2])
        elif self.guard_keys and op_name == "ADDITEMS":
            target.add_keys(children)
        elif op_name in ("APPEND", "APPENDS") and target.items is not None:
            target.items.extend(children)
        self.stack.append(target)

    def built(self, op_name: str, children: list[_Node], operands: list[_Node]) -> _Node:
        node = self.counted(_Node(self.nested(children)), children) if children else _Node()
        if op_name in ("EMPTY_DICT", "EMPTY_SET"):
            node.keys = KeyHashes()
        elif op_name in _TUPLES:
            node.items = children
            if all(c.value is not _UNKNOWN for c in children):
                node.value = tuple(c.value for c in children)
        elif op_name in ("EMPTY_LIST", "LIST"):
            node.items = list(children)
        elif self.guard_keys and op_name == "DICT":
            node.add_keys(children[0::2])
        elif self.guard_keys and op_name == "FROZENSET":
            node.add_keys(children)
        elif op_name == "REDUCE" and self.guard_keys:
            reduced(node, *operands)
        return node


def reduced(node: _Node, func: _Node, args: _Node) -> None:
    """What ``scan_pickle`` knows of ``node``, the result of calling ``func`` on ``args``: the value
    of a ``torch.Size`` or a complex number, the keys of a container it builds."""
    call_args = args.items
    if func.name == "torch.Size" and call_args and len(call_args) == 1 \
            and isinstance(call_args[0].value, tuple):
        node.value = call_args[0].value  # a Size hashes and compares as its tuple
    elif func.name == "builtins.complex" and call_args is not None \
            and all(isinstance(a.value, (int, float)) for a in call_args):
        node.value = complex(*(a.value for a in call_args[:2]))
    elif func.name in _CONTAINER_CALLS:
        if call_args is None or len(call_args) > 1:
            raise DamagedPickle(f"calls {func.name} with arguments torch.save never writes")
        if call_args:
            source = call_args[0]
            if source.keys is not None:  # a dict: its keys were followed
                node.add_keys([])
            elif source.items is not None and func.name in ("builtins.set", "builtins.frozenset"):
                node.add_keys(source.items)
            else:
                raise DamagedPickle(f"builds a {func.name} from something other than a dict or a list")


def scan_pickle(source: bytes | BinaryIO, max_depth: int, admitted: Callable[[str, str], bool],
                guard_keys: bool = True, size: int | None = None) -> None:
    """Read every opcode of ``source`` (bytes, or a file read from its position; nothing is built
    or called) and follow the unpickler's stack, to refuse a pickle that is truncated, malformed,
    or builds objects nested deeper than ``max_depth`` (``DamagedPickle``), or that names a global
    ``admitted(module, name)`` refuses (``RefusedGlobal``, even when the pickle is also malformed
    further on: it was written to run code, not damaged by chance: random bytes almost never
    spell two dotted identifiers).

    Deep nesting must be refused before unpickling: hashing a dict key or set item recurses in C
    once per level, and a few hundred thousand levels crash the interpreter.

    With ``guard_keys``, every key a dict, set or frozenset receives is followed too: more than
    ``DISTINCT_KEYS_PER_HASH`` distinct plain keys (numbers, strings, tuples of them,
    ``torch.Size``) with one hash, or more than ``OPAQUE_KEYS`` keys that are objects (or strings
    longer than ``KEPT_ARGUMENT``), in one container are refused, as is a container built by
    calling ``set`` / ``dict`` / ``OrderedDict`` / ``Counter`` on anything but a dict or a list
    whose keys were followed. Such keys make building the container quadratic (``2**61 - 1``
    times anything hashes like 0).

    An object that is already inside another may not grow (``APPEND`` to a list that is an item of
    a tuple): it would deepen its container after the container's depth was counted. Pickles of
    cyclic objects need that; checkpoints have none.

    Work, not only size, is bounded: every object counts the objects in it, each re-use of a
    memoized one (``BINGET``) counted again, and more than ``pickle_parts_budget(size)`` in one is
    refused (``DamagedPickle``), whatever ``guard_keys`` says; ``size`` is the pickle's length
    (``len(source)`` for bytes; a file's is measured where not given). A 40-deep tuple whose two
    items are one memoized tuple is 208 bytes and 2**40 parts: hashing it as a dict key never
    ends, and nothing that walks what a pickle builds can take longer than its parts. Memory is
    the stack, the memo and the keys followed, never the file: it is read opcode by opcode
    (``_Opcodes``), a long argument in pieces. A failure to read the file itself propagates as it
    was raised.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        size, source = len(source), io.BytesIO(source)
    elif size is None:
        start = source.tell()
        size = source.seek(0, io.SEEK_END) - start
        source.seek(start)
    scan = _Scan(max_depth, admitted, guard_keys, pickle_parts_budget(size))
    try:
        for op, arg in _Opcodes(source):
            scan.step(op, arg)
    except SourceFailed as e:
        raise e.error from None
    except Exception as e:  # noqa: BLE001 - pickletools' readers on a truncated or foreign stream
        if scan.refused:
            raise RefusedGlobal(scan.refused[0]) from None
        if isinstance(e, DamagedPickle):
            raise
        reason = " ".join(str(e).split())[:120]
        raise DamagedPickle(reason or type(e).__name__) from None
    if scan.refused:
        raise RefusedGlobal(scan.refused[0])
