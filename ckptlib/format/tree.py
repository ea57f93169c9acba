"""Decode the manifest's tree of values (untrusted input) back into Python objects. Pure.

Nodes are written by :mod:`ckptlib.plan.flatten`; their schema is in docs/format.md, section 3.6
(JSON scalars stand for themselves; ``{"t": KIND, ...}`` for floats, bytes (``"io": true``:
an ``io.BytesIO``), dtypes, tensors, dicts, lists/tuples, stateful objects and ``per_rank``
values).

:func:`decode` turns nodes into values with :class:`TensorRef`/:class:`BytesRef` placeholders
for payload data (the engine's reader resolves them); it rejects unknown node kinds, excessive
depth, references to tensors the manifest does not list, and malformed fields with
:class:`CorruptCheckpointError`.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from ckptlib.errors import CorruptCheckpointError
from ckptlib.format.dtypes import dtype_from_name
from ckptlib.format.validate import unknown

MAX_DEPTH = 128
MAX_INLINE_B64 = 1 << 20


@dataclass(frozen=True, slots=True)
class TensorRef:
    name: str


@dataclass(frozen=True, slots=True)
class BytesRef:
    name: str
    io: bool = False
    """The value was an ``io.BytesIO`` (node field ``"io": true``): it loads back as one."""


@dataclass(frozen=True, slots=True)
class PerRankSaved:
    """A decoded ``per_rank`` node: one value per saving rank."""

    values: list[Any]


class Stateful(dict):
    """A decoded ``stateful`` node: the state dict, plus the saved object type (informative)."""

    type_name: str = ""


def escape(key: str) -> str:
    """A str dict key as one segment of a tensor name: ``~`` -> ``~0``, ``/`` -> ``~1``, and
    keys that look like ints (or are empty) get a ``~s`` prefix, so ``{1: a, "1": b}`` name
    two different tensors (int keys are written as plain digits). The flattening of a save
    (``plan.flatten``) and the safetensors reader (``format.safetensors``) name tensors by it."""
    key = key.replace("~", "~0").replace("/", "~1")
    if not key or key.lstrip("-").isdigit():
        key = "~s" + key
    return key


def _fail(msg: str, where: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"value tree: {msg}", where)


def decode(node: Any, names: Container[str], where: str = "manifest.json") -> Any:
    """Decode ``node``; ``names`` are the tensor names the manifest lists."""
    return _decode(node, names, where, 0)


def _decode(node: Any, names: Container[str], where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise _fail(f"nested deeper than {MAX_DEPTH} levels", where)
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if not isinstance(node, dict):
        raise _fail(f"unexpected {type(node).__name__} node", where)
    kind = node.get("t")
    if kind == "tensor":
        return TensorRef(_ref(node, names, where))
    if kind in ("dict", "list", "tuple"):
        items = node.get("items")
        if not isinstance(items, list):
            raise _fail(f"{kind} node without an items list", where)
        if kind == "dict":
            out: dict[Any, Any] = {}
            for pair in items:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise _fail("dict item must be [key, value]", where)
                key = pair[0]
                if isinstance(key, bool) or not isinstance(key, str | int):
                    raise _fail(f"dict key {key!r:.40} must be str or int", where)
                if key in out:
                    raise _fail(f"duplicate dict key {key!r:.80}", where)
                val = pair[1]
                if type(val) is dict and val.get("t") == "tensor" and len(val) == 2:
                    ref = val.get("ref")  # hot path: a tensor leaf, checked inline
                    if type(ref) is str and ref in names:
                        out[key] = TensorRef(ref)
                        continue
                out[key] = _decode(val, names, where, depth + 1)
            return out
        values = [_decode(v, names, where, depth + 1) for v in items]
        return values if kind == "list" else tuple(values)
    if kind == "float":
        v = node.get("v")
        if v not in ("nan", "inf", "-inf"):
            raise _fail(f"bad float {v!r:.40}", where)
        return float(v)
    if kind == "bytes":
        as_io = node.get("io", False)
        if type(as_io) is not bool:
            raise _fail(f"bytes node field io must be true or false, not {as_io!r:.40}", where)
        if "ref" in node:
            return BytesRef(_ref(node, names, where), as_io)
        b64 = node.get("b64")
        if not isinstance(b64, str) or len(b64) > MAX_INLINE_B64:
            raise _fail("bad inline bytes", where)
        try:
            data = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise _fail("inline bytes are not valid base64", where) from None
        return io.BytesIO(data) if as_io else data
    if kind == "dtype":
        return dtype_from_name(node.get("v"), where)
    if kind == "stateful":
        inner = _decode(node.get("v"), names, where, depth + 1)
        if not isinstance(inner, dict):
            raise _fail("stateful node must hold a dict", where)
        s = Stateful(inner)
        s.type_name = str(node.get("type", ""))[:200]
        return s
    if kind == "per_rank":
        ranks = node.get("ranks")
        if not isinstance(ranks, list) or not ranks:
            raise _fail("per_rank node without a ranks list", where)
        return PerRankSaved([_decode(v, names, where, depth + 1) for v in ranks])
    raise unknown(f"value tree: unknown node kind {kind!r:.40}", kind, where)


def _ref(node: dict[str, Any], names: Container[str], where: str) -> str:
    ref = node.get("ref")
    if not isinstance(ref, str) or ref not in names:
        raise _fail(f"reference {ref!r:.200} names no tensor in the manifest", where)
    return ref
