"""The load strategies: read a ckptlib Megatron checkpoint into a sharded state dict.

Called by ``dist_checkpointing.load`` on the training thread of every rank:
:meth:`LoadStrategy.load` reads only the boxes this rank asks for (resharding by global
offsets, checksums verified); :meth:`LoadCommonStrategy.load_common` reads ``common.pt``
after checking it against the manifest. :func:`register` makes them Megatron's defaults.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
)
from megatron.core.dist_checkpointing.strategies import base as mbase

from ckptlib.backends import Storage, open_storage
from ckptlib.coord.coordinator import default_coordinator
from ckptlib.engine.load import Merge, resolve_lazy, run_plan
from ckptlib.engine.scan import check_files_together, read_manifest
from ckptlib.errors import CorruptCheckpointError, StateMismatchError, UnsupportedValueError
from ckptlib.format import tree as tree_codec
from ckptlib.format.dtypes import DTYPES
from ckptlib.format.leaves import Shard
from ckptlib.format.manifest import Manifest
from ckptlib.format.validate import MAX_SIZE
from ckptlib.integrations.megatron.layout import (
    BACKEND,
    COMMON,
    FOLDER,
    VERSION,
    check_common,
    metadata,
    piece,
    read_small,
)
from ckptlib.integrations.megatron.save import SaveStrategy


class LoadStrategy(mbase.LoadShardedStrategy):
    """Sharded load strategy for checkpoints written by :class:`SaveStrategy`.

    ``load`` reads, for every ShardedTensor of this rank (main replica or not), exactly the
    box it covers, whatever sharding the checkpoint was saved with; checksums are verified
    (``verify=True``), a mismatch raises :class:`CorruptCheckpointError`.

    Before any rank reads, the coordinator (rank 0 of the default process group) checks every
    payload file's size and every rank gets its verdict, the same error on every rank or none
    (:func:`~ckptlib.engine.scan.check_files_together`, one coordination session of at most
    ``timeout`` seconds): ``dist_checkpointing.load`` runs on every rank, so this load is
    collective already. A load of N ranks makes N size requests, not N². ``judged=True`` skips
    the check and its meeting (each rank's reader still checks the size of every file it opens);
    only for a caller whose coordinator has just judged the iteration, sizes included, and which
    moves every rank on together when any rank fails
    (:func:`~ckptlib.integrations.megatron.load_latest`).
    """

    def __init__(self, *, verify: bool = True, threads: int = 4, judged: bool = False,
                 timeout: float = 600.0) -> None:
        self.verify = verify
        self.threads = threads
        self.judged = judged
        self.timeout = timeout

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(
                f"checkpoint backend {loaded_backend!r} is not {BACKEND!r}"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(
                f"checkpoint backend version {loaded_version} is not {VERSION}"
            )

    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path
    ) -> ShardedStateDict:
        checkpoint_dir = os.fspath(checkpoint_dir)
        storage, m, saved, where = _open(checkpoint_dir)
        if not self.judged:
            check_files_together(default_coordinator(), storage, FOLDER, m, label="megatron load",
                                 timeout=self.timeout)
        objects = _objects(saved)
        plan = Merge(m, where=where)

        def one(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                ref = saved["tensors"].get(x.key)
                if not isinstance(ref, tree_codec.TensorRef):
                    raise StateMismatchError(
                        f"tensor {x.key!r} is not in the checkpoint {checkpoint_dir}"
                    )
                if x.data is None:
                    x.init_data("cpu")
                t = piece(x)
                e = m.tensors[ref.name]
                if tuple(x.global_shape) != tuple(e.shape) and not x.allow_shape_mismatch:
                    raise StateMismatchError(
                        f"{x.key}: checkpoint shape {list(e.shape)}, requested global shape {list(x.global_shape)}"
                    )
                plan.tensor(Shard(t, tuple(e.shape), tuple(x.global_offset)), ref.name, x.key)
                return x.data
            if isinstance(x, ShardedObject):
                if x.unique_key not in objects:
                    raise StateMismatchError(
                        f"object {x.unique_key!r} is not in the checkpoint {checkpoint_dir}"
                    )
                return _Holder(plan.fresh(objects[x.unique_key]))
            return x

        out = dict_list_map_outplace(one, sharded_state_dict)
        run_plan(plan, storage, FOLDER, m, verify=self.verify, threads=self.threads)
        return dict_list_map_outplace(lambda x: resolve_lazy(x.value) if isinstance(x, _Holder) else x, out)

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, ShardedTensor]:
        _, m, saved, _ = _open(os.fspath(checkpoint_dir))
        out = {}
        for key, ref in saved["tensors"].items():
            e = m.tensors[ref.name]
            out[key] = ShardedTensor.from_rank_offsets(
                key, torch.empty(e.shape, dtype=DTYPES[e.dtype], device="meta")
            )
            out[key].data = None
        return out

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.load_tensors_metadata(checkpoint_dir))
        _, _, saved, _ = _open(os.fspath(checkpoint_dir))
        out.update((k, ShardedObject.empty_from_unique_key(k)) for k in _objects(saved))
        return out


def _open(checkpoint_dir: str) -> tuple[Storage, Manifest, dict[str, Any], str]:
    """Storage, manifest, decoded tree and manifest path of a Megatron checkpoint's ckptlib part."""
    storage = open_storage(checkpoint_dir)
    m = read_manifest(storage, FOLDER, pieces=False)  # v2: run_plan loads the index files a load needs
    where = os.path.join(checkpoint_dir, FOLDER, "manifest.json")
    saved = tree_codec.decode(m.tree, m.tensors, where)
    if not isinstance(saved, dict) or not isinstance(saved.get("tensors"), dict):
        raise CorruptCheckpointError("not a Megatron checkpoint written by ckptlib", where)
    return storage, m, saved, where


def _objects(saved: dict[str, Any]) -> dict[str, Any]:
    """ShardedObject values by unique key."""
    objects: dict[str, Any] = {}
    node = saved.get("objects")
    for per in node.values if isinstance(node, tree_codec.PerRankSaved) else []:
        if isinstance(per, dict):
            for k, v in per.items():
                objects.setdefault(k, v)
    return objects


@dataclass
class _Holder:
    value: Any


class LoadCommonStrategy(mbase.LoadCommonStrategy):
    """Reads Megatron's ``common.pt`` after checking it against the checksum in our manifest,
    with ``torch.load(weights_only=True)`` (torch's restricted loader: tensors and plain
    containers only, no arbitrary objects). ShardedObjects are handled by :class:`LoadStrategy`."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        pass

    def check_version_compatibility(self, loaded_version: int) -> None:
        pass

    def load_common(self, checkpoint_dir: str | Path) -> Any:
        checkpoint_dir = os.fspath(checkpoint_dir)
        path = os.path.join(checkpoint_dir, COMMON)
        try:  # the bytes checked are the bytes loaded; a FIFO or symlink in its place is refused
            data = check_common(checkpoint_dir, metadata(checkpoint_dir))
            if data is None:  # saved without a record: a regular file, read whole
                data = read_small(checkpoint_dir, COMMON, MAX_SIZE)
        except FileNotFoundError:
            raise CheckpointingException(f"{path} does not exist") from None
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # the restricted unpickler refused a type
            raise UnsupportedValueError(
                f"{path}: common state holds a value torch.load(weights_only=True) refuses ({e}); "
                "keep common state to tensors and plain values, or move it into a ShardedObject"
            ) from e

    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | Path
    ) -> Any:
        raise CheckpointingException("ShardedObjects are loaded by ckptlib's LoadStrategy")

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        return {}


def register() -> bool:
    """Make ``"ckptlib"`` checkpoints loadable by plain ``dist_checkpointing.load`` (no
    strategy arguments) on releases that keep a strategy registry (0.16 and older). Returns
    False, doing nothing, on releases without it: pass strategy instances explicitly there."""
    reg = getattr(mbase, "register_default_strategy", None)
    action = getattr(mbase, "StrategyAction", None)
    if reg is None or action is None:
        return False
    reg(action.SAVE_SHARDED, BACKEND, VERSION, SaveStrategy())
    reg(action.LOAD_SHARDED, BACKEND, VERSION, LoadStrategy())
    return True
