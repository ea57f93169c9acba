"""Loading format v2 piece index files into a manifest: all of them, or only those a read needs.

Called on the caller's thread by :func:`ckptlib.engine.scan.read_manifest` (``pieces=True``:
every index file, for tools that walk every chunk: inspect, views, integrations), by
:func:`ckptlib.engine.scan.check_step` (``deep=True`` only: the status scan reads no index file,
it checks their sizes; the manifest's decode checked that every holder of a piece has one) and by
:func:`ckptlib.engine.load.run_plan` (only the index files whose ranks hold boxes overlapping the
read requests, found from each tensor's sharding in time proportional to the cells a request
overlaps). Each index file is read once per manifest (``Manifest.loaded``), its size and
checksum checked against the manifest before it is parsed, then validated and merged by
``format.sharding.check_index``. Bad input raises :class:`CorruptCheckpointError` naming the
index file.
"""

from __future__ import annotations

from collections.abc import Iterable

from ckptlib.backends import Storage, join
from ckptlib.engine.gc_pause import paused_gc
from ckptlib.engine.scan import missing_file
from ckptlib.errors import CorruptCheckpointError
from ckptlib.format.checksum import checksum
from ckptlib.format.dtypes import ITEMSIZE
from ckptlib.format.index_file import decode_index
from ckptlib.format.schema import IndexRef, Manifest
from ckptlib.format.sharding import Sharding, check_index
from ckptlib.format.validate import Checker

Want = tuple[str, tuple[int, ...], tuple[int, ...]]
"""A box of a tensor a reader needs: ``(name, offset, shape)``."""


def resolve(storage: Storage, folder: str, m: Manifest, wants: Iterable[Want] | None = None) -> int:
    """Load into ``m`` the index files that hold pieces overlapping ``wants`` (None: every
    index file, and every tensor checked to be covered). Returns how many files were read."""
    if m.version < 2 or m.complete:
        return 0
    by_rank = {ix.rank: i for i, ix in enumerate(m.indexes)}
    where = f"{storage.url.rstrip('/')}/{join(folder, 'manifest.json')}"
    need: set[int] = set()
    if wants is None:  # (every tensor's holders have an index row: checked by the manifest's decode)
        need = set(range(len(m.indexes)))
    else:
        for name, offset, shape in wants:
            for r in m.sharding[name].ranks_for(offset, shape):
                i = by_rank.get(r)
                if i is None:
                    raise CorruptCheckpointError(
                        f"tensor {name!r:.200} is held by rank {r}, which has no index file", where
                    )
                need.add(i)
    return load_indexes(storage, folder, m, need)


def load_indexes(storage: Storage, folder: str, m: Manifest, which: Iterable[int]) -> int:
    """Load into ``m`` the index files at positions ``which`` of ``m.indexes`` (those not loaded
    yet; each checked for size, checksum and content) and return how many were read. :func:`resolve`
    calls it with the files a box needs; callers that know which ranks' pieces they
    need by rank, not by box: the tiers verifying a node's copies of a rank's files
    (ckptlib/tiers/restore.py, drain.py). Raises :class:`CorruptCheckpointError` naming the file."""
    need = set(which) - m.loaded
    if not need:
        return 0
    tensors = {n: (e.dtype, e.shape, m.sharding[n]) for n, e in m.tensors.items()}
    with paused_gc():
        for i in sorted(need):
            _load_one(storage, folder, m, i, tensors)
    return len(need)


def _load_one(storage: Storage, folder: str, m: Manifest, i: int,
              tensors: dict[str, tuple[str, tuple[int, ...], Sharding]]) -> None:
    ix: IndexRef = m.indexes[i]
    path = join(folder, ix.path)
    holder = ix.file_entry(m.files)  # the index at the tail of the rank's last payload file
    size = ix.size if holder is None else holder.size
    what = "index file" if holder is None else "payload file holding the index"
    where = f"{storage.url.rstrip('/')}/{path}"
    try:
        with storage.open_read(path) as h:
            if h.size != size:
                raise CorruptCheckpointError(f"{what} size is {h.size} bytes, manifest records {size}", where)
            data = h.read(size - ix.size, ix.size)
    except FileNotFoundError:
        raise missing_file(storage, folder, m, ix.path, what) from None
    if len(data) != ix.size:
        raise CorruptCheckpointError(f"short read: {len(data)} of {ix.size} bytes", where)
    if checksum(data) != ix.checksum:
        what = "index file" if holder is None else f"index (the last {ix.size} bytes of the payload file)"
        raise CorruptCheckpointError(f"{what} checksum mismatch (modified or damaged)", where)
    v = Checker(where)
    files = m.files[ix.first_file : ix.first_file + ix.num_files]
    sizes = [f.size for f in files]
    if holder is not None:  # no piece may lie in the index's bytes
        sizes[-1] -= ix.size
    table = decode_index(data, ix.counts, len(files), sizes, m.checksum_algorithm, v)
    got = check_index(table, ix.rank, ix.first_file, len(m.packs), tensors, ITEMSIZE, m.checksum_algorithm, v)
    m.packs.extend(got.packs)
    for name, chunks in got.chunks.items():
        m.tensors[name].chunks.extend(chunks)
    for name, pieces in got.pieces.items():
        m.tensors[name].pieces.extend(pieces)
    m.loaded.add(i)
