"""The ``packed_tensors`` table: one row per tensor stored whole in a pack. Pure.

Columnar, because a checkpoint may hold tens of thousands of small tensors. Who calls what:
:class:`PackedTable` is filled by the body builders (:mod:`ckptlib.format.build`);
:func:`decode_table` and :func:`check_members` are called by manifest decoding
(:mod:`ckptlib.format.decode`), which validates whole columns at once with numpy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ckptlib.format.dtypes import ITEMSIZE
from ckptlib.format.schema import Pack, Piece, TensorEntry
from ckptlib.format.validate import MAX_NAME, MAX_NDIM, MAX_SIZE, Checker

TABLE_KEY = "packed_tensors"
TABLE_COLUMNS = ("name", "dtype", "ndim", "dims", "pack", "offset")


@dataclass(slots=True)
class PackedTable:
    """The table being built (see the module docstring); ``json()`` gives the manifest value."""

    rows: list[tuple[str, str, tuple[int, ...], int, int]] = field(default_factory=list)
    """``(name, dtype, shape, pack index, raw offset)`` per row, appended by the caller."""

    def json(self) -> dict[str, list[Any]]:
        if not self.rows:
            return {k: [] for k in TABLE_COLUMNS}
        name, dtype, shape, pack, offset = zip(*self.rows, strict=True)
        return {
            "name": list(name),
            "dtype": list(dtype),
            "ndim": list(map(len, shape)),
            "dims": list(itertools.chain.from_iterable(shape)),
            "pack": list(pack),
            "offset": list(offset),
        }


class Table(NamedTuple):
    """The decoded packed-tensor table: entries plus member extents for the overlap check."""

    entries: list[tuple[str, TensorEntry]]
    pack: np.ndarray
    start: np.ndarray
    end: np.ndarray


NO_TABLE = Table([], np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
_ZEROS = [(0,) * n for n in range(MAX_NDIM + 1)]
_LOG2_LIMIT = 62.5  # log2 of a row's byte size; above it the exact product could overflow int64


def _int_column(col: Any, what: str, lo: int, hi: int, v: Checker) -> np.ndarray:
    if type(col) is not list or not set(map(type, col)) <= {int}:  # bool is not int here
        raise v.fail(f"{what} must be a list of integers")
    try:
        arr = np.array(col, dtype=np.int64)
    except OverflowError:
        raise v.fail(f"{what} holds an integer outside [{lo}, {hi}]") from None
    if arr.size and (arr.min() < lo or arr.max() > hi):
        raise v.fail(f"{what} holds an integer outside [{lo}, {hi}]")
    return arr


def decode_table(raw: Any, packs: list[Pack], v: Checker) -> Table:
    """Validate the ``packed_tensors`` table column by column (numpy), then build entries.

    Rows are tensors stored whole in one pack, never empty (zero-size tensors are stored as
    chunks), so every dimension is at least 1 and a row's bytes ``prod(dims) * itemsize`` must
    fit inside its pack after ``offset``.
    """
    t = v.obj(raw, TABLE_KEY)
    if set(t) != set(TABLE_COLUMNS):
        raise v.fail(f"{TABLE_KEY} must have exactly the columns {list(TABLE_COLUMNS)}")
    names, dtypes = t["name"], t["dtype"]
    if type(names) is not list or not set(map(type, names)) <= {str} or any(len(n) > MAX_NAME for n in names):
        raise v.fail(f"{TABLE_KEY}.name must be a list of strings of at most {MAX_NAME} characters")
    if type(dtypes) is not list or not set(map(type, dtypes)) <= {str} or not set(dtypes) <= ITEMSIZE.keys():
        bad = next((d for d in dtypes if type(d) is not str or d not in ITEMSIZE), None) if type(dtypes) is list else dtypes
        raise v.unknown(f"{TABLE_KEY}.dtype: {bad!r:.60} is not in the dtype allowlist", bad)
    n = len(names)
    ndim = _int_column(t["ndim"], f"{TABLE_KEY}.ndim", 0, MAX_NDIM, v)
    dims = _int_column(t["dims"], f"{TABLE_KEY}.dims", 1, MAX_SIZE, v)
    pack = _int_column(t["pack"], f"{TABLE_KEY}.pack", 0, len(packs) - 1, v)
    offset = _int_column(t["offset"], f"{TABLE_KEY}.offset", 0, MAX_SIZE, v)
    if not len(dtypes) == len(ndim) == len(pack) == len(offset) == n:
        raise v.fail(f"{TABLE_KEY}: columns have different lengths")
    if len(set(names)) != n:
        raise v.fail(f"{TABLE_KEY}: a tensor name is listed twice")
    if int(ndim.sum()) != len(dims):
        raise v.fail(f"{TABLE_KEY}: dims holds {len(dims)} values, ndim adds up to {int(ndim.sum())}")
    if not n:
        return NO_TABLE
    itemsize = np.array([ITEMSIZE[d] for d in dtypes], dtype=np.int64)
    first = np.zeros(n, dtype=np.int64)
    np.cumsum(ndim[:-1], out=first[1:])
    logs = np.concatenate(([0.0], np.cumsum(np.log2(dims.astype(np.float64)))))
    log_bytes = logs[first + ndim] - logs[first] + np.log2(itemsize.astype(np.float64))
    if log_bytes.max() > _LOG2_LIMIT:
        raise v.fail(f"{TABLE_KEY}: tensor {names[int(log_bytes.argmax())]!r:.200} declares more than 2^62 bytes")
    numel = np.multiply.reduceat(np.append(dims, 1), first)
    numel[ndim == 0] = 1  # reduceat yields the next value for an empty (scalar) row
    nbytes = numel * itemsize
    room = np.array([p.raw_length for p in packs], dtype=np.int64)[pack] - offset
    bad = np.flatnonzero(nbytes > room)  # room < 0 too: offset past the pack's end
    if bad.size:
        i = int(bad[0])
        raise v.fail(f"{TABLE_KEY}: tensor {names[i]!r:.200} ends past the end of pack {int(pack[i])}")
    entries = []
    dims_list, pos = t["dims"], 0
    for name, dt, nd, p, off in zip(names, dtypes, t["ndim"], t["pack"], t["offset"], strict=True):
        shape = tuple(dims_list[pos : pos + nd])
        pos += nd
        entries.append((name, TensorEntry(dt, shape, [], [Piece(p, off, _ZEROS[nd], shape)])))
    return Table(entries, pack, offset, offset + nbytes)


def check_members(members: list[tuple[int, int, int, str]], table: Table, v: Checker) -> None:
    """No two pieces of a pack may share bytes (all pieces: table rows and ``packed`` lists)."""
    pack, start, end = table.pack, table.start, table.end
    if members:
        pack = np.concatenate((pack, np.array([m[0] for m in members], dtype=np.int64)))
        start = np.concatenate((start, np.array([m[1] for m in members], dtype=np.int64)))
        end = np.concatenate((end, np.array([m[2] for m in members], dtype=np.int64)))
    if len(pack) < 2:
        return
    order = np.lexsort((start, pack))
    p, s, e = pack[order], start[order], end[order]
    clash = np.flatnonzero((p[1:] == p[:-1]) & (s[1:] < e[:-1]))
    if clash.size:
        i = int(clash[0])
        names = [n for n, _ in table.entries] + [m[3] for m in members]
        a, b = names[int(order[i])], names[int(order[i + 1])]
        raise v.fail(f"pack {int(p[i])}: members {a!r:.200} and {b!r:.200} overlap")
