"""One validator for untrusted JSON read from storage (manifests, adapter metadata). Pure.

:class:`Checker` is created per document by its decoder (``format.manifest.decode``, the DCP
adapter's metadata decoder, ...) on the thread that reads it; each method returns the value it
checked or raises :class:`CorruptCheckpointError` naming the document and what is wrong;
:func:`unknown` words a name this ckptlib does not know (a dtype, codec, checksum algorithm or
value-tree node kind) as :class:`ManifestVersionError`: a newer ckptlib wrote it.
"""

from __future__ import annotations

import re
from typing import Any

from ckptlib._version import __version__
from ckptlib.errors import CorruptCheckpointError, ManifestVersionError

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

MAX_SIZE = 1 << 62  # no file, range or tensor may claim more bytes than this
MAX_NDIM = 64
MAX_NAME = 4096  # characters in a tensor name (readers refuse longer ones; the flattener refuses to save them)


def unknown(msg: str, name: object, where: str) -> CorruptCheckpointError:
    """The error for ``name`` (what ``msg`` describes) missing from a list this ckptlib knows:
    a name as a later ckptlib could write one is :class:`ManifestVersionError` (saying to
    upgrade; never treated as damage, so never replaced or pruned), anything else (a number, a
    list, an absurd string) plain :class:`CorruptCheckpointError`. Called by the manifest
    decoder and the value tree's decoder on the thread that reads the manifest."""
    if isinstance(name, str) and _NAME.fullmatch(name):
        return ManifestVersionError(f"{msg}: unknown to ckptlib {__version__}, so a newer ckptlib wrote it; "
                                    "upgrade ckptlib to read it", where)
    return CorruptCheckpointError(msg, where)


class Checker:
    """Validation helpers bound to one document (``where``); ``prefix`` starts every message."""

    def __init__(self, where: str, prefix: str = "") -> None:
        self.where = where
        self.prefix = prefix

    def fail(self, msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(self.prefix + msg, self.where)

    def unknown(self, msg: str, name: object) -> CorruptCheckpointError:
        """:func:`unknown` for this document."""
        return unknown(self.prefix + msg, name, self.where)

    def typed(self, x: Any, types: type | tuple[type, ...], what: str) -> Any:
        """``x`` if it is an instance of ``types`` (a bool is not an int here)."""
        if not isinstance(x, types) or (isinstance(x, bool) and types is not bool):
            raise self.fail(f"{what} has the wrong type")
        return x

    def ints(self, x: Any, what: str) -> list[int]:
        """A list of at most MAX_NDIM integers in [0, MAX_SIZE] (offsets, sizes)."""
        if type(x) is not list or len(x) > MAX_NDIM or any(
            type(v) is not int or not 0 <= v <= MAX_SIZE for v in x
        ):
            raise self.fail(f"{what} must be a list of non-negative integers")
        return x

    def obj(self, x: Any, what: str) -> dict[str, Any]:
        if not isinstance(x, dict):
            raise self.fail(f"{what} must be an object")
        return x

    def lst(self, x: Any, what: str) -> list[Any]:
        if not isinstance(x, list):
            raise self.fail(f"{what} must be a list")
        return x

    def int_(self, x: Any, what: str, lo: int = 0, hi: int = MAX_SIZE) -> int:
        if type(x) is not int or not lo <= x <= hi:
            raise self.fail(f"{what} must be an integer in [{lo}, {hi}], got {x!r:.60}")
        return x

    def str_(self, x: Any, what: str, maxlen: int = 4096) -> str:
        if not isinstance(x, str) or len(x) > maxlen:
            raise self.fail(f"{what} must be a string of at most {maxlen} characters")
        return x

    def shape(self, x: Any, what: str) -> tuple[int, ...]:
        if type(x) is not list:
            raise self.fail(f"{what} must be a list")
        if len(x) > MAX_NDIM:
            raise self.fail(f"{what} has more than {MAX_NDIM} dimensions")
        n = 1
        nonzero = 1  # product of the dims other than 0: bounds the strides of an empty tensor too
        for d in x:
            if type(d) is not int or not 0 <= d <= MAX_SIZE:
                raise self.fail(f"{what} must hold integers in [0, 2^62], got {d!r:.60}")
            n *= d
            if d:
                nonzero *= d
        if n > MAX_SIZE:
            raise self.fail(f"{what} {x} declares more than 2^62 elements")
        if nonzero > MAX_SIZE:
            raise self.fail(f"{what} {x}: its non-zero dimensions multiply to more than 2^62")
        return tuple(x)
