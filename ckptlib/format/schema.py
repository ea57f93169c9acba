"""The v1 manifest's schema: the decoded records and the format's constants. Pure.

Built by :func:`ckptlib.format.decode.decode` (from untrusted bytes) and by callers that
assemble a manifest in memory (tests, tools); serialized by :mod:`ckptlib.format.build`.
The JSON layout of each record is documented in ``docs/format.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ckptlib.format.dtypes import ITEMSIZE

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "Chunk", "FileEntry", "IndexRef", "Manifest", "Pack", "Piece",
           "TensorEntry"]  # fmt: skip

FORMAT_NAME = "ckptlib"
FORMAT_VERSION = 2
"""The newest version this library reads; it writes 2 for ``persist`` saves, 1 for adapters."""
MANIFEST_NAME = "manifest.json"
CODECS = ("raw", "zstd", "zstd-shuffle")
COMMIT_MODES = ("rename", "conditional_put", "put_verify")

MAX_MANIFEST_BYTES = 256 << 20
"""Largest manifest file accepted: about 4M sharded pieces or 1.7M whole tensors (the arithmetic
is in docs/format.md, "Limits"). Readers refuse a bigger one by its size, before reading it."""

# zstd cannot expand a frame by more than this factor (an RLE block: 4 bytes -> 128 KiB).
MAX_ZSTD_RATIO = 32768


@dataclass(frozen=True, slots=True)
class Chunk:
    """One independently checksummed byte range holding a box of a tensor."""

    file: int
    """Index into :attr:`Manifest.files`."""
    start: int
    """Byte offset of the stored bytes in the file."""
    length: int
    """Number of stored bytes (after compression)."""
    checksum: str
    """Hex digest of the stored bytes with :attr:`Manifest.checksum_algorithm`."""
    offset: tuple[int, ...]
    """Position of the box in the global tensor."""
    shape: tuple[int, ...]
    """Shape of the box; its raw size is ``prod(shape) * itemsize``."""
    codec: str = "raw"
    """``raw``, ``zstd`` or ``zstd-shuffle`` (bytes grouped by position in the element)."""


@dataclass(frozen=True, slots=True)
class Pack:
    """One checksummed byte range holding many small tensor pieces, packed back to back.

    Small tensors are packed so that each costs neither a file, nor a write, nor a checksum of
    its own. The pack is stored (and compressed) as a whole; its members are raw bytes at
    ``raw_offset`` inside the decoded pack.
    """

    file: int
    start: int
    length: int
    """Stored bytes (after compression)."""
    checksum: str
    codec: str
    """``raw`` or ``zstd`` (members have mixed dtypes, so no byte shuffle)."""
    raw_length: int
    """Bytes after decoding."""


class Piece(NamedTuple):
    """A box of a tensor stored inside a :class:`Pack`."""

    pack: int
    raw_offset: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]


class TensorEntry(NamedTuple):
    """One saved tensor: its chunks of its own and/or its pieces inside packs.

    A tuple (not a dataclass) because a manifest holds one per tensor and decoding builds
    tens of thousands of them; ``chunks`` and ``pieces`` must not be mutated.
    """

    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk]
    pieces: list[Piece] = []

    @property
    def nbytes(self) -> int:
        return volume(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    """Relative to the step folder, e.g. ``<save_id>/r00000-0.bin``."""
    size: int
    """Exact size in bytes; the scanner checks it against storage."""


@dataclass(frozen=True, slots=True)
class IndexRef:
    """v2: one rank's piece index file (``format/index_file.py``)."""

    path: str
    """Relative to the step folder, like payload paths."""
    size: int
    checksum: str
    """xxh3_64 hex digest of the whole file."""
    rank: int
    first_file: int
    """The rank's payload files are ``files[first_file : first_file + num_files]``."""
    num_files: int
    counts: dict[str, int]
    tail: bool = False
    """The index is the last :attr:`size` bytes of the rank's last payload file (``path`` names
    that file, ``files[first_file + num_files - 1]``), not a file of its own: one file per rank
    per save (engine/writer.py ``write_files_indexed``: a plain save written in one go)."""

    @property
    def holder(self) -> int | None:
        """:attr:`tail`: the position in ``Manifest.files`` of the payload file holding the index."""
        return self.first_file + self.num_files - 1 if self.tail else None

    def file_entry(self, files: list[FileEntry]) -> FileEntry | None:
        """:attr:`tail`: the payload file that holds the index, else None."""
        return None if self.holder is None else files[self.holder]


@dataclass(slots=True)
class Manifest:
    step: int | None
    save_id: str
    created: float
    world_size: int
    commit: str
    files: list[FileEntry]
    tensors: dict[str, TensorEntry]
    tree: Any
    metadata: Any = None
    packs: list[Pack] = field(default_factory=list)
    checksum_algorithm: str = "xxh3_64"
    library: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    """User metrics of this step (``save(..., metrics=)``): retention's ``keep_best`` ranks by them."""
    version: int = 1
    """``format_version`` as read (2: pieces live in :attr:`indexes`, loaded on demand)."""
    indexes: list[IndexRef] = field(default_factory=list)
    """v2: one piece index file per writing rank (empty for v1)."""
    sharding: dict[str, Any] = field(default_factory=dict)
    """v2: tensor name -> :class:`ckptlib.format.sharding.Sharding`."""
    loaded: set[int] = field(default_factory=set)
    """v2: positions in :attr:`indexes` whose pieces are in :attr:`tensors` / :attr:`packs`."""

    @property
    def complete(self) -> bool:
        """True when every tensor's chunks and pieces are present (always for v1)."""
        return len(self.loaded) == len(self.indexes)

    @property
    def payload_bytes(self) -> int:
        return sum(f.size for f in self.files)


MAX_METRICS = 256
"""Most metrics one step may record (they are a small field of the manifest, not a log)."""


def check_metrics(metrics: Any) -> dict[str, float]:
    """A step's metrics as the manifest stores them: a flat dict of str -> finite float (ints
    are converted). Writers call it on user input (raises ``ValueError`` naming the key)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics must be a dict of str -> float, got {type(metrics).__name__}")
    if len(metrics) > MAX_METRICS:
        raise ValueError(f"metrics holds {len(metrics)} entries, over the limit of {MAX_METRICS}")
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or not 0 < len(k) <= 200:
            raise ValueError(f"metrics key {k!r:.60} must be a non-empty str of at most 200 characters")
        number: Any = v
        if not isinstance(v, bool | int | float) and callable(getattr(v, "item", None)):
            try:  # a 0-d tensor or NumPy scalar: its Python number
                number = v.item()
            except Exception:
                raise ValueError(f"metrics[{k!r}] must be a single number, got {type(v).__name__}") from None
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise ValueError(f"metrics[{k!r}] must be a number, got {type(v).__name__}")
        f = float(number)
        if not math.isfinite(f):
            raise ValueError(f"metrics[{k!r}] must be finite, got {f}")
        out[k] = f
    return out


def volume(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def is_whole_packed(t: TensorEntry) -> bool:
    """True if ``t`` is stored as one whole-tensor piece of a pack: a packed-table row.

    Rows are never empty; an empty tensor stays in ``tensors`` (as the writer stores it).
    """
    return not t.chunks and len(t.pieces) == 1 and t.pieces[0].shape == t.shape and all(t.shape)
