"""The dtype allowlist: the only tensor element types a manifest may name.

Pure: maps stable names (written into manifests) to item sizes (:data:`ITEMSIZE`, no torch:
manifest decoding, ``ckptlib ls``/``verify``) and to ``torch.dtype`` (:data:`DTYPES`,
:data:`NAMES`: built on first access, importing torch then). Names are torch's own
(``str(torch.float32)`` without the prefix). A manifest naming a dtype the running torch build
lacks decodes, and ``DTYPES[name]`` then raises a clear :class:`CorruptCheckpointError`.
Tensor bytes are stored little-endian, as the host holds them (docs/format.md): on a big-endian
host, building these maps (the first save or load) raises :class:`UnsupportedPlatformError`
instead of writing or reading byte-swapped values.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ckptlib.errors import CheckpointError, CorruptCheckpointError
from ckptlib.format.validate import unknown

if TYPE_CHECKING:
    import torch

    DTYPES: dict[str, torch.dtype]
    NAMES: dict[torch.dtype, str]

ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "bool": 1,
}


class UnsupportedPlatformError(CheckpointError):
    """This host stores numbers big-endian; ckptlib's files hold them little-endian."""


class _TorchDtypes(dict[str, Any]):
    """``DTYPES``: an allowlisted name missing from this torch build is a typed error."""

    def __missing__(self, name: str) -> Any:
        raise CorruptCheckpointError(f"dtype {name!r} is not supported by this torch build")


def __getattr__(name: str) -> Any:
    """PEP 562: build ``DTYPES``/``NAMES`` (imports torch) on first access; the functions
    below call it too (a global lookup inside the module does not reach ``__getattr__``)."""
    if name not in ("DTYPES", "NAMES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    g = globals()
    if name in g:
        return g[name]
    if sys.byteorder != "little":
        raise UnsupportedPlatformError(
            f"ckptlib stores tensor bytes little-endian and this host is {sys.byteorder}-endian: saving or loading "
            "here would write or read byte-swapped values, so it is refused (docs/format.md, section 2)")
    import torch

    dtypes = _TorchDtypes()
    for n in ITEMSIZE:
        dt = getattr(torch, n, None)
        if isinstance(dt, torch.dtype):
            dtypes[n] = dt
    g["DTYPES"], g["NAMES"] = dtypes, {dt: n for n, dt in dtypes.items()}
    return g[name]


def dtype_name(dtype: torch.dtype) -> str:
    """Name to record for ``dtype``; raises ``TypeError`` for dtypes we cannot store."""
    try:
        return __getattr__("NAMES")[dtype]
    except KeyError:
        raise TypeError(f"ckptlib cannot store tensors of dtype {dtype}") from None


def dtype_from_name(name: object, where: str = "") -> torch.dtype:
    """Inverse of :func:`dtype_name` for untrusted input (manifest content)."""
    if not isinstance(name, str) or name not in ITEMSIZE:
        raise unknown(f"dtype {name!r:.60} is not in the allowlist", name, where)
    return __getattr__("DTYPES")[name]  # an allowlisted name this torch lacks: the torch build's error
