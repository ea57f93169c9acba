"""Megatron-Core ``dist_checkpointing`` strategies that store ShardedTensors in ckptlib's format.

Importing this module imports ``megatron.core`` (``import ckptlib`` never does). Usage::

    from megatron.core import dist_checkpointing as dcp
    from ckptlib.integrations import megatron as ck

    dcp.save(sharded_sd, ckpt_dir, sharded_strategy=ck.SaveStrategy())          # every rank
    req = dcp.save(sharded_sd, ckpt_dir, sharded_strategy=ck.SaveStrategy(),
                   async_sharded_save=True)                                      # AsyncRequest
    state = dcp.load(sharded_sd, ckpt_dir, sharded_strategy=ck.LoadStrategy(),
                     common_strategy=ck.LoadCommonStrategy())
    it, state = ck.load_latest(sharded_sd, save_dir)   # newest consistent iter_NNNNNNN

Who calls what (all on the training thread, every rank, same order):

- :class:`SaveStrategy` ``save``/``async_save`` are called by ``dist_checkpointing.save`` after
  Megatron wrote ``common.pt`` (rank 0). ``async_save`` gathers the tensor keys of all ranks
  (one collective), copies this rank's main-replica pieces to CPU and returns an
  ``AsyncRequest`` whose ``async_fn`` writes payloads and runs ckptlib's two-phase commit;
  run it with :func:`schedule` (a thread) or ``request.execute_sync()``. Megatron then
  appends its own finalize step that writes ``metadata.json``.
- :class:`LoadStrategy` ``load`` is called by ``dist_checkpointing.load``; it reads only the
  boxes this rank asks for (resharding by global offsets) and verifies every checksum.
- :func:`latest_iteration` / :func:`load_latest` replace ``latest_checkpointed_iteration.txt``.

Layout of one Megatron checkpoint directory (e.g. ``save_dir/iter_0000100``)::

    common.pt        written by Megatron (torch.save, rank 0); its xxh3 and size are
                     recorded in our manifest and checked before it is read
    ckptlib/         one ckptlib checkpoint (manifest.json + payloads), committed atomically
    metadata.json    written by Megatron last: {"sharded_backend": "ckptlib", ...}

Mapping: a ShardedTensor becomes one piece ``(key, global_offset, local box)`` of the global
tensor ``key``; pieces whose ``replica_id`` is not main are not written; ``prepend_axis_num``
axes are added as size-1 axes. ShardedObjects (main replicas) are stored in a per-rank node,
found again by ``unique_key`` on load whatever the world size; their values must be
JSON-typed (None, bool, int, float, str, bytes, list, tuple, dict with str/int keys) and may
contain tensors. Anything else raises :class:`ckptlib.errors.UnsupportedValueError` before
any I/O. Nothing is unpickled on load except Megatron's own ``common.pt``, which is read with
``torch.load(weights_only=True)`` after its checksum matched.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies import base as _mbase
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

from ckptlib.backends import open_storage
from ckptlib.coord.coordinator import Coordinator, default_coordinator
from ckptlib.engine import save as save_flow
from ckptlib.engine.load import Merge, resolve_lazy, run_plan
from ckptlib.engine.scan import check_files, check_step, read_manifest
from ckptlib.errors import (
    CheckpointError,
    CommitError,
    CorruptCheckpointError,
    StateMismatchError,
    UnsupportedValueError,
)
from ckptlib.format import tree as tree_codec
from ckptlib.format.checksum import checksum
from ckptlib.format.dtypes import DTYPES, dtype_name
from ckptlib.format.leaves import PerRank, Shard
from ckptlib.plan.flatten import FlatState, TensorItem, escape, flatten

BACKEND = "ckptlib"
VERSION = 1
FOLDER = "ckptlib"
"""Sub-folder of a Megatron checkpoint directory that holds the ckptlib checkpoint."""
COMMON = "common.pt"
ITER_RE = re.compile(r"^iter_(\d{7,})$")
log = logging.getLogger("ckptlib")

__all__ = [
    "BACKEND",
    "IterationInfo",
    "LoadCommonStrategy",
    "LoadStrategy",
    "SaveStrategy",
    "iteration_dir",
    "iterations",
    "latest_iteration",
    "load_latest",
    "register",
    "schedule",
]


# ---------------------------------------------------------------------------------------------
# save


def _leaves(sd: Any) -> list[Any]:
    out: list[Any] = []
    stack = [sd]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        elif isinstance(x, list | tuple):
            stack.extend(reversed(x))
        else:
            out.append(x)
    return out


def _piece(st: ShardedTensor) -> torch.Tensor:
    """The local data viewed with the global tensor's rank (prepended axes as size 1)."""
    if st.flattened_range is not None:
        raise UnsupportedValueError(
            f"ShardedTensor {st.key!r} has a flattened_range; ckptlib stores boxes only "
            "(Megatron-Core 0.16 rejects flattened ranges too): save the unflattened tensor"
        )
    if st.data is None:
        raise UnsupportedValueError(f"ShardedTensor {st.key!r} has no data")
    t = st.data
    for _ in range(st.prepend_axis_num):
        t = t.unsqueeze(0)
    if tuple(t.shape) != (1,) * st.prepend_axis_num + tuple(st.local_shape):
        raise UnsupportedValueError(
            f"ShardedTensor {st.key!r}: data shape {list(st.data.shape)} != local_shape"
        )
    return t


