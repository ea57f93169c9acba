"""Export a subtree of a checkpoint as Hugging Face-style sharded safetensors files.

Called by ``ckptlib export --to safetensors`` (:mod:`ckptlib.cli.export`) or directly, on the
caller's thread. Tensors under ``select`` get dotted names relative to it (``/model/0.weight``
with ``select="model"`` -> ``0.weight``), so ``module.load_state_dict(load_file(...))`` works;
sharded tensors are consolidated. Files ``model-0000i-of-0000n.safetensors`` hold at most
``max_shard_bytes`` of data each (a bigger tensor gets a file of its own), beside
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``). Each file is
written in the safetensors layout (8-byte header size, JSON header, data) block by block, so
memory stays around one block. All of them are written into a staging folder beside ``out``
that replaces ``out`` only when complete (:mod:`ckptlib.read.staging`): a failed export leaves
``out`` as it was.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from typing import Any

import torch

from ckptlib.errors import UnsupportedValueError
from ckptlib.format.safetensors import INDEX_NAME, SAFETENSORS
from ckptlib.read.staging import staged
from ckptlib.read.view import CheckpointView, TensorInfo

DEFAULT_SHARD_BYTES = 5 << 30
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors(\.tmp)?$")


def owns(out: str, name: str) -> bool:
    """Whether ``out/name`` is a file an export writes (:mod:`ckptlib.read.staging`): a shard file
    ``model-0000i-of-0000n.safetensors`` (or the ``.tmp`` one an older version left), or the index."""
    path = os.path.join(out, name)
    return (name == INDEX_NAME or bool(_SHARD.match(name))) and os.path.isfile(path) and not os.path.islink(path)


def dotted(name: str, select: str | None) -> str:
    """``name`` relative to ``select`` with ``/`` -> ``.`` (the last part when they are equal),
    each part the dict key it names (the inverse of :func:`ckptlib.format.tree.escape`: ``~s0``
    -> ``0``, ``a~1b`` -> ``a/b``), as ``ckptlib.load(folder, select=...)`` maps it back."""
    top = "/" + (select or "").strip("/")
    rel = name[len(top):] if top != "/" else name
    parts = (rel.strip("/") or name.rsplit("/", 1)[-1]).split("/")
    return ".".join(_unescape(p) for p in parts)


def _unescape(part: str) -> str:
    """The dict key a tensor-name part (``format.tree.escape``) stands for, as a str."""
    if part.startswith("~s"):
        part = part[2:]
    return part.replace("~1", "/").replace("~0", "~")


def _shards(infos: list[TensorInfo], limit: int) -> list[list[TensorInfo]]:
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for info in infos:
        if shards[-1] and size + info.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(info)
        size += info.nbytes
    return shards


def _write_file(view: CheckpointView, path: str, infos: list[TensorInfo], select: str | None,
                progress: Callable[[int], None] | None) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for info in infos:
        header[dotted(info.name, select)] = {"dtype": SAFETENSORS[info.dtype], "shape": list(info.shape),
                                             "data_offsets": [at, at + info.nbytes]}
        at += info.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for info in infos:
            for _, block in view.blocks(info.name):
                f.write(block.contiguous().reshape(-1).view(torch.uint8).numpy().data)
                if progress is not None:
                    progress(block.numel() * block.element_size())


def export_safetensors(
    view: CheckpointView,
    out: str,
    select: str | None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write the tensors under ``select`` as the local folder ``out``; returns a summary. ``out``
    may be missing, empty or hold only an earlier export's files (then replaced as a whole);
    anything else there raises ``FileExistsError``, and dtypes safetensors lacks (complex32,
    complex128, float8_e8m0fnu) :class:`UnsupportedValueError`, before anything is written. An
    error while writing (a corrupt chunk) leaves ``out`` as it was."""
    infos = view.tensors(select)
    bad = [f"{i.name} ({i.dtype})" for i in infos if i.dtype not in SAFETENSORS]
    if bad:
        raise UnsupportedValueError(f"safetensors has no dtype for: {', '.join(bad[:5])}")
    names = [dotted(i.name, select) for i in infos]
    if len(set(names)) != len(names):
        raise UnsupportedValueError(f"tensor names under {select!r} collide once dotted")
    shards = _shards(infos, max_shard_bytes) if infos else []
    weight_map: dict[str, str] = {}
    total = sum(i.nbytes for i in infos)
    with staged(out, owns, "safetensors") as folder:
        for k, part in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_file(view, os.path.join(folder, file), part, select, progress)
            weight_map.update({dotted(i.name, select): file for i in part})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(folder, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
    return {"format": "safetensors", "out": out, "step": view.step, "tensors": len(infos), "bytes": total,
            "files": sorted(set(weight_map.values())), "index": INDEX_NAME}
