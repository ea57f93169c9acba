"""The value policy of the framework integrations (Lightning, Accelerate). Pure, no framework import.

Frameworks put values in their checkpoints that are not JSON-typed: Lightning's
``hyper_parameters`` (an ``AttributeDict`` of whatever the model's ``__init__`` took), loop and
callback state, enums, dataclasses, paths. ckptlib stores tensors and JSON-typed values only,
so :func:`to_storable` runs on the caller's thread before a save and applies this policy:

1. **Converted** (they come back as the plain value, not the original type): dict subclasses
   (``AttributeDict``, ``OrderedDict``, ``defaultdict``) -> dict; tuple subclasses (named
   tuples, ``torch.Size``) -> tuple; ``enum.Enum`` -> its ``value``; paths (``os.PathLike``)
   -> str; dataclass instances and ``argparse.Namespace`` -> dict of their fields; ``set``/
   ``frozenset`` -> sorted list; NumPy scalars -> Python numbers; NumPy arrays -> tensors;
   ``datetime``/``date``/``time`` -> ISO-8601 str.
2. **Refused**: anything else raises :class:`~ckptlib.errors.UnsupportedValueError` naming its
   key path, before a byte is written.
3. **Opt-in opaque bytes**: values under a key path listed in ``allow_pickle_for`` (e.g.
   ``("hyper_parameters",)``; a prefix of ``/``-joined keys) that rule 1 does not cover are
   stored as pickled bytes in a marker dict ``{"__ckptlib_pickled__": type name, "data":
   bytes}``. Loading NEVER unpickles them by default: :func:`from_stored` returns a
   :class:`PickledValue` (type name + bytes) in their place; only ``unpickle=True`` (for
   checkpoints you trust) turns them back into objects.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptlib.errors import UnsupportedValueError
from ckptlib.format.leaves import PerRank, Shard
from ckptlib.plan.flatten import is_stateful

PICKLED_KEY = "__ckptlib_pickled__"
"""Marks a dict holding an opted-in pickled value (see the module docstring, rule 3)."""

MAX_DEPTH = 100


@dataclass(frozen=True, slots=True)
class PickledValue:
    """A value stored as pickled bytes under ``allow_pickle_for``, returned as is at load:
    ckptlib never unpickles it unless asked (``unpickle=True``)."""

    type_name: str
    data: bytes


def to_storable(value: Any, allow_pickle_for: Collection[str] = (), path: str = "") -> Any:
    """``value`` with every leaf JSON-typed or a tensor (module docstring). Caller's thread,
    before a save. Tensors are passed through as they are (no copy)."""
    return _Converter(tuple(p.strip("/") for p in allow_pickle_for)).convert(value, path, 0)


def from_stored(value: Any, *, unpickle: bool = False) -> Any:
    """A loaded tree with every opaque pickled value as a :class:`PickledValue`, or, only
    with ``unpickle=True``, the object it holds. Caller's thread, after a load."""
    if isinstance(value, dict):
        if set(value) == {PICKLED_KEY, "data"} and isinstance(value["data"], bytes):
            if unpickle:
                import pickle  # only on the explicit opt-in

                return pickle.loads(value["data"])
            return PickledValue(str(value[PICKLED_KEY]), value["data"])
        for k, v in value.items():
            value[k] = from_stored(v, unpickle=unpickle)
        return value
    if isinstance(value, list):
        value[:] = [from_stored(v, unpickle=unpickle) for v in value]
        return value
    if isinstance(value, tuple):
        return tuple(from_stored(v, unpickle=unpickle) for v in value)
    return value


def _type_name(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


@dataclass(slots=True)
class _Converter:
    allow: tuple[str, ...]

    def convert(self, x: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedValueError(f"value nested deeper than {MAX_DEPTH} levels at {path}")
        if x is None or isinstance(x, bool | int | float | str | bytes | torch.Tensor | torch.dtype):
            return x
        if isinstance(x, PerRank | Shard) or is_stateful(x):
            return x
        if isinstance(x, dict):
            return {k: self.convert(v, f"{path}/{k}", depth + 1) for k, v in x.items()}
        if isinstance(x, list):
            return [self.convert(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return tuple(self.convert(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x))
        if isinstance(x, enum.Enum):
            return self.convert(x.value, path, depth + 1)
        if isinstance(x, os.PathLike):
            return os.fspath(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
            return self.convert(fields, path, depth + 1)
        if isinstance(x, argparse.Namespace):
            return self.convert(dict(vars(x)), path, depth + 1)
        if isinstance(x, set | frozenset):
            items = list(x)
            try:
                items.sort()
            except TypeError:
                items.sort(key=repr)
            return self.convert(items, path, depth + 1)
        if isinstance(x, np.generic):
            return self.convert(x.item(), path, depth + 1)
        if isinstance(x, np.ndarray) and x.dtype != object:
            return torch.from_numpy(np.ascontiguousarray(x).copy())
        if isinstance(x, datetime.date | datetime.time):
            return x.isoformat()
        if isinstance(x, bytearray | memoryview):
            return bytes(x)
        key = path.strip("/")
        if any(key == p or key.startswith(p + "/") or p == "" for p in self.allow):
            import pickle  # only on the explicit opt-in

            try:
                data = pickle.dumps(x)
            except Exception as e:
                raise UnsupportedValueError(f"{path or '<root>'}: cannot pickle {_type_name(x)}: {e}") from None
            return {PICKLED_KEY: _type_name(x), "data": data}
        top = key.split("/", 1)[0] or "<root>"
        raise UnsupportedValueError(
            f"cannot save {_type_name(x)} at {path or '<root>'}: ckptlib stores tensors and JSON-typed values "
            f"without pickle; convert it, or pass allow_pickle_for=({top!r},) to store it as opaque pickled "
            "bytes (never unpickled at load unless unpickle=True)"
        )