def _tensor_name(key: str) -> str:
    return f"/tensors/{escape(key)}"


def _build(
    sd: ShardedStateDict, coord: Coordinator, timeout: float, copy: bool
) -> tuple[FlatState, list[str]]:
    """FlatState for this rank: identical tree on every rank (union of keys), own pieces only.

    Collective (one gather + one agree on ckptlib's group).
    """
    pieces: list[tuple[ShardedTensor, torch.Tensor]] = []
    objects: dict[str, Any] = {}
    keys: dict[str, tuple[str, tuple[int, ...]]] = {}
    for leaf in _leaves(sd):
        if isinstance(leaf, ShardedTensor):
            t = _piece(leaf)
            keys[leaf.key] = (dtype_name(leaf.dtype), tuple(leaf.global_shape))
            if is_main_replica(leaf.replica_id):
                pieces.append((leaf, t))
        elif isinstance(leaf, ShardedObject):
            if is_main_replica(leaf.replica_id):
                objects.setdefault(leaf.unique_key, leaf.data)
        else:
            raise UnsupportedValueError(
                f"sharded state dict holds a {type(leaf).__name__}; the ckptlib strategy takes "
                "ShardedTensor and ShardedObject leaves (apply factories first)"
            )
    # Unsupported object values fail here, before any I/O; every rank learns of it.
    obj_flat: FlatState | None = None
    mine: Any
    try:
        obj_flat = flatten({"objects": PerRank(objects)}, coord.rank)
        mine = sorted(keys.items())
    except UnsupportedValueError as e:
        mine = {"unsupported": str(e)}
    everyone = coord.gather(mine, timeout)
    answer: dict[str, Any] | None = None
    if everyone is not None:
        merged: dict[str, tuple[str, tuple[int, ...]]] = {}
        error = None
        for rank, ks in enumerate(everyone):
            if isinstance(ks, dict):
                answer = {"unsupported": f"rank {rank}: {ks['unsupported']}"}
                break
            for k, (dt, gs) in ks:
                v = (dt, tuple(gs))
                if merged.setdefault(k, v) != v:
                    error = f"tensor {k!r}: rank {rank} has {dt} {list(gs)}, another rank {merged[k][0]} {list(merged[k][1])}"
        if answer is None:
            answer = {"error": error} if error else {"keys": sorted(merged)}
    answer = coord.agree(answer, timeout)
    assert answer is not None
    if "unsupported" in answer:
        raise UnsupportedValueError(answer["unsupported"])
    if "error" in answer:
        raise StateMismatchError(answer["error"])
    assert obj_flat is not None
    items: list[TensorItem] = []
    for st, t in pieces:
        items.append(
            TensorItem(
                _tensor_name(st.key), t, tuple(st.global_shape), tuple(st.global_offset), False
            )
        )
    items.extend(obj_flat.items)
    if copy:  # async: the training loop may change its tensors as soon as we return
        for it in items:
            it.tensor = it.tensor.detach().to("cpu", copy=True)
    # The tree is identical on every rank (the union of keys); each rank writes only its own
    # main-replica pieces (Megatron guarantees every piece has exactly one main replica).
    tensors_node = {
        "t": "dict",
        "items": [[k, {"t": "tensor", "ref": _tensor_name(k)}] for k in answer["keys"]],
    }
    tree = {"t": "dict", "items": [["tensors", tensors_node], *obj_flat.tree["items"]]}
    return FlatState(tree, items, obj_flat.per_rank), list(answer["keys"])


def _common_record(checkpoint_dir: str) -> dict[str, Any] | None:
    p = Path(checkpoint_dir) / COMMON
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return None
    return {"file": COMMON, "size": len(data), "xxh3_64": checksum(data)}


