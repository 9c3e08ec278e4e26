"""An unpickler that changes nothing but the objects it builds (``RestrictedUnpickler``): globals
only from an allowlist, state set only on instances of the classes it may build, and no container
filled with keys that all hash alike, so that a refused file leaves the process as it was.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from utilities.pickle_scan import DamagedPickle, KeyHashes, RefusedChange, RefusedGlobal, printable

# -- an unpickler that changes nothing but the objects it builds ---------------------------------------


def enum_member(enums: set[type], cls: Any, name: Any) -> Any:
    """What ``builtins.getattr`` may do in a checkpoint's pickle: name a member of one of ``enums``
    (some Python versions, 3.11.2 among them, pickle an enum member as ``getattr(cls, "NAME")``);
    any other attribute of anything is refused."""
    if cls in enums and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise RefusedGlobal(f"builtins.getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r})")


class RestrictedUnpickler(pickle._Unpickler):
    """Python's own unpickler (the pure-Python one, so that each opcode can be checked) reading
    ``data``, that

    * resolves a global only from ``allowed`` (``(module, name) -> object``): a pickle naming
      ``posix.system`` is refused before anything is called;
    * sets state (``BUILD``) and creates instances (``NEWOBJ``) only of the classes in
      ``buildable``, which it creates itself: never of a class, a function or any object the
      process shares (a ``BUILD`` on ``PosixPath`` would set ``PosixPath.__truediv__`` for every
      later ``a / b``); a class without its own ``__setstate__`` takes only its dataclass fields;
    * adds items only to the lists, dicts and sets it created, and refuses a container once more
      than ``DISTINCT_KEYS_PER_HASH`` distinct keys share a hash, so no file makes reading it
      quadratic;
    * knows no ``INST`` / ``OBJ`` (protocol 0 and 1 instances) and no persistent ids.

    What it builds before it refuses a file is only its own new objects: a refused file leaves the
    process as it was.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any], buildable: set[type]):
        super().__init__(io.BytesIO(data))
        self._allowed, self._buildable = allowed, buildable
        self._fields = {cls: _field_names(cls) for cls in buildable}
        self._key_hashes: dict[int, tuple[Any, KeyHashes]] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise RefusedGlobal(printable(f"{module}.{name}")) from None

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedGlobal("a persistent id")

    def _keys_of(self, container: Any) -> KeyHashes:
        entry = self._key_hashes.get(id(container))
        if entry is None or entry[0] is not container:
            entry = (container, KeyHashes())  # holding it keeps its id unique while we read
            self._key_hashes[id(container)] = entry
        return entry[1]

    def _into(self, container: Any, kinds: tuple[type, ...], op: str) -> None:
        if type(container) not in kinds:
            raise DamagedPickle(f"applies {op} to a {type(container).__name__}")

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls not in self._buildable:
            raise RefusedChange(f"sets the state of {_describe(inst)}, which is not an object it "
                                "built of a class it may build")
        if "__setstate__" in vars(cls):
            inst.__setstate__(state)
            return
        if type(state) is not dict or not all(type(k) is str and k in self._fields[cls]
                                              for k in state):
            raise DamagedPickle(f"gives a {cls.__name__} state that is not its fields")
        inst.__dict__.update(state)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not isinstance(cls, type) or cls not in self._buildable:
            raise RefusedGlobal(f"{_describe(cls)} (to create an object)")
        self.append(cls.__new__(cls, *args))

    def load_newobj_ex(self) -> None:
        if self.stack.pop():
            raise DamagedPickle("passes keyword arguments to a constructor")
        self.load_newobj()

    def load_refused(self) -> None:
        raise RefusedGlobal("a protocol 0/1 instance (INST/OBJ)")

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        target = self.stack[-1]
        self._into(target, (dict, OrderedDict), "SETITEM")
        self._keys_of(target).add(key)
        target[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        self._into(target, (dict, OrderedDict), "SETITEMS")
        keys = self._keys_of(target)
        for i in range(0, len(items) - 1, 2):
            keys.add(items[i])
            target[items[i]] = items[i + 1]

    def load_dict(self) -> None:
        items = self.pop_mark()
        target: dict[Any, Any] = {}
        keys = self._keys_of(target)
        for i in range(0, len(items) - 1, 2):
            keys.add(items[i])
            target[items[i]] = items[i + 1]
        self.append(target)

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        self._into(target, (set,), "ADDITEMS")
        keys = self._keys_of(target)
        for item in items:
            keys.add(item)
            target.add(item)

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        keys = KeyHashes()
        for item in items:
            keys.add(item)
        self.append(frozenset(items))

    def load_append(self) -> None:
        value = self.stack.pop()
        self._into(self.stack[-1], (list,), "APPEND")
        self.stack[-1].append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._into(self.stack[-1], (list,), "APPENDS")
        self.stack[-1].extend(items)

    for _op, _method in ((pickle.BUILD, load_build), (pickle.NEWOBJ, load_newobj),
                         (pickle.NEWOBJ_EX, load_newobj_ex), (pickle.INST, load_refused),
                         (pickle.OBJ, load_refused), (pickle.SETITEM, load_setitem),
                         (pickle.SETITEMS, load_setitems), (pickle.DICT, load_dict),
                         (pickle.ADDITEMS, load_additems), (pickle.FROZENSET, load_frozenset),
                         (pickle.APPEND, load_append), (pickle.APPENDS, load_appends)):
        dispatch[_op[0]] = _method
    del _op, _method


def guarded_container(kind: type) -> Callable[..., Any]:
    """What a ``RestrictedUnpickler`` admits for ``builtins.set`` / ``dict`` / ``frozenset`` /
    ``collections.OrderedDict``: builds one of ``kind`` from at most one iterable, through the
    same key check (a pickle may call ``set([...])`` with keys that all hash alike)."""

    def build(*args: Any) -> Any:
        if len(args) > 1:
            raise DamagedPickle(f"calls {kind.__name__} with {len(args)} arguments")
        source = args[0] if args else ()
        if type(source) not in (list, tuple, dict, set, frozenset, OrderedDict):
            raise DamagedPickle(f"builds a {kind.__name__} from a {type(source).__name__}")
        keys = KeyHashes()
        pairs = kind in (dict, OrderedDict)
        if pairs and type(source) in (list, tuple):
            items = list(source)
            if not all(type(p) is tuple and len(p) == 2 for p in items):
                raise DamagedPickle(f"builds a {kind.__name__} from items that are not pairs")
            for k, _ in items:
                keys.add(k)
            return kind(items)
        for k in source:
            keys.add(k)
        return kind(source)

    return build


def _field_names(cls: type) -> frozenset[str]:
    import dataclasses

    return frozenset(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) \
        else frozenset()


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    name = getattr(obj, "__qualname__", None)
    if name is not None:
        return f"{getattr(obj, '__module__', '?')}.{name}"
    return f"a {type(obj).__name__}"
