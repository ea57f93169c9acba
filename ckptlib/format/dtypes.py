"""The dtype allowlist: the only tensor element types a manifest may name.

Pure: maps stable names (written into manifests) to ``torch.dtype`` and item sizes.
Names are torch's own (``str(torch.float32)`` without the prefix). Dtypes missing from the
running torch build are skipped, so a manifest naming one is rejected with a clear error.
"""

from __future__ import annotations

import torch

from ckptlib.errors import CorruptCheckpointError

_CANDIDATES = [
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "complex32", "complex64", "complex128",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool",
]

DTYPES: dict[str, torch.dtype] = {}
for _name in _CANDIDATES:
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        DTYPES[_name] = _dt
NAMES: dict[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}
ITEMSIZE: dict[str, int] = {name: dt.itemsize for name, dt in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Name to record for ``dtype``; raises ``TypeError`` for dtypes we cannot store."""
    try:
        return NAMES[dtype]
    except KeyError:
        raise TypeError(f"ckptlib cannot store tensors of dtype {dtype}") from None


def dtype_from_name(name: object, where: str = "") -> torch.dtype:
    """Inverse of :func:`dtype_name` for untrusted input (manifest content)."""
    if not isinstance(name, str) or name not in DTYPES:
        raise CorruptCheckpointError(f"dtype {name!r} is not in the allowlist", where)
    return DTYPES[name]
