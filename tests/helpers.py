"""Shared test utilities: exact comparisons, random tensors, manifest tampering, and a patch
of every way a POSIX storage creates a file (:func:`patch_creates`).

The hostile-input suites (tests/test_safe_loading.py in process, tests/chaos/corpus.py in
memory/CPU-limited subprocesses) forge their inputs with these helpers only, from the same
template state (:func:`base_state`).

The tampering helpers mirror :func:`ckptlib.format.manifest.encode` so a test can edit the
manifest's ``body`` and write it back *with a correct self-checksum*, which lets the test reach
the validation that runs after the checksum check. They parse with the standard ``json``
module on purpose (a test must be able to write things the library would refuse).
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zstandard

from ckptlib.backends import Entry, ReadHandle, Storage
from ckptlib.format import jsonio
from ckptlib.format.checksum import checksum
from ckptlib.format.manifest import (
    FORMAT_NAME,
    MANIFEST_NAME,
    TABLE_COLUMNS,
    TABLE_KEY,
)
from ckptlib.testing.faults import FaultyStorage

# --------------------------------------------------------------------------- tensors


def random_tensor(shape: tuple[int, ...] | list[int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor whose bytes are uniformly random (every bit pattern, NaN payloads included).

    ``bool`` gets random 0/1 bytes only: other byte values are not valid booleans.
    """
    shape = tuple(shape)
    n = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's element bytes as a flat uint8 tensor (logical order, dense copy)."""
    t = t.detach().cpu().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    return t.reshape(-1).view(torch.uint8)


def assert_tensor_equal(actual: Any, expected: torch.Tensor, where: str = "") -> None:
    """Same dtype, shape and bytes (bitwise: NaN payloads, -0.0, ...)."""
    assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(tensor_bytes(actual), tensor_bytes(expected)), f"{where}: bytes differ"


def _same_float(a: float, b: float) -> bool:
    if math.isnan(a) and math.isnan(b):
        return True  # a Python float NaN is recorded as "nan": sign/payload are not kept
    return struct.pack("<d", a) == struct.pack("<d", b)


def assert_same(actual: Any, expected: Any, where: str = "<root>") -> None:
    """Exact structural equality: container types, dict key order, value types, float bits,
    tensor bytes. Loaded tensors must be plain ``torch.Tensor`` on the CPU."""
    if isinstance(expected, torch.Tensor):
        assert type(actual) is torch.Tensor, f"{where}: type {type(actual).__name__} is not torch.Tensor"
        assert actual.device.type == "cpu", f"{where}: loaded on {actual.device}"
        assert_tensor_equal(actual, expected, where)
        return
    expected_type = bytes if isinstance(expected, bytearray | memoryview) else type(expected)
    assert type(actual) is expected_type, (
        f"{where}: type {type(actual).__name__} != {expected_type.__name__}"
    )
    if isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)!r} != {list(expected)!r}"
        for k in expected:
            assert_same(actual[k], expected[k], f"{where}/{k!r}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}/{i}")
    elif isinstance(expected, float):
        assert _same_float(actual, expected), f"{where}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, f"{where}: {actual!r:.200} != {expected!r:.200}"


def base_state() -> dict[str, Any]:
    """The state every hostile-input template holds: two tensors big enough for chunks of
    their own, small ones that are packed, bytes, plain values."""
    return {
        "big": random_tensor((64, 1024), torch.float32, 1),  # 256 KiB: a chunk of its own
        "big2": random_tensor((128, 256), torch.int64, 2),  # 256 KiB: a chunk of its own
        "small": random_tensor((16,), torch.float32, 3),  # packed
        "small2": random_tensor((4, 4), torch.bfloat16, 4),  # packed
        "blob": bytes(range(256)) * 20,  # 5120 bytes: stored as a uint8 tensor
        "step": 3,
        "name": "x",
    }


# --------------------------------------------------------------------------- files


def payload_files(folder: str | os.PathLike[str]) -> list[Path]:
    """Every payload file of a checkpoint folder (regular ``*.bin`` files), sorted."""
    return sorted(p for p in Path(folder).rglob("*.bin") if p.is_file() and not p.is_symlink())


