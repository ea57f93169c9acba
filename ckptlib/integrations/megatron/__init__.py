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

All calls run on the training thread, every rank, same order. Documentation:
docs/integrations/megatron.md. Modules: :mod:`.layout` (the checkpoint directory, checks shared
by all), :mod:`.save` (:class:`SaveStrategy`, :func:`schedule`), :mod:`.load` (the load
strategies, :func:`register`), :mod:`.resume` (:func:`iterations`, :func:`load_latest`: replace
``latest_checkpointed_iteration.txt``).
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