def _iteration_of(checkpoint_dir: str) -> int | None:
    m = ITER_RE.match(Path(checkpoint_dir).name)
    return int(m.group(1)) if m else None


class SaveStrategy(_mbase.AsyncSaveShardedStrategy):
    """Sharded save strategy (backend ``"ckptlib"``). Handles ShardedObjects itself.

    ``compression`` (None | "zstd") and ``timeout`` (seconds for the whole save) go to
    ckptlib's save flow. One instance may be reused across saves; finalize (or wait for) one
    async save before starting the next.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        *,
        compression: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        super().__init__(backend, version)
        self.options = save_flow.SaveOptions(compression=compression, timeout=timeout)
        self._idle = threading.Event()  # no persist of this strategy is running
        self._idle.set()

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """Synchronous save: returns once the ckptlib checkpoint is committed (every rank)."""
        self._prepare(sharded_state_dict, checkpoint_dir, copy=False)()

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path
    ) -> AsyncRequest:
        """Snapshot this rank's pieces to CPU now; the returned request's ``async_fn`` writes
        and commits (collective on ckptlib's gloo group: run it on every rank, in a thread of
        the training process or synchronously, not in a forked process)."""
        fn = self._prepare(sharded_state_dict, checkpoint_dir, copy=True)
        return AsyncRequest(fn, (), [])

    def _prepare(
        self, sd: ShardedStateDict, checkpoint_dir: str | Path, *, copy: bool
    ) -> Callable[[], None]:
        checkpoint_dir = os.fspath(checkpoint_dir)
        # A previous async save of this strategy still writing would share ckptlib's
        # coordination group with the collectives below: let it finish first.
        if not self._idle.wait(self.options.timeout):
            raise CommitError("the previous async save did not finish within the save timeout")
        coord = default_coordinator()
        flat, _ = _build(sd, coord, self.options.timeout, copy)
        meta = None
        if coord.is_coordinator:
            meta = {
                "megatron": {
                    "backend": BACKEND,
                    "version": VERSION,
                    "common": _common_record(checkpoint_dir),
                    "megatron_core": _megatron_version(),
                }
            }
        meta = coord.agree(meta, self.options.timeout)
        step = _iteration_of(checkpoint_dir)
        storage = open_storage(checkpoint_dir)
        options = self.options

        idle = self._idle

        def persist() -> None:
            try:
                storage.makedirs("")
                save_flow.persist(
                    storage,
                    FOLDER,
                    flat,
                    step=step,
                    metadata=meta,
                    options=options,
                    coordinator=coord,
                )
            finally:
                idle.set()

        idle.clear()

        return persist


def _megatron_version() -> str:
    try:
        from megatron.core.package_info import __version__

        return str(__version__)
    except Exception:  # pragma: no cover - very old releases
        return "unknown"


# ---------------------------------------------------------------------------------------------
# load


def _check_common(checkpoint_dir: str, meta: Any) -> None:
    rec = (meta or {}).get("megatron", {}).get("common") if isinstance(meta, dict) else None
    where = os.path.join(checkpoint_dir, COMMON)
    if rec is None:
        return
    try:
        data = Path(where).read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpointError("common.pt is missing", where) from None
    if len(data) != rec["size"] or checksum(data) != rec["xxh3_64"]:
        raise CorruptCheckpointError(
            "common.pt does not match the checksum recorded in the manifest", where
        )


def _metadata(checkpoint_dir: str) -> Any:
    m = read_manifest(open_storage(checkpoint_dir), FOLDER)
    return tree_codec.decode(m.metadata, (), os.path.join(checkpoint_dir, FOLDER, "manifest.json"))


class LoadStrategy(_mbase.LoadShardedStrategy):
    """Sharded load strategy for checkpoints written by :class:`SaveStrategy`.

    ``load`` reads, for every ShardedTensor of this rank (main replica or not), exactly the
    box it covers, whatever sharding the checkpoint was saved with; checksums are verified
    (``verify=True``), a mismatch raises :class:`CorruptCheckpointError`.
    """

    def __init__(self, *, verify: bool = True, threads: int = 4) -> None:
        self.verify = verify
        self.threads = threads

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
        storage = open_storage(checkpoint_dir)
        m = read_manifest(storage, FOLDER)
        where = os.path.join(checkpoint_dir, FOLDER, "manifest.json")
        check_files(storage, FOLDER, m)
        saved = tree_codec.decode(m.tree, m.tensors, where)
        if not isinstance(saved, dict) or not isinstance(saved.get("tensors"), dict):
            raise CorruptCheckpointError("not a Megatron checkpoint written by ckptlib", where)
        objects: dict[str, Any] = {}
        node = saved.get("objects")
        if isinstance(node, tree_codec.PerRankSaved):
            for per in node.values:
                if isinstance(per, dict):
                    for k, v in per.items():
                        objects.setdefault(k, v)
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
                t = _piece(x)
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

        out = _map(one, sharded_state_dict)
        run_plan(plan, storage, FOLDER, m, verify=self.verify, threads=self.threads)
        return _map(lambda x: resolve_lazy(x.value) if isinstance(x, _Holder) else x, out)

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, ShardedTensor]:
        checkpoint_dir = os.fspath(checkpoint_dir)
        m = read_manifest(open_storage(checkpoint_dir), FOLDER)
        saved = tree_codec.decode(
            m.tree, m.tensors, os.path.join(checkpoint_dir, FOLDER, "manifest.json")
        )
        out = {}
        for key, ref in saved.get("tensors", {}).items():
            e = m.tensors[ref.name]
            out[key] = ShardedTensor.from_rank_offsets(
                key, torch.empty(e.shape, dtype=DTYPES[e.dtype], device="meta")
            )
            out[key].data = None
        return out

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.load_tensors_metadata(checkpoint_dir))
        checkpoint_dir = os.fspath(checkpoint_dir)
        m = read_manifest(open_storage(checkpoint_dir), FOLDER)
        saved = tree_codec.decode(
            m.tree, m.tensors, os.path.join(checkpoint_dir, FOLDER, "manifest.json")
        )
        node = saved.get("objects")
        if isinstance(node, tree_codec.PerRankSaved):
            for per in node.values:
                for k in per:
                    out[k] = ShardedObject.empty_from_unique_key(k)
        return out


@dataclass
class _Holder:
    value: Any


def _map(fn: Callable[[Any], Any], x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    if isinstance(x, list):
        return [_map(fn, v) for v in x]
    return fn(x)


class LoadCommonStrategy(_mbase.LoadCommonStrategy):
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
        _check_common(checkpoint_dir, _metadata(checkpoint_dir))
        path = os.path.join(checkpoint_dir, COMMON)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointingException(f"{path} does not exist") from None
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
    reg = getattr(_mbase, "register_default_strategy", None)
    action = getattr(_mbase, "StrategyAction", None)
    if reg is None or action is None:
        return False
    reg(action.SAVE_SHARDED, BACKEND, VERSION, SaveStrategy())
    reg(action.LOAD_SHARDED, BACKEND, VERSION, LoadStrategy())
    return True


# ---------------------------------------------------------------------------------------------
# async scheduling


class _Scheduled:
    """An AsyncRequest running in a thread; :meth:`finalize` joins it and runs the finalize
    functions (collective: every rank calls it)."""

    def __init__(self, request: AsyncRequest) -> None:
        self.request = request
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="ckptlib-megatron-save", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.request.async_fn is not None:
                self.request.async_fn(*self.request.async_fn_args, **self.request.async_fn_kwargs)
        except BaseException as e:
            self.error = e

    def done(self) -> bool:
        return not self.thread.is_alive()

    def finalize(self, timeout: float | None = 600.0) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError("async Megatron save did not finish in time")
        if self.error is not None:
            raise self.error
        for fn in self.request.finalize_fns:
            fn()


def schedule(request: AsyncRequest) -> _Scheduled:
    """Start ``request.async_fn`` in a background thread; call ``.finalize()`` later (every
    rank, before the next save). Megatron's own ``AsyncCallsQueue`` forks a process and
    needs CUDA; this is the CPU-friendly equivalent."""
    return _Scheduled(request)


# ---------------------------------------------------------------------------------------------
# resume planner


def iteration_dir(save_dir: str | os.PathLike[str], iteration: int) -> str:
    """Megatron's folder name for ``iteration`` (``iter_0000100``)."""
    return os.path.join(os.fspath(save_dir), f"iter_{iteration:07d}")


