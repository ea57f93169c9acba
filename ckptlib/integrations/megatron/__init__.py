"""Megatron-Core ``dist_checkpointing`` strategies that store ShardedTensors in ckptlib's format.

Importing this module imports ``megatron.core`` (``import ckptlib`` never does). Usage:
docs/integrations/megatron.md. All calls run on the training thread, every rank, same order.
Modules: :mod:`.layout` (the checkpoint directory, checks shared
by all), :mod:`.save` (:class:`SaveStrategy`, :func:`schedule`), :mod:`.load` (the load
strategies, :func:`register`), :mod:`.resume` (:func:`iterations`, :func:`load_latest`: replace
``latest_checkpointed_iteration.txt``).
"""

from ckptlib.errors import require

# Without megatron-core, say which extra to install instead of failing deep inside layout.py.
require("megatron.core.dist_checkpointing", "megatron", "ckptlib.integrations.megatron")

from ckptlib.integrations.megatron.layout import BACKEND  # noqa: E402
from ckptlib.integrations.megatron.load import LoadCommonStrategy, LoadStrategy, register  # noqa: E402
from ckptlib.integrations.megatron.resume import (  # noqa: E402
    IterationInfo,
    iteration_dir,
    iterations,
    latest_iteration,
    load_latest,
)
from ckptlib.integrations.megatron.save import SaveStrategy, schedule  # noqa: E402

__all__ = [
    "BACKEND", "IterationInfo", "LoadCommonStrategy", "LoadStrategy", "SaveStrategy",
    "iteration_dir", "iterations", "latest_iteration", "load_latest", "register", "schedule",
]