def flip_bit(path: str | os.PathLike[str], offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


# --------------------------------------------------------------------------- manifests


def manifest_path(folder: str | os.PathLike[str]) -> Path:
    return Path(folder) / MANIFEST_NAME


def read_manifest_doc(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole manifest document (``format``, ``format_version``, ``checksum``, ``body``)."""
    return json.loads(manifest_path(folder).read_bytes())


def frame(
    text: bytes, *, format_version: Any = 1, fmt: Any = FORMAT_NAME, digest: str | None = None
) -> bytes:
    """Manifest bytes around an already serialized body ``text`` (which may be invalid JSON),
    framed like ``ckptlib.format.manifest.encode_body``: a fixed head, the body, ``}``. The
    checksum is the library's own, over exactly ``text``, unless ``digest`` is given (to forge
    a mismatch)."""
    if digest is None:
        digest = checksum(text)
    head = (
        f'{{"format":{json.dumps(fmt)},"format_version":{json.dumps(format_version)},'
        f'"checksum":"xxh3_64:{digest}","body":'
    )
    return head.encode("ascii") + text + b"}"


def encode_manifest(body: Any, **framing: Any) -> bytes:
    """Manifest bytes for ``body`` (its compact JSON, see :func:`frame` for ``framing``)."""
    return frame(jsonio.dumps(body, sort_keys=False).encode("ascii"), **framing)


def body_text(folder: str | os.PathLike[str]) -> bytes:
    """The exact bytes of the body inside ``folder``'s manifest."""
    data = manifest_path(folder).read_bytes()
    return data[data.index(b'"body":') + len(b'"body":') : -1]


