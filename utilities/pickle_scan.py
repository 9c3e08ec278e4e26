"""Reading a pickle's opcodes without running them: ``scan_pickle`` refuses a pickle that is
damaged, names a global it may not, nests too deep, builds objects of more parts than its size can
honestly build, or fills a container with keys that all hash alike; the exceptions it and
``utilities.restricted_unpickler`` raise.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Sequence
from typing import Any

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


def scan_pickle(data: bytes, max_depth: int, admitted: Callable[[str, str], bool],
                guard_keys: bool = True) -> None:
    """Read every opcode of ``data`` (nothing is built or called) and follow the unpickler's stack,
    to refuse a pickle that is truncated, malformed, or builds objects nested deeper than
    ``max_depth`` (``DamagedPickle``), or that names a global ``admitted(module, name)`` refuses
    (``RefusedGlobal``, even when the pickle is also malformed further on: it was written to run
    code, not damaged by chance: random bytes almost never spell two dotted identifiers).

    Deep nesting must be refused before unpickling: hashing a dict key or set item recurses in C
    once per level, and a few hundred thousand levels crash the interpreter.

    With ``guard_keys``, every key a dict, set or frozenset receives is followed too: more than
    ``DISTINCT_KEYS_PER_HASH`` distinct plain keys (numbers, strings, tuples of them,
    ``torch.Size``) with one hash, or more than ``OPAQUE_KEYS`` keys that are objects, in one
    container are refused, as is a container built by calling ``set`` / ``dict`` /
    ``OrderedDict`` / ``Counter`` on anything but a dict or a list whose keys were followed. Such
    keys make building the container quadratic (``2**61 - 1`` times anything hashes like 0).

    An object that is already inside another may not grow (``APPEND`` to a list that is an item of
    a tuple): it would deepen its container after the container's depth was counted. Pickles of
    cyclic objects need that; checkpoints have none.

    Work, not only size, is bounded: every object counts the objects in it, each re-use of a
    memoized one (``BINGET``) counted again, and more than ``pickle_parts_budget(len(data))`` in
    one is refused (``DamagedPickle``), whatever ``guard_keys`` says. A 40-deep tuple whose two
    items are one memoized tuple is 208 bytes and 2**40 parts: hashing it as a dict key never
    ends, and nothing that walks what a pickle builds can take longer than its parts.
    """
    import pickletools

    stack: list[Any] = []
    memo: dict[Any, _Node] = {}
    budget = pickle_parts_budget(len(data))

    def counted(node: _Node, children: list[_Node]) -> _Node:
        node.parts = min(node.parts + sum(c.parts for c in children), budget + 1)
        if node.parts > budget:
            raise DamagedPickle(f"builds an object of more than {budget} parts, counting each re-use of "
                                "a memoized one (shared through the memo to make reading it slow)")
        return node

    def pop() -> Any:
        if not stack:
            raise DamagedPickle("pops an empty stack")
        return stack.pop()

    def pop_node() -> _Node:
        node = pop()
        if node is _MARK:
            raise DamagedPickle("finds a mark where an object belongs")
        return node

    def pop_to_mark() -> list[_Node]:
        items = []
        while True:
            item = pop()
            if item is _MARK:
                return items[::-1]
            items.append(item)

    def nested(children: list[_Node]) -> int:
        for child in children:
            child.inside = True
        depth = 1 + max((c.depth for c in children), default=-1)
        if depth > max_depth:
            raise DamagedPickle(f"nests objects more than {max_depth} levels deep")
        return depth

    refused: list[str] = []

    def named(module: Any, name: Any) -> str | None:
        if isinstance(module, str) and isinstance(name, str) and _IDENTIFIER.match(module) \
                and _IDENTIFIER.match(name):
            if not admitted(module, name):
                refused.append(f"{module}.{name}")
            return f"{module}.{name}"
        return None

    def built(op_name: str, children: list[_Node], operands: list[_Node]) -> _Node:
        node = counted(_Node(nested(children)), children) if children else _Node()
        if op_name in ("EMPTY_DICT", "EMPTY_SET"):
            node.keys = KeyHashes()
        elif op_name in _TUPLES:
            node.items = children
            if all(c.value is not _UNKNOWN for c in children):
                node.value = tuple(c.value for c in children)
        elif op_name in ("EMPTY_LIST", "LIST"):
            node.items = list(children)
        elif guard_keys and op_name == "DICT":
            node.add_keys(children[0::2])
        elif guard_keys and op_name == "FROZENSET":
            node.add_keys(children)
        elif op_name == "REDUCE" and guard_keys:
            func, args = operands
            call_args = args.items if args.items is not None else None
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
                    elif source.items is not None and func.name in ("builtins.set",
                                                                     "builtins.frozenset"):
                        node.add_keys(source.items)
                    else:
                        raise DamagedPickle(f"builds a {func.name} from something other than a "
                                            "dict or a list")
        return node

    stopped = False
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name == "STOP":
                pop_node()
                stopped = True
            elif name in ("PROTO", "FRAME"):
                continue
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "POP":
                pop()
            elif name == "POP_MARK":
                pop_to_mark()
            elif name == "DUP":
                node = pop_node()
                stack += [node, node]
            elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                if not stack or stack[-1] is _MARK:
                    raise DamagedPickle("memoizes nothing")
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
            elif name == "GLOBAL" or name == "INST":
                full = named(*(arg.split(" ", 1) if " " in arg else (arg, None)))
                if name == "GLOBAL":
                    stack.append(_Node(name=full))
                else:
                    children = pop_to_mark()
                    stack.append(counted(_Node(nested(children)), children))
            elif name == "STACK_GLOBAL":
                module_node, name_node = [pop_node() for _ in range(2)][::-1]
                stack.append(_Node(name=named(module_node.value, name_node.value)))
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                if arg not in memo:
                    raise DamagedPickle(f"refers to memo entry {arg!r} that was never stored")
                stack.append(memo[arg])
            elif name in _CONSTANTS:
                stack.append(_Node(value=_CONSTANTS[name]))
            elif not op.stack_before and len(op.stack_after) == 1 and arg is not None:
                plain = isinstance(arg, (str, bytes, int, float)) and not isinstance(arg, bytearray)
                stack.append(_Node(value=arg if plain else _UNKNOWN))
            else:
                before = op.stack_before
                if pickletools.stackslice in before:  # the objects down to the last mark
                    fixed = before.index(pickletools.markobject)
                    sliced = pop_to_mark()
                else:
                    sliced, fixed = [], len(before)
                operands = [pop_node() for _ in range(fixed)][::-1]
                if name in _GROWS:
                    target, children = operands[0], operands[1:] + sliced
                    if target.inside:
                        raise DamagedPickle("changes an object after placing it in another")
                    target.depth = max(target.depth, nested(children))
                    counted(target, children)
                    if guard_keys and name in ("SETITEM", "SETITEMS"):
                        target.add_keys(children[0::2])
                    elif guard_keys and name == "ADDITEMS":
                        target.add_keys(children)
                    elif name in ("APPEND", "APPENDS") and target.items is not None:
                        target.items.extend(children)
                    stack.append(target)
                else:
                    children = operands + sliced
                    for _ in op.stack_after:
                        stack.append(built(name, children, operands))
    except Exception as e:  # noqa: BLE001 - pickletools on a truncated or foreign stream
        if refused:
            raise RefusedGlobal(refused[0]) from None
        if isinstance(e, DamagedPickle):
            raise
        reason = " ".join(str(e).split())[:120]
        raise DamagedPickle(reason or type(e).__name__) from None
    if refused:
        raise RefusedGlobal(refused[0])
    if not stopped:
        raise DamagedPickle("ends before its STOP opcode")