@dataclass(slots=True)
class IterationInfo:
    iteration: int
    path: str
    status: str
    """``committed``, ``incomplete`` or ``corrupt``."""
    reason: str = ""
    world_size: int = 0
    """Number of ranks that saved it (from the manifest; 0 if unknown)."""


def _judge(path: str, iteration: int, deep: bool) -> IterationInfo:
    info = IterationInfo(iteration, path, "corrupt")
    try:
        cfg = json.loads(Path(path, "metadata.json").read_text())
    except FileNotFoundError:
        info.status, info.reason = "incomplete", "no metadata.json (save not finalized)"
        return info
    except (OSError, ValueError) as e:
        info.reason = f"metadata.json unreadable: {e}"
        return info
    if not isinstance(cfg, dict) or cfg.get("sharded_backend") != BACKEND:
        info.reason = f"not a ckptlib checkpoint (sharded_backend={cfg.get('sharded_backend') if isinstance(cfg, dict) else cfg!r})"
        return info
    st = check_step(open_storage(path), FOLDER, iteration, deep=deep)
    info.world_size = st.world_size
    if st.status != "committed":
        info.status, info.reason = st.status, st.reason
        return info
    try:
        _check_common(path, _metadata(path))
    except CheckpointError as e:
        info.reason = str(e)
        return info
    info.status = "committed"
    return info