def body_of(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest body of ``folder`` (parsed with ``json``, not the library)."""
    return read_manifest_doc(folder)["body"]


def chunk0(body: dict[str, Any], name: str) -> list[Any]:
    """The first chunk entry of tensor ``name`` (a stored tensor of its own)."""
    return body["tensors"][name]["chunks"][0]


def tree_item(body: dict[str, Any], key: str) -> list[Any]:
    """The ``[key, node]`` item of the value tree's top-level dict."""
    for item in body["tree"]["items"]:
        if item[0] == key:
            return item
    raise KeyError(key)


def manifest_digest(folder: str | os.PathLike[str]) -> str:
    """The hex digest recorded in ``folder``'s manifest."""
    return read_manifest_doc(folder)["checksum"].partition(":")[2]


def write_manifest_bytes(folder: str | os.PathLike[str], data: bytes) -> None:
    manifest_path(folder).write_bytes(data)


def rewrite_manifest(
    folder: str | os.PathLike[str], edit: Callable[[dict[str, Any]], Any], **framing: Any
) -> dict[str, Any]:
    """Load ``folder``'s manifest, let ``edit`` change its body in place (its return value is
    ignored), and write it back with a valid checksum. Returns the body written."""
    body = read_manifest_doc(folder)["body"]
    edit(body)
    write_manifest_bytes(folder, encode_manifest(body, **framing))
    return body


def tensor_ranges(body: dict[str, Any], name: str) -> list[tuple[int, int, int]]:
    """``(file index, start, length)`` of the stored bytes holding tensor ``name``: its chunks,
    or the packs its pieces live in (whichever the writer used: a row of the packed table, or
    ``packed`` pieces in its ``tensors`` entry)."""
    packs = body.get("packs", [])
    row = packed_row(body, name)
    if row is not None:
        p = packs[body[TABLE_KEY]["pack"][row]]
        return [(p[0], p[1], p[2])]
    entry = body["tensors"][name]
    out = [(c[0], c[1], c[2]) for c in entry.get("chunks", [])]
    for piece in entry.get("packed", []):
        p = packs[piece[0]]
        out.append((p[0], p[1], p[2]))
    return out


# -- the packed table: tensors stored whole inside a pack are rows of ``body[TABLE_KEY]``
# (columns ``name, dtype, ndim, dims, pack, offset``; ``dims`` is every row's shape, flat).
# These helpers find and edit such a tensor whichever form it has: a table row, or the older
# ``body["tensors"][name] = {"dtype", "shape", "packed": [[pack, raw_offset]]}`` that the
# decoder still accepts.


def packed_row(body: dict[str, Any], name: str) -> int | None:
    """The row of tensor ``name`` in the packed table, or None if it is not a row."""
    table = body.get(TABLE_KEY)
    if not isinstance(table, dict) or not isinstance(table.get("name"), list):
        return None
    try:
        return table["name"].index(name)
    except ValueError:
        return None


def table_rows(body: dict[str, Any]) -> list[str]:
    """Names of the tensors that are rows of the packed table, in row order."""
    table = body.get(TABLE_KEY)
    return list(table["name"]) if isinstance(table, dict) else []


def tensor_names(body: dict[str, Any]) -> list[str]:
    """Every tensor the manifest lists: ``tensors`` entries, then table rows."""
    return [*body["tensors"], *table_rows(body)]


def row_dims(body: dict[str, Any], row: int) -> slice:
    """Where row ``row``'s shape lies in the flat ``dims`` column."""
    ndim = body[TABLE_KEY]["ndim"]
    start = sum(ndim[:row])
    return slice(start, start + ndim[row])


def tensor_decl(body: dict[str, Any], name: str) -> tuple[str, list[int]]:
    """``(dtype, shape)`` of tensor ``name``, whichever form it has."""
    row = packed_row(body, name)
    if row is not None:
        table = body[TABLE_KEY]
        return table["dtype"][row], table["dims"][row_dims(body, row)]
    entry = body["tensors"][name]
    return entry["dtype"], entry["shape"]


def packed_location(body: dict[str, Any], name: str) -> tuple[int, int]:
    """``(pack index, raw offset)`` of tensor ``name`` stored whole in a pack (either form)."""
    row = packed_row(body, name)
    if row is not None:
        table = body[TABLE_KEY]
        return table["pack"][row], table["offset"][row]
    piece = body["tensors"][name]["packed"][0]
    return piece[0], piece[1]


def set_packed_location(body: dict[str, Any], name: str, *, pack: Any = None, offset: Any = None) -> None:
    """Point tensor ``name`` (stored whole in a pack, either form) at another pack and/or raw
    offset; ``None`` keeps the current value."""
    row = packed_row(body, name)
    if row is not None:
        table = body[TABLE_KEY]
        cells = (table["pack"], row), (table["offset"], row)
    else:
        piece = body["tensors"][name]["packed"][0]
        cells = (piece, 0), (piece, 1)
    for (seq, i), value in zip(cells, (pack, offset), strict=True):
        if value is not None:
            seq[i] = value


def drop_row(body: dict[str, Any], name: str) -> dict[str, Any]:
    """Remove tensor ``name``'s row from the packed table (every column stays consistent);
    returns it as ``{"dtype", "shape", "pack", "offset"}``."""
    row = packed_row(body, name)
    assert row is not None, f"{name} is not a row of the packed table"
    table = body[TABLE_KEY]
    shape = table["dims"][row_dims(body, row)]
    del table["dims"][row_dims(body, row)]
    out = {"dtype": table["dtype"][row], "shape": shape, "pack": table["pack"][row], "offset": table["offset"][row]}
    for col in TABLE_COLUMNS:
        if col != "dims":
            del table[col][row]
    return out


def add_row(body: dict[str, Any], name: str, dtype: str, shape: list[int], pack: int, offset: int) -> None:
    """Append a row to the packed table (created if missing), like the writer does."""
    table = body.setdefault(TABLE_KEY, {col: [] for col in TABLE_COLUMNS})
    table["name"].append(name)
    table["dtype"].append(dtype)
    table["ndim"].append(len(shape))
    table["dims"].extend(shape)
    table["pack"].append(pack)
    table["offset"].append(offset)


def row_to_dict_form(body: dict[str, Any], name: str) -> None:
    """Move tensor ``name`` from the packed table to the older ``tensors`` form
    ``{"dtype", "shape", "packed": [[pack, raw_offset]]}`` (same bytes, still valid)."""
    r = drop_row(body, name)
    body["tensors"][name] = {"dtype": r["dtype"], "shape": r["shape"], "packed": [[r["pack"], r["offset"]]]}


def payload_dir(folder: str | os.PathLike[str], body: dict[str, Any]) -> Path:
    """The folder payload files live in (``<save_id>/`` inside the step folder)."""
    return Path(folder) / body["files"][0][0].rsplit("/", 1)[0]


def add_payload(folder: str | os.PathLike[str], body: dict[str, Any], data: bytes, name: str) -> int:
    """Write ``data`` as a new payload file next to the others; list it in ``body["files"]``
    and return its index."""
    rel = f"{body['files'][0][0].rsplit('/', 1)[0]}/{name}"
    (Path(folder) / rel).write_bytes(data)
    body["files"].append([rel, len(data)])
    return len(body["files"]) - 1


def set_single_chunk(
    body: dict[str, Any],
    name: str,
    *,
    file: int,
    stored: bytes,
    dtype: str,
    shape: list[int],
    codec: str = "raw",
    start: int = 0,
) -> None:
    """Make tensor ``name`` one chunk of ``stored`` bytes at ``file``/``start``, with a correct
    checksum (the library's own function), whatever it was before."""
    body["tensors"][name] = {
        "dtype": dtype,
        "shape": list(shape),
        "chunks": [[file, start, len(stored), checksum(stored), [0] * len(shape), list(shape), codec]],
    }


# --------------------------------------------------------------------------- zstd


def zstd_frame(raw: bytes, *, declared: int | None = -1) -> bytes:
    """One zstd frame of ``raw``; ``declared`` sets the content size header (None: none,
    -1: the true size)."""
    c = zstandard.ZstdCompressor(level=1, write_content_size=declared is not None)
    if declared is None or declared == -1:
        return c.compress(raw)
    obj = c.compressobj(size=declared)
    return obj.compress(raw) + obj.flush()


def zstd_bomb(total: int, *, declared: bool, chunk: bytes = bytes(1 << 20)) -> bytes:
    """A frame expanding to ``total`` bytes (repeats of ``chunk``, zeros by default), built
    in pieces (low memory); ``declared``: the header states the content size."""
    c = zstandard.ZstdCompressor(level=1).compressobj(size=total if declared else -1)
    out = [c.compress(chunk) for _ in range(total // len(chunk))]
    out.append(c.compress(chunk[: total % len(chunk)]))
    out.append(c.flush())
    return b"".join(out)


def patch_creates(monkeypatch: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace both ways :class:`~ckptlib.backends.posix.PosixStorage` creates a file,
    ``open_write`` and ``open_write_in`` (the ranks' payload and piece index files, in the
    staging folder), with ``wrap(real)``: a function ``(self, path)``. A test that fails, slows
    or records the files a save writes must see both."""
    from ckptlib.backends.posix import PosixStorage

    for name in ("open_write", "open_write_in"):
        monkeypatch.setattr(PosixStorage, name, wrap(getattr(PosixStorage, name)))


def disk_full(real: Callable[..., Any]) -> Callable[..., Any]:
    """A wrap for :func:`patch_creates`: every file create fails as on a full disk (ENOSPC)."""
    import ckptlib

    def create(self: Any, path: str) -> Any:
        raise ckptlib.StorageError(28, "No space left on device")

    return create


class CountingStorage(FaultyStorage):
    """A storage that counts its requests in ``calls``, by ``key(path)`` (default: the path):
    ``size``, ``exists``, ``open_read``, ``read`` and ``listdir``, or only the ``kinds`` given.
    Thread-safe (a scan judges steps on a pool)."""

    KINDS = ("size", "exists", "open_read", "read", "listdir")

    def __init__(self, inner: Storage, key: Callable[[str], str] = lambda path: path,
                 kinds: tuple[str, ...] = KINDS) -> None:
        super().__init__(inner, [])
        self.calls: Counter[str] = Counter()
        self._key, self._kinds = key, frozenset(kinds)
        self._lock = threading.Lock()

    def _count(self, kind: str, path: str) -> None:
        if kind in self._kinds:
            with self._lock:
                self.calls[self._key(path)] += 1

    def size(self, path: str) -> int | None:
        self._count("size", path)
        return super().size(path)

    def exists(self, path: str = "") -> bool:
        self._count("exists", path)
        return super().exists(path)

    def open_read(self, path: str) -> ReadHandle:
        self._count("open_read", path)
        return super().open_read(path)

    def read(self, path: str) -> bytes:
        self._count("read", path)
        return super().read(path)

    def listdir(self, path: str = "") -> list[Entry]:
        self._count("listdir", path)
        return super().listdir(path)


def wide_step(world: int, state_of: Callable[[int, int], Any] | None = None,
              metadata: Any = None) -> dict[str, bytes]:
    """Step 1 of ``world`` ranks, saved by ckptlib's save flow on simulated ranks (one payload
    file per rank, in the save's own sub-folder): path -> bytes. ``state_of(rank, world)``: each
    rank's state (default: ``ckptlib.testing.sim_flows.state``); ``metadata``: the save's."""
    from functools import partial

    from ckptlib.engine.save import SaveOptions, persist, prepare
    from ckptlib.format import layout
    from ckptlib.testing.sim_flows import state
    from ckptlib.testing.simulation import SimCoordinator, SimStorage, World

    w = World(world, seed=1, dead_after=60.0, latency=0.0001)
    sim = SimStorage(w)
    coords = [SimCoordinator(w, r) for r in range(world)]
    flats = [prepare((state_of or state)(r, world), r) for r in range(world)]
    threads = [w.spawn(r, partial(lambda r: persist(sim, layout.step_dir(1), flats[r], step=1, metadata=metadata,
                                                    options=SaveOptions(num_files=1), coordinator=coords[r]), r))
               for r in range(world)]
    w.run(until=600)
    assert all(t.error is None for t in threads), [t.error for t in threads]
    return dict(sim.files)
