"""Flatten a user's ``state`` into a JSON tree plus a list of tensors to write. Pure (no I/O).

Called on the training thread by the engine at the start of every save. The tree is what the
manifest records under ``tree`` (schema in :mod:`ckptlib.format.tree`); every tensor is replaced
by ``{"t": "tensor", "ref": NAME}`` and appears once in the returned ``tensors``.

Objects with ``state_dict()``/``load_state_dict()`` (modules, optimizers, LR schedulers, grad
scalers) are saved through their state dicts. Anything else that is not JSON-typed raises
:class:`UnsupportedValueError` naming its path: ckptlib never pickles.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

import torch

from ckptlib.errors import UnsupportedValueError
from ckptlib.format.dtypes import dtype_name
from ckptlib.format.leaves import PerRank, Shard

INLINE_BYTES = 4096  # bytes values up to this size are stored inline (base64) in the manifest
MAX_DEPTH = 100


@dataclass(slots=True)
class TensorItem:
    """One tensor (or one piece of a sharded tensor) this rank contributes to the checkpoint."""

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replicated: bool
    """True for plain tensors (every rank holds the same bytes; one copy is written)."""


@dataclass(slots=True)
class FlatState:
    tree: Any
    items: list[TensorItem]


def escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


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
        return int(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else {"t": "float", "v": repr(x)}
    if isinstance(x, bytes | bytearray | memoryview):
        return {"t": "bytes", "b64": base64.b64encode(bytes(x)).decode("ascii")}
    if isinstance(x, torch.dtype):
        return {"t": "dtype", "v": dtype_name(x)}
    raise UnsupportedValueError(
        f"cannot save {type(x).__module__}.{type(x).__qualname__} at {path or '<root>'}: "
        "ckptlib stores tensors and JSON-typed values (None, bool, int, float, str, bytes, "
        "list, tuple, dict) without pickle; convert it to one of those"
    )


def flatten(state: Any, rank: int = 0) -> FlatState:
    items: list[TensorItem] = []
    tree = _encode(state, "", items, rank, 0)
    return FlatState(tree, items)


def _key(k: Any, path: str) -> Any:
    if isinstance(k, bool) or not isinstance(k, str | int):
        raise UnsupportedValueError(
            f"dict key {k!r} at {path or '<root>'} must be str or int to be saved without pickle"
        )
    return k


def _encode(x: Any, path: str, items: list[TensorItem], rank: int, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise UnsupportedValueError(f"state nested deeper than {MAX_DEPTH} levels at {path}")
    if isinstance(x, torch.Tensor):
        return _tensor(x, path, items, tuple(x.shape), (0,) * x.dim(), True)
    if isinstance(x, Shard):
        return _tensor(x.local, path, items, tuple(x.global_shape), tuple(x.global_offset), False)
    if isinstance(x, PerRank):
        return {"t": "per_rank", "rank": rank, "v": _encode(x.value, f"{path}/@rank{rank}", items, rank, depth + 1)}
    if isinstance(x, dict):
        return {
            "t": "dict",
            "items": [
                [_key(k, path), _encode(v, f"{path}/{escape(str(k))}", items, rank, depth + 1)]
                for k, v in x.items()
            ],
        }
    if isinstance(x, list | tuple):
        kind = "list" if isinstance(x, list) else "tuple"
        return {
            "t": kind,
            "items": [_encode(v, f"{path}/{i}", items, rank, depth + 1) for i, v in enumerate(x)],
        }
    if is_stateful(x):
        sd = x.state_dict()
        cls = type(x)
        return {
            "t": "stateful",
            "type": f"{cls.__module__}.{cls.__qualname__}",
            "v": _encode(sd, path, items, rank, depth + 1),
        }
    if isinstance(x, bytes | bytearray | memoryview) and len(x) > INLINE_BYTES:
        data = torch.frombuffer(bytearray(x), dtype=torch.uint8)
        node = _tensor(data, path, items, (data.numel(),), (0,), True)
        return {"t": "bytes", "ref": node["ref"]}
    return encode_scalar(x, path)


def _tensor(
    t: torch.Tensor,
    path: str,
    items: list[TensorItem],
    global_shape: tuple[int, ...],
    global_offset: tuple[int, ...],
    replicated: bool,
) -> dict[str, Any]:
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedValueError(f"tensor at {path}: layout {t.layout} is not supported")
    if type(t).__name__ == "DTensor":
        raise UnsupportedValueError(f"DTensor at {path}: use ckptlib.Shard for now")
    try:
        dtype_name(t.dtype)
    except TypeError as e:
        raise UnsupportedValueError(f"tensor at {path}: {e}") from None
    name = path or "/"
    items.append(TensorItem(name, t.detach(), global_shape, global_offset, replicated))
    return {"t": "tensor", "ref": name}
