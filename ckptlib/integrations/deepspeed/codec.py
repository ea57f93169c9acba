"""The allow-listed conversion of DeepSpeed's non-JSON values (no pickle, ever).

ckptlib stores JSON-typed values only (``plan.flatten`` encodes, ``format.tree`` decodes); this
module turns the few Python objects in DeepSpeed's state dicts that docs/integrations/deepspeed.md
("Non-tensor values") lists, plus classes registered with :func:`register_type`, into marker
dicts and back (tensors, JSON scalars, bytes and dtypes pass through to ckptlib's codec).
Anything else raises :class:`~ckptlib.errors.UnsupportedValueError` at save time; an unknown
type name on load, ``CorruptCheckpointError``. Called by :mod:`.engine` on the training thread:
:func:`encode_value` in ``commit`` before the save's first collective, :func:`decode_value` in
``load``.
"""

from __future__ import annotations

import argparse
import collections
import enum
import importlib
from typing import Any

import torch

from ckptlib.errors import CheckpointError, CorruptCheckpointError, UnsupportedValueError

MARK = "__ckptlib_deepspeed__"
"""Key of the marker dicts that encode non-JSON values (see :func:`encode_value`)."""

_DEFAULT_TYPES = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
_registered: dict[str, type] = {}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_type(cls: type) -> type:
    """Allow instances of ``cls`` in saved state dicts (e.g. in ``client_state``).

    Enums are stored by member name; other classes by their ``__dict__``, whose values must
    themselves be storable. On load the instance is rebuilt with ``cls.__new__(cls)`` and its
    ``__dict__`` updated (``__init__`` is not called). Register on every process that loads,
    before loading. Returns ``cls`` (usable as a class decorator).
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_type needs a class, got {cls!r}")
    _registered[_qualname(cls)] = cls
    return cls


def _resolve_type(name: str, where: str) -> type:
    cls = _registered.get(name)
    if cls is not None:
        return cls
    if name in _DEFAULT_TYPES:
        module, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise CheckpointError(
                f"{where}: cannot import {name} to rebuild a saved value: {e}"
            ) from None
        if isinstance(cls, type):
            _registered[name] = cls
            return cls
    raise CorruptCheckpointError(
        f"saved value of type {name!r} is not allow-listed; refusing to build it "
        "(register the class with ckptlib.integrations.deepspeed.register_type if you trust it)",
        where,
    )


def _allowed(cls: type) -> bool:
    name = _qualname(cls)
    return name in _registered or name in _DEFAULT_TYPES


def encode_value(x: Any, path: str = "") -> Any:
    """A DeepSpeed state dict -> a tree ckptlib can store (tensors kept as they are).

    Called by the checkpoint engine's ``commit`` for every file. Plain dicts/lists/tuples and
    JSON scalars, bytes, ``torch.dtype`` and tensors pass through; the other supported types
    become ``{MARK: kind, ...}`` dicts (a user dict that has the key ``MARK`` itself is wrapped
    too, so decoding is unambiguous). Raises ``UnsupportedValueError`` naming ``path``.
    """
    cls = type(x)
    if (
        isinstance(x, torch.Tensor)
        or x is None
        or cls in (bool, int, float, str, bytes, torch.dtype)
    ):
        return x
    if cls.__module__ == "numpy" and hasattr(x, "item") and getattr(x, "ndim", None) == 0:
        return encode_value(x.item(), path)  # numpy scalars: stored as Python numbers
    if cls is dict:
        if MARK in x:
            return {
                MARK: "dict",
                "items": [[k, encode_value(v, f"{path}/{k}")] for k, v in x.items()],
            }
        return {_key(k, path): encode_value(v, f"{path}/{k}") for k, v in x.items()}
    if cls is list:
        return [encode_value(v, f"{path}/{i}") for i, v in enumerate(x)]
    if cls is tuple:
        return tuple(encode_value(v, f"{path}/{i}") for i, v in enumerate(x))
    if cls is torch.Size:
        return {MARK: "size", "v": list(x)}
    if cls is collections.OrderedDict:
        meta = getattr(x, "_metadata", None)
        return {
            MARK: "odict",
            "items": [[_key(k, path), encode_value(v, f"{path}/{k}")] for k, v in x.items()],
            "meta": None if meta is None else encode_value(meta, f"{path}/_metadata"),
        }
    if cls in (set, frozenset):
        return {MARK: cls.__name__, "v": [encode_value(v, f"{path}/<item>") for v in x]}
    if cls is torch.device:
        return {MARK: "device", "v": str(x)}
    if cls is argparse.Namespace:
        return {MARK: "namespace", "v": encode_value(dict(vars(x)), path)}
    if isinstance(x, enum.Enum) and _allowed(cls):
        return {MARK: "enum", "type": _qualname(cls), "v": x.name}
    if _allowed(cls) and hasattr(x, "__dict__"):
        return {MARK: "object", "type": _qualname(cls), "v": encode_value(dict(vars(x)), path)}
    raise UnsupportedValueError(
        f"cannot save {_qualname(cls)} at {path or '<root>'} through ckptlib (no pickle): convert it "
        "to tensors/JSON-typed values, or allow it with "
        "ckptlib.integrations.deepspeed.register_type(cls)"
    )


def _key(k: Any, path: str) -> Any:
    if type(k) is str or (type(k) is int):
        return k
    raise UnsupportedValueError(
        f"dict key {k!r} at {path or '<root>'} must be str or int to be saved without pickle"
    )


def decode_value(x: Any, where: str = "") -> Any:
    """Inverse of :func:`encode_value` on a loaded tree. Raises ``CorruptCheckpointError``
    for malformed markers or types that are not allow-listed."""
    if isinstance(x, dict):
        kind = x.get(MARK)
        if kind is None:
            return {k: decode_value(v, where) for k, v in x.items()}
        try:
            return _decode_marker(kind, x, where)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"malformed {kind!r} value: {type(e).__name__}: {e}", where
            ) from None
    if isinstance(x, list):
        return [decode_value(v, where) for v in x]
    if isinstance(x, tuple):
        return tuple(decode_value(v, where) for v in x)
    return x


def _decode_marker(kind: Any, x: dict[str, Any], where: str) -> Any:
    if kind == "dict":
        return {k: decode_value(v, where) for k, v in x["items"]}
    if kind == "odict":
        od = collections.OrderedDict((k, decode_value(v, where)) for k, v in x["items"])
        if x.get("meta") is not None:
            od._metadata = decode_value(x["meta"], where)  # type: ignore[attr-defined]
        return od
    if kind == "size":
        return torch.Size([int(v) for v in x["v"]])
    if kind == "set":
        return {decode_value(v, where) for v in x["v"]}
    if kind == "frozenset":
        return frozenset(decode_value(v, where) for v in x["v"])
    if kind == "device":
        return torch.device(str(x["v"]))
    if kind == "namespace":
        return argparse.Namespace(**decode_value(x["v"], where))
    if kind == "enum":
        cls = _resolve_type(str(x["type"]), where)
        if not issubclass(cls, enum.Enum):
            raise CorruptCheckpointError(f"{x['type']} is not an Enum", where)
        return cls[str(x["v"])]
    if kind == "object":
        cls = _resolve_type(str(x["type"]), where)
        attrs = decode_value(x["v"], where)
        if not isinstance(attrs, dict) or not all(isinstance(k, str) for k in attrs):
            raise CorruptCheckpointError(
                f"attributes of {x['type']} must be a dict with str keys", where
            )
        obj = cls.__new__(cls)  # type: ignore[call-overload]  # no __init__: attributes follow
        obj.__dict__.update(attrs)
        return obj
    raise CorruptCheckpointError(f"unknown value kind {kind!r}", where)

