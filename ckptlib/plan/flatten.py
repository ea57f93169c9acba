"""Flatten a user's ``state`` into a JSON tree plus a list of tensors to write. Pure (no I/O).

Called on the training thread by the engine at the start of every save. The tree is what the
manifest records under ``tree`` (schema in :mod:`ckptlib.format.tree`); every tensor is replaced
by ``{"t": "tensor", "ref": NAME}`` and appears once in the returned ``tensors``.

Objects with ``state_dict()``/``load_state_dict()`` (modules, optimizers, LR schedulers, grad
scalers) are saved through their state dicts. ``io.BytesIO`` values are stored as their bytes
(a bytes node marked ``"io": true``) and load back as ``io.BytesIO``. Anything else that is not
JSON-typed raises :class:`UnsupportedValueError` naming its path: ckptlib never pickles.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Any

import torch

from ckptlib.errors import UnsupportedValueError
from ckptlib.format.dtypes import NAMES, dtype_name
from ckptlib.format.leaves import PerRank, Shard
from ckptlib.format.manifest import MAX_NAME, MAX_NDIM
from ckptlib.format.tree import MAX_INLINE_B64
from ckptlib.format.tree import (
    escape as escape,  # re-exported: the one naming rule (megatron uses it)
)

INLINE_BYTES = 4096  # bytes values up to this size are stored inline (base64) in the manifest
MAX_DEPTH = 100
MAX_INLINE_RAW = MAX_INLINE_B64 // 4 * 3
"""Bytes a value stored inline (metadata: ``inline_bytes=True``) may hold: its base64 text must
fit the tree decoder's ``MAX_INLINE_B64``."""


@dataclass(slots=True)
class TensorItem:
    """One tensor (or one piece of a sharded tensor) this rank contributes to the checkpoint."""

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replicated: bool
    """True for plain tensors (every rank holds the same bytes; one copy is written)."""
    copies: bool = False
    """True for a piece other ranks hold too: a DTensor with a ``Replicate`` placement over a
    mesh dimension of more than one rank (HSDP, DDP-style DTensors); ``check_replicas=True``
    compares those copies (``engine/checks.py``)."""


@dataclass(slots=True)
class FlatState:
    tree: Any
    items: list[TensorItem]
    per_rank: bool
    """True if the tree holds ``per_rank`` nodes (the manifest build must merge trees then)."""
    error: BaseException | None = None
    """Why this rank's state cannot be saved (``ckptlib.engine.save.prepare`` with ``collective``;
    ``tree`` and ``items`` are then empty): the save fails on every rank, naming it."""


