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

Modules: :mod:`.layout` (names, checks shared by all), :mod:`.save` (save strategy,
:func:`schedule`), :mod:`.load` (load strategies, :func:`register`), :mod:`.resume`.
"""

from ckptlib.integrations.megatron.layout import BACKEND
from ckptlib.integrations.megatron.load import LoadCommonStrategy, LoadStrategy, register
from ckptlib.integrations.megatron.resume import (
    IterationInfo,
    iteration_dir,
    iterations,
    latest_iteration,
    load_latest,
)
from ckptlib.integrations.megatron.save import SaveStrategy, schedule

__all__ = [
    "BACKEND", "IterationInfo", "LoadCommonStrategy", "LoadStrategy", "SaveStrategy",
    "iteration_dir", "iterations", "latest_iteration", "load_latest", "register", "schedule",
]