def iterations(save_dir: str | os.PathLike[str], *, deep: bool = False) -> list[IterationInfo]:
    """Every ``iter_*`` folder under ``save_dir``, newest first, judged like ckptlib steps:
    metadata.json names the ckptlib backend, the manifest validates and names the same
    iteration, payload sizes match, common.pt matches its checksum (``deep``: every chunk's
    checksum too). ``latest_checkpointed_iteration.txt`` is ignored."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = ITER_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), str(p)))
    return [_judge(path, it, deep) for it, path in sorted(found, reverse=True)]


def latest_iteration(save_dir: str | os.PathLike[str], *, deep: bool = False) -> int | None:
    """The newest consistent iteration under ``save_dir`` (quick check; ``deep=True`` also
    reads every chunk), or None. Pure I/O, no collective."""
    for info in iterations(save_dir, deep=deep):
        if info.status == "committed":
            return info.iteration
    return None


def _copy_structure(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _copy_structure(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy_structure(v) for v in x]
    return x


def load_latest(
    sharded_state_dict: ShardedStateDict | Callable[[], ShardedStateDict],
    save_dir: str | os.PathLike[str],
    *,
    strict: Any = None,
    timeout: float = 600.0,
) -> tuple[int | None, Any]:
    """Load the newest iteration that every rank can read intact; ``(None, None)`` if none.

    Collective (every rank, same order). Rank 0 scans ``save_dir`` (:func:`iterations`) and
    all ranks get the same candidate list; newest first, every rank loads its part through
    ``dist_checkpointing.load`` with the ckptlib strategies, and the ranks agree: if any rank
    hit a checksum mismatch (:class:`CorruptCheckpointError`), all move on to the next older
    iteration. Other errors are raised on every rank. ``sharded_state_dict`` may be a
    callable returning a fresh one (needed when it holds ShardedTensorFactories, which a
    load consumes); otherwise its containers are copied before each attempt.
    """
    from megatron.core import dist_checkpointing as mdc

    coord = default_coordinator()
    cands = None
    if coord.is_coordinator:
        cands = [[i.iteration, i.path, i.status, i.reason] for i in iterations(save_dir)]
    cands = coord.agree(cands, timeout)
    problems: list[str] = []
    for it, path, status, reason in cands:
        if status != "committed":
            log.warning("ckptlib: skipping iteration %d (%s): %s", it, status, reason)
            if status == "corrupt":
                problems.append(f"iteration {it}: {reason}")
            continue
        sd = (
            sharded_state_dict()
            if callable(sharded_state_dict)
            else _copy_structure(sharded_state_dict)
        )
        kwargs = {} if strict is None else {"strict": strict}
        result: Any = None
        outcome = ("ok", "")
        try:
            result = mdc.load(
                sd,
                path,
                sharded_strategy=LoadStrategy(),
                common_strategy=LoadCommonStrategy(),
                **kwargs,
            )
        except CorruptCheckpointError as e:
            outcome = ("corrupt", str(e))
        except Exception as e:
            outcome = (type(e).__name__, str(e))
        verdict = (
            coord.agree(coord.gather(outcome, timeout), timeout)
            if coord.world_size > 1
            else [outcome]
        )
        fatal = [(r, k, msg) for r, (k, msg) in enumerate(verdict) if k not in ("ok", "corrupt")]
        if fatal:
            r, k, msg = fatal[0]
            raise CheckpointError(f"loading iteration {it}: rank {r}: {k}: {msg}")
        bad = [(r, msg) for r, (k, msg) in enumerate(verdict) if k == "corrupt"]
        if bad:
            detail = "; ".join(f"rank {r}: {msg}" for r, msg in bad)
            log.warning("ckptlib: iteration %d is corrupt, trying an older one: %s", it, detail)
            problems.append(f"iteration {it}: {detail}")
            continue
        return it, result
    if problems:
        raise CorruptCheckpointError(
            f"no usable checkpoint under {save_dir}: " + "; ".join(problems)
        )
    return None, None