def is_stateful(obj: Any) -> bool:
    return (
        not isinstance(obj, torch.Tensor)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def encode_scalar(x: Any, path: str) -> Any:
    """JSON node for a non-tensor, non-container leaf."""
    if x is None or isinstance(x, bool | str):
        return x
    if isinstance(x, int):
        if x.bit_length() > 13_000:  # ~4,000 digits: beyond what JSON readers accept
            raise UnsupportedValueError(f"int at {path or '<root>'} has more than 4,000 digits")
        return int(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else {"t": "float", "v": repr(x)}
    if isinstance(x, bytes | bytearray | memoryview):
        return {"t": "bytes", "b64": base64.b64encode(bytes(x)).decode("ascii")}
    if isinstance(x, io.BytesIO):  # its whole buffer, whatever its position (loads back at 0)
        return {"t": "bytes", "b64": base64.b64encode(x.getvalue()).decode("ascii"), "io": True}
    if isinstance(x, torch.dtype):
        try:
            return {"t": "dtype", "v": dtype_name(x)}
        except TypeError as e:
            raise UnsupportedValueError(f"{path or '<root>'}: {e}") from None
    raise UnsupportedValueError(
        f"cannot save {type(x).__module__}.{type(x).__qualname__} at {path or '<root>'}: "
        "ckptlib stores tensors and JSON-typed values (None, bool, int, float, str, bytes, "
        "io.BytesIO, list, tuple, dict) without pickle; convert it to one of those"
    )


def flatten(state: Any, rank: int = 0, *, inline_bytes: bool = False) -> FlatState:
    """``inline_bytes=True`` keeps every bytes value in the tree (used for metadata and plain
    values): such a tree stands alone, so bytes past ``MAX_INLINE_RAW`` and ``PerRank`` values
    raise :class:`UnsupportedValueError` naming their path."""
    f = _Flattener([], rank, inline_bytes)
    tree = f.encode(state, "", 0)
    return FlatState(tree, f.items, f.saw_per_rank)


def _key(k: Any, path: str) -> Any:
    if isinstance(k, bool) or not isinstance(k, str | int):
        raise UnsupportedValueError(
            f"dict key {k!r} at {path or '<root>'} must be str or int to be saved without pickle"
        )
    return k


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_ZEROS = [(0,) * n for n in range(MAX_NDIM + 1)]  # global offsets of whole tensors, by ndim


def check_name(name: str) -> str:
    """``name``, a tensor's name in a checkpoint, or :class:`UnsupportedValueError` when it is
    longer than ``MAX_NAME`` (readers refuse it: never write a step that cannot load). Caller's
    thread, before any I/O: the flattener, for every tensor, and adapters that build names
    themselves (the Megatron save strategy)."""
    if len(name) > MAX_NAME:
        raise UnsupportedValueError(
            f"tensor at {name[:200]}... has a name of {len(name)} characters (its keys joined by '/', "
            f"escaped); a checkpoint holds names of at most {MAX_NAME}: shorten the keys on its path"
        )
    return name


@dataclass(slots=True)
class _Flattener:
    """One walk over the state. Hot for states with many tensors: keep per-leaf work small."""

    items: list[TensorItem]
    rank: int
    inline_bytes: bool
    in_per_rank: int = 0
    saw_per_rank: bool = False

    def encode(self, x: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedValueError(f"state nested deeper than {MAX_DEPTH} levels at {path}")
        cls = type(x)
        if cls in _PLAIN_TENSORS:
            return self.tensor(x, path, None, None, True)
        if cls is dict:
            return self.mapping(x, path, depth)
        if x is None or cls is bool or cls is str:
            return x
        if cls is float:
            return x if math.isfinite(x) else {"t": "float", "v": repr(x)}
        if isinstance(x, torch.Tensor):
            if is_dtensor(x):
                local, global_shape, offset = dtensor_piece(x, path)
                return self.tensor(local, path, global_shape, offset, False, copies=dtensor_copies(x))
            return self.tensor(x, path, None, None, True)
        if isinstance(x, Shard):
            return self.tensor(x.local, path, tuple(x.global_shape), tuple(x.global_offset), False)
        if isinstance(x, PerRank):
            if self.inline_bytes:  # metadata is one value for the whole save: no rank merges it
                raise UnsupportedValueError(f"ckptlib.PerRank at {path or '<root>'}: metadata is one value for the "
                                            "whole save; put per-rank values in the state")
            self.saw_per_rank = True
            self.in_per_rank += 1
            try:
                inner = self.encode(x.value, f"{path}/@rank{self.rank}", depth + 1)
            finally:
                self.in_per_rank -= 1
            return {"t": "per_rank", "rank": self.rank, "v": inner}
        if isinstance(x, dict):
            return self.mapping(x, path, depth)
        if isinstance(x, list | tuple):
            kind = "list" if isinstance(x, list) else "tuple"
            return {"t": kind, "items": [self.encode(v, f"{path}/{i}", depth + 1) for i, v in enumerate(x)]}
        if is_stateful(x):
            return {
                "t": "stateful",
                "type": f"{cls.__module__}.{cls.__qualname__}",
                "v": self.encode(x.state_dict(), path, depth + 1),
            }
        if isinstance(x, bytes | bytearray | memoryview) and len(x) > INLINE_BYTES and not self.inline_bytes:
            return {"t": "bytes", "ref": self.tensor(_byte_tensor(x), path, None, None, True)["ref"]}
        if isinstance(x, io.BytesIO) and x.getbuffer().nbytes > INLINE_BYTES and not self.inline_bytes:
            ref = self.tensor(_byte_tensor(x.getvalue()), path, None, None, True)["ref"]
            return {"t": "bytes", "ref": ref, "io": True}
        if self.inline_bytes and isinstance(x, bytes | bytearray | memoryview | io.BytesIO):
            n = x.getbuffer().nbytes if isinstance(x, io.BytesIO) else memoryview(x).nbytes
            if n > MAX_INLINE_RAW:  # more than the tree decoder accepts inline: no reader could load it
                raise UnsupportedValueError(f"bytes at {path or '<root>'}: {n} bytes; metadata holds at most "
                                            f"{MAX_INLINE_RAW} bytes inline: put larger values in the state")
        return encode_scalar(x, path)

    def mapping(self, x: dict[Any, Any], path: str, depth: int) -> Any:
        items: list[list[Any]] = []
        add, encode, tensor = items.append, self.encode, self.tensor
        if x and depth >= MAX_DEPTH:  # a child would be nested too deep (checked once here)
            raise UnsupportedValueError(f"state nested deeper than {MAX_DEPTH} levels at {path}")
        for k, v in x.items():
            if type(k) is not str:
                _key(k, path)
                sub = f"{path}/{k}"
            else:
                sub = f"{path}/{escape(k)}" if not k or "/" in k or "~" in k or k[0] in "-0123456789" else f"{path}/{k}"
            # A plain tensor value (the common case in state dicts) skips the dispatch.
            add([k, tensor(v, sub, None, None, True) if type(v) in _PLAIN_TENSORS else encode(v, sub, depth + 1)])
        return {"t": "dict", "items": items}

    def tensor(
        self,
        t: torch.Tensor,
        path: str,
        global_shape: tuple[int, ...] | None,
        global_offset: tuple[int, ...] | None,
        replicated: bool,
        copies: bool = False,
    ) -> dict[str, Any]:
        if t.layout is not torch.strided:
            raise UnsupportedValueError(f"tensor at {path}: layout {t.layout} is not supported")
        if t.is_nested:  # strided layout, but no single shape
            raise UnsupportedValueError(f"tensor at {path} is a nested tensor, which ckptlib cannot store; "
                                        "save its components instead (t.unbind())")
        if t.is_meta:
            raise UnsupportedValueError(f"tensor at {path} is on the meta device (it has no data)")
        if t.dtype not in NAMES:
            raise UnsupportedValueError(f"tensor at {path}: ckptlib cannot store dtype {t.dtype}")
        name = check_name(path or "/")
        if global_shape is None:
            global_shape = tuple(t.shape)
            if len(global_shape) > MAX_NDIM:
                raise UnsupportedValueError(
                    f"tensor at {path} has {len(global_shape)} dimensions; a checkpoint holds at most {MAX_NDIM}"
                )
            global_offset = _ZEROS[len(global_shape)]
        elif len(global_shape) > MAX_NDIM:
            raise UnsupportedValueError(f"tensor at {path} has more than {MAX_NDIM} dimensions")
        assert global_offset is not None  # callers pass a shape and its offset together
        self.items.append(TensorItem(name, t, global_shape, global_offset, replicated and not self.in_per_rank,
                                     copies and not self.in_per_rank))
        return {"t": "tensor", "ref": name}


def _byte_tensor(x: bytes | bytearray | memoryview) -> torch.Tensor:
    """A bytes value as the 1-D uint8 tensor that stores it (a copy: the value may change
    before the save's writer threads read it)."""
    return torch.frombuffer(bytearray(x), dtype=torch.uint8)


def is_dtensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and type(x).__name__ == "DTensor"


def dtensor_copies(x: Any) -> bool:
    """Whether other ranks hold this rank's piece of DTensor ``x`` too (a ``Replicate``
    placement over a mesh dimension of more than one rank). Called by the flattener (save)."""
    from torch.distributed.tensor import Replicate

    return any(isinstance(p, Replicate) and x.device_mesh.size(i) > 1 for i, p in enumerate(x.placements))


def dtensor_piece(x: Any, path: str) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global shape, global offset) of this rank's piece of a DTensor.

    Replicated dimensions make several ranks hold the same piece; the save planner writes
    it once. Used by the save (flatten) and by loads into DTensor targets.
    """
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in x.placements):
        raise UnsupportedValueError(
            f"DTensor at {path or '<root>'} has a Partial placement; redistribute it before saving/loading"
        )
    _, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    return x.to_local(), tuple(x.shape), tuple(offset)
