"""DCP ``Metadata`` <-> JSON (the manifest's ``extra["dcp"]``), without pickle.

Called by :class:`~ckptlib.integrations.dcp.writer.CkptlibWriter` (``finish``, coordinator:
:func:`metadata_to_json`) and :class:`~ckptlib.integrations.dcp.reader.CkptlibReader`
(``read_metadata``, every rank: :func:`metadata_from_json`, which checks untrusted JSON with
:class:`ckptlib.format.validate.Checker` against the already validated manifest).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptlib.errors import UnsupportedValueError
from ckptlib.format import manifest as mf
from ckptlib.format import tree as tree_codec
from ckptlib.format.dtypes import DTYPES, NAMES
from ckptlib.format.validate import Checker
from ckptlib.plan.flatten import INLINE_BYTES, flatten

EXTRA_KEY = "dcp"
"""The manifest's ``extra`` key holding DCP's metadata."""
JSON_SCHEMA = 1
KINDS = ("tensor", "json", "pickle", "bytes")
"""How an item is stored (see :class:`StoredItem`)."""
_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_LAYOUT_NAMES = {v: k for k, v in _LAYOUTS.items()}
_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}
_MEMORY_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}
DCP_VERSION: str = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", "1.0.0")  # older torch: none


@dataclass(frozen=True, slots=True)
class StoredItem:
    """``WriteResult.storage_data`` and ``Metadata.storage_data`` values: where an item lives.

    ``kind`` is ``tensor`` (a box of ``manifest.tensors[fqn]``), ``json`` (a plain value in
    the manifest's tree, ``node`` while saving), ``pickle`` (``torch.save`` bytes stored
    as the 1-D uint8 tensor ``manifest.tensors[fqn]``) or ``bytes`` (a ``bytes`` or
    ``io.BytesIO`` value too large to inline, its own bytes stored as that tensor, no pickle;
    ``node`` is its bytes node while saving).
    """

    kind: str
    node: Any = None


def raw_bytes(value: Any) -> bytes | None:
    """The bytes of a ``bytes``/``io.BytesIO`` value too large to inline in the manifest
    (stored as a payload tensor of kind ``bytes``, without pickle), else None."""
    if isinstance(value, io.BytesIO):
        value = value.getvalue()
    if isinstance(value, bytes | bytearray | memoryview) and len(value) > INLINE_BYTES:
        return bytes(value)
    return None


def plain_node(value: Any) -> Any:
    """The manifest-tree node of ``value`` if it is a plain value (no tensors, no objects),
    else ``NOT_PLAIN``. Inline bytes longer than the tree decoder accepts
    (``format.tree.MAX_INLINE_B64``) make a value ``NOT_PLAIN``: a checkpoint no reader could
    load is never written (a large top-level bytes value is :func:`raw_bytes`'s)."""
    try:
        flat = flatten(value, inline_bytes=True)
    except (UnsupportedValueError, TypeError, ValueError, RecursionError):
        return NOT_PLAIN
    if flat.items or not _only_plain(flat.tree):
        return NOT_PLAIN
    return flat.tree


NOT_PLAIN = object()


def _only_plain(node: Any) -> bool:
    if node is None or isinstance(node, bool | int | float | str):
        return True
    if not isinstance(node, dict):
        return False
    kind = node.get("t")
    if kind in ("float", "dtype"):
        return True
    if kind == "bytes":
        return isinstance(node.get("b64"), str) and len(node["b64"]) <= tree_codec.MAX_INLINE_B64
    if kind == "dict":
        return all(_only_plain(v) for _, v in node["items"])
    if kind in ("list", "tuple"):
        return all(_only_plain(v) for v in node["items"])
    return False  # tensors, stateful objects, per-rank values


def metadata_to_json(md: Metadata, stored: dict[MetadataIndex, StoredItem]) -> dict[str, Any]:
    """DCP's ``Metadata`` as JSON (``manifest.extra["dcp"]``). Raises ``UnsupportedValueError``
    for anything that has no exact JSON form (an unknown dtype or layout, custom planner data)."""
    sdm: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            sdm[fqn] = {"kind": "bytes"}
            continue
        if not isinstance(m, TensorStorageMetadata):
            raise UnsupportedValueError(f"{fqn}: unknown DCP storage metadata {type(m).__name__}")
        p = m.properties
        if p.dtype not in NAMES or p.layout not in _LAYOUT_NAMES or p.memory_format not in _MEMORY_FORMAT_NAMES:
            raise UnsupportedValueError(f"{fqn}: dtype {p.dtype} / layout {p.layout} cannot be stored")
        sdm[fqn] = {
            "kind": "tensor",
            "dtype": NAMES[p.dtype],
            "layout": _LAYOUT_NAMES[p.layout],
            "requires_grad": bool(p.requires_grad),
            "memory_format": _MEMORY_FORMAT_NAMES[p.memory_format],
            "pin_memory": bool(p.pin_memory),
            "size": [int(s) for s in m.size],
            "chunks": [[[int(o) for o in c.offsets], [int(s) for s in c.sizes]] for c in m.chunks],
        }
    planner = None
    if md.planner_data is not None:
        planner = plain_node(md.planner_data)
        if planner is NOT_PLAIN:
            raise UnsupportedValueError(
                f"the save planner's planner_data ({type(md.planner_data).__name__}) has no JSON form; "
                "ckptlib does not pickle metadata"
            )
    sm = md.storage_meta
    storage_meta = None
    if sm is not None:
        storage_meta = {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": [str(x) for x in sm.modules],
        }
    return {
        "schema": JSON_SCHEMA,
        "version": md.version,
        "state_dict_metadata": sdm,
        "storage_data": [
            [idx.fqn, None if idx.offset is None else [int(o) for o in idx.offset], s.kind] for idx, s in stored.items()
        ],
        "planner_data": planner,
        "storage_meta": storage_meta,
    }


def metadata_from_json(obj: Any, m: mf.Manifest, where: str = "") -> tuple[Metadata, dict[str, Any]]:
    """Rebuild DCP's ``Metadata`` from ``manifest.extra["dcp"]`` (untrusted input, no pickle).

    Returns ``(metadata, values)``, ``values`` being the decoded plain values of ``json`` items.
    Everything is checked against the manifest (which ckptlib validated): tensors exist with
    the recorded dtype and size, chunk boxes lie inside them, references resolve.
    """
    c = Checker(where, "DCP metadata: ")
    obj = c.typed(obj, dict, "extra.dcp")
    if obj.get("schema") != JSON_SCHEMA:
        raise c.fail(f"unknown schema {obj.get('schema')!r:.40}")
    sdm: dict[str, Any] = {}
    for fqn, e in c.typed(obj.get("state_dict_metadata"), dict, "state_dict_metadata").items():
        e = c.typed(e, dict, f"entry {fqn!r:.200}")
        kind = e.get("kind")
        if kind == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            continue
        if kind != "tensor":
            raise c.fail(f"{fqn!r:.200}: unknown kind {kind!r:.40}")
        if (
            e.get("dtype") not in DTYPES
            or e.get("layout") not in _LAYOUTS
            or e.get("memory_format") not in _MEMORY_FORMATS
        ):
            raise c.fail(f"{fqn!r:.200}: dtype, layout or memory_format not allowed")
        size = c.ints(e.get("size"), f"{fqn!r:.200} size")
        t = m.tensors.get(fqn)
        if t is None or t.dtype != e["dtype"] or list(t.shape) != size:
            raise c.fail(f"{fqn!r:.200} does not match the manifest's tensor (missing, dtype or shape)")
        chunks = []
        for ch in c.typed(e.get("chunks"), list, f"{fqn!r:.200} chunks"):
            if type(ch) is not list or len(ch) != 2:
                raise c.fail(f"{fqn!r:.200}: chunk must be [offsets, sizes]")
            off, sz = c.ints(ch[0], "chunk offsets"), c.ints(ch[1], "chunk sizes")
            if (
                len(off) != len(size)
                or len(sz) != len(size)
                or any(o + s > n for o, s, n in zip(off, sz, size, strict=True))
            ):
                raise c.fail(f"{fqn!r:.200}: chunk {off}+{sz} lies outside the tensor {size}")
            chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(sz)))
        props = TensorProperties(
            dtype=DTYPES[e["dtype"]],
            layout=_LAYOUTS[e["layout"]],
            requires_grad=c.typed(e.get("requires_grad"), bool, "requires_grad"),
            memory_format=_MEMORY_FORMATS[e["memory_format"]],
            pin_memory=c.typed(e.get("pin_memory"), bool, "pin_memory"),
        )
        sdm[fqn] = TensorStorageMetadata(props, torch.Size(size), chunks)

    tree = tree_codec.decode(m.tree, m.tensors, where)
    if not isinstance(tree, dict):
        raise c.fail("the manifest's tree must be a dict of DCP keys")
    stored: dict[MetadataIndex, StoredItem] = {}
    values: dict[str, Any] = {}
    for ent in c.typed(obj.get("storage_data"), list, "storage_data"):
        if type(ent) is not list or len(ent) != 3 or not isinstance(ent[0], str) or ent[2] not in KINDS:
            raise c.fail("storage_data entry must be [fqn, offset|null, kind]")
        fqn, off, kind = ent
        if fqn not in sdm:
            raise c.fail(f"storage_data names {fqn!r:.200}, which the state_dict_metadata lacks")
        if kind == "tensor":
            if not isinstance(sdm[fqn], TensorStorageMetadata):
                raise c.fail(f"{fqn!r:.200}: tensor storage for a non-tensor entry")
            off = c.ints(off, "storage offset")
        elif isinstance(sdm[fqn], TensorStorageMetadata) or off is not None:
            raise c.fail(f"{fqn!r:.200}: bytes storage for a tensor entry")
        node = tree.get(fqn, NOT_PLAIN)
        if kind == "tensor" and not isinstance(node, tree_codec.TensorRef):
            raise c.fail(f"{fqn!r:.200}: the tree does not reference its tensor")
        if kind in ("pickle", "bytes"):
            t = m.tensors.get(fqn)
            if not isinstance(node, tree_codec.BytesRef) or t is None or t.dtype != "uint8" or len(t.shape) != 1:
                raise c.fail(f"{fqn!r:.200}: {kind} must be a 1-D uint8 tensor referenced from the tree")
            if kind == "bytes":
                values[fqn] = node
        if kind == "json":
            if node is NOT_PLAIN or _has_refs(node):
                raise c.fail(f"{fqn!r:.200}: no plain value in the tree")
            values[fqn] = node
        stored[MetadataIndex(fqn, off)] = StoredItem(kind)

    planner_data = obj.get("planner_data")
    if planner_data is not None:
        planner_data = tree_codec.decode(planner_data, (), where)
    sm = obj.get("storage_meta")
    storage_meta = None
    if sm is not None:
        sm = c.typed(sm, dict, "storage_meta")
        cid, sid, mods = sm.get("checkpoint_id"), sm.get("save_id"), sm.get("modules", [])
        if not (cid is None or isinstance(cid, str)) or not (sid is None or isinstance(sid, str)):
            raise c.fail("storage_meta ids must be strings")
        if type(mods) is not list or not all(isinstance(x, str) for x in mods):
            raise c.fail("storage_meta modules must be strings")
        storage_meta = StorageMeta(checkpoint_id=cid, save_id=sid, modules=list(mods))
    version = obj.get("version")
    if version is not None and not isinstance(version, str):
        raise c.fail("version must be a string")
    md = Metadata(
        state_dict_metadata=sdm,
        planner_data=planner_data,
        storage_data=stored,
        storage_meta=storage_meta,
        version=version,
    )
    return md, values


def _has_refs(v: Any) -> bool:
    if isinstance(
        v,
        tree_codec.TensorRef | tree_codec.BytesRef | tree_codec.PerRankSaved | tree_codec.Stateful,
    ):
        return True
    if isinstance(v, dict):
        return any(_has_refs(x) for x in v.values())
    if isinstance(v, list | tuple):
        return any(_has_refs(x) for x in v)
    return False
