"""The save strategy: Megatron ShardedTensors/ShardedObjects into one ckptlib checkpoint.

Called by ``dist_checkpointing.save`` on the training thread of every rank, after Megatron
wrote ``common.pt``: :meth:`SaveStrategy.save`, or ``async_save`` (one collective, this rank's
main-replica pieces copied to CPU) whose ``AsyncRequest`` writes and commits -- run it with
:func:`schedule` or ``execute_sync()``; Megatron's finalize then writes ``metadata.json``.
Mapping (main replicas only, ShardedObjects per rank by ``unique_key``, JSON-typed values or
``UnsupportedValueError`` before any I/O): docs/integrations/megatron.md.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies import base as mbase
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

from ckptlib.backends import open_storage
from ckptlib.coord.coordinator import default_coordinator
from ckptlib.coord.session import Session
from ckptlib.coord.turns import in_turn
from ckptlib.engine import save as save_flow
from ckptlib.errors import CommitError, StateMismatchError, UnsupportedValueError
from ckptlib.format.dtypes import dtype_name
from ckptlib.format.leaves import PerRank
from ckptlib.integrations.megatron.layout import (
    BACKEND,
    FOLDER,
    VERSION,
    common_record,
    iteration_of,
    piece,
)
from ckptlib.plan.flatten import FlatState, TensorItem, check_name, escape, flatten


def _tensor_name(key: str) -> str:
    """The checkpoint name of Megatron's ``key``; a name over ``MAX_NAME`` is refused as the
    flattener refuses it (:func:`~ckptlib.plan.flatten.check_name`)."""
    return check_name(f"/tensors/{escape(key)}")


def _build(sd: ShardedStateDict, s: Session, timeout: float, copy: bool
           ) -> tuple[FlatState, list[str]]:
    """FlatState for this rank: identical tree on every rank (union of keys), own pieces only.
    Collective (a report and a share in the caller's session ``s``)."""
    pieces: list[tuple[ShardedTensor, torch.Tensor]] = []
    objects: dict[str, Any] = {}
    keys: dict[str, tuple[str, tuple[int, ...]]] = {}
    for leaf in nested_values(sd):  # dicts and lists, as Megatron's own walks
        if isinstance(leaf, ShardedTensor):
            t = piece(leaf)
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
        obj_flat = flatten({"objects": PerRank(objects)}, s.rank)
        for k in keys:
            _tensor_name(k)  # a key too long for a name fails the save on every rank, before any I/O
        mine = sorted(keys.items())
    except UnsupportedValueError as e:
        mine = {"unsupported": str(e)}
    everyone = s.report(mine, deadline=s.now() + timeout)
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
    answer = s.share(answer, deadline=s.now() + timeout)
    assert answer is not None
    if "unsupported" in answer:
        raise UnsupportedValueError(answer["unsupported"])
    if "error" in answer:
        raise StateMismatchError(answer["error"])
    assert obj_flat is not None
    items = [TensorItem(_tensor_name(st.key), t, tuple(st.global_shape), tuple(st.global_offset),
                        False) for st, t in pieces] + obj_flat.items
    if copy:  # async: the training loop may change its tensors as soon as we return
        for it in items:
            it.tensor = it.tensor.detach().to("cpu", copy=True)
    # The tree is identical on every rank (the union of keys); each rank writes only its own
    # main-replica pieces (Megatron guarantees every piece has exactly one main replica).
    refs = [[k, {"t": "tensor", "ref": _tensor_name(k)}] for k in answer["keys"]]
    tensors_node = {"t": "dict", "items": refs}
    tree = {"t": "dict", "items": [["tensors", tensors_node], *obj_flat.tree["items"]]}
    return FlatState(tree, items, obj_flat.per_rank), list(answer["keys"])


class SaveStrategy(mbase.AsyncSaveShardedStrategy):
    """Sharded save strategy (backend ``"ckptlib"``). Handles ShardedObjects itself.

    ``compression`` (None | "zstd") and ``timeout`` (seconds for the whole save) go to
    ckptlib's save flow. One instance may be reused across saves; finalize (or wait for) one
    async save before starting the next.
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *,
                 compression: str | None = None, timeout: float = 600.0) -> None:
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

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path
                   ) -> AsyncRequest:
        """Snapshot this rank's pieces to CPU now; the returned request's ``async_fn`` writes
        and commits (collective on ckptlib's gloo group: run it on every rank, in a thread of
        the training process or synchronously, not in a forked process)."""
        fn = self._prepare(sharded_state_dict, checkpoint_dir, copy=True)
        return AsyncRequest(fn, (), [])

    def _prepare(self, sd: ShardedStateDict, checkpoint_dir: str | Path, *, copy: bool
                 ) -> Callable[[], None]:
        checkpoint_dir = os.fspath(checkpoint_dir)
        # A previous async save of this strategy still writing would share ckptlib's
        # coordination group with the collectives below: let it finish first.
        if not self._idle.wait(self.options.timeout):
            raise CommitError("the previous async save did not finish within the save timeout")
        coord = default_coordinator()
        with coord.session("megatron check", coord.deadline(self.options.timeout)) as s:  # a late rank is waited for
            flat, _ = _build(sd, s, self.options.timeout, copy)
            meta = s.share({"megatron": {
                "backend": BACKEND, "version": VERSION, "common": common_record(checkpoint_dir),
                "megatron_core": _megatron_version(),
            }} if s.is_coordinator else None)
        step = iteration_of(checkpoint_dir)
        storage = open_storage(checkpoint_dir)
        options, idle = self.options, self._idle

        def persist() -> None:
            try:
                storage.makedirs("")
                save_flow.persist(storage, FOLDER, flat, step=step, metadata=meta, options=options,
                                  coordinator=coord)
            finally:
                idle.set()

        idle.clear()
        # Reserved here, on the training thread: a load or another manager's save started after
        # this one meets after it, wherever ``persist`` runs (ckptlib/coord/turns.py).
        return in_turn(coord.turn(f"megatron save of {checkpoint_dir}"), persist)


def _megatron_version() -> str:
    try:
        from megatron.core.package_info import __version__

        return str(__version__)
    except Exception:  # pragma: no cover - very old releases
        return "unknown"


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
