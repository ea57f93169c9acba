"""Strict JSON encoding and decoding for manifests. Pure.

``dumps`` writes compact ASCII JSON without NaN (sorted keys by default). ``loads`` rejects duplicate keys, NaN/Infinity,
nesting deeper than the interpreter's recursion limit and huge integers, raising :class:`CorruptCheckpointError` for all of them.
"""

from __future__ import annotations

import json
from typing import Any

from ckptlib.errors import CorruptCheckpointError


def dumps(obj: Any, *, sort_keys: bool = True) -> str:
    return json.dumps(obj, sort_keys=sort_keys, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def loads(data: bytes | str, where: str = "") -> Any:
    """Parse untrusted JSON; any problem is a ``CorruptCheckpointError`` naming ``where``."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray | memoryview) else data
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"not UTF-8 ({e})", where) from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"invalid JSON: {e}", where) from None
