"""Megatron-Core ``dist_checkpointing`` strategies that store ShardedTensors in ckptlib's format.

Importing this module imports ``megatron.core`` (``import ckptlib`` never does). Usage:
docs/integrations/megatron.md. All calls run on the training thread, every rank, same order.
Modules: :mod:`.layout` (the checkpoint directory, checks shared
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
