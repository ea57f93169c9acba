"""Lightning integration: checkpoints of ``lightning.pytorch.Trainer`` stored through ckptlib.

Usage (see docs/integrations/lightning.md)::

    from ckptlib.integrations.lightning import CkptlibCheckpointIO, RNGCallback, newest_checkpoint
    trainer = Trainer(plugins=[CkptlibCheckpointIO()], callbacks=[RNGCallback(), ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path=newest_checkpoint(checkpoint_dir))

Modules: :mod:`.checkpoint_io` (the ``CheckpointIO`` plugin and :class:`RNGCallback`; imports
Lightning), :mod:`.resume` (:func:`newest_checkpoint`, on ckptlib's one resume loop; no
Lightning import). Lightning itself is imported only when a name of :mod:`.checkpoint_io` is
first used, so ``import ckptlib.integrations.lightning`` works without it.
"""

from __future__ import annotations

from typing import Any

from ckptlib.errors import require
from ckptlib.integrations.lightning.resume import checkpoint_candidates, newest_checkpoint
from ckptlib.integrations.values import PickledValue

__all__ = ["CkptlibCheckpointIO", "PickledValue", "RNGCallback", "checkpoint_candidates", "newest_checkpoint"]


def __getattr__(name: str) -> Any:
    if name in ("CkptlibCheckpointIO", "RNGCallback"):
        require("lightning.pytorch", "lightning", f"ckptlib.integrations.lightning.{name}")
        from ckptlib.integrations.lightning import checkpoint_io

        return getattr(checkpoint_io, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
