"""DeepSpeed integration: ``engine.save_checkpoint`` / ``load_checkpoint`` stored through ckptlib.

Usage (every rank, after ``deepspeed.initialize``)::

    from ckptlib.integrations import deepspeed as ckds

    ckds.install(engine)                       # or install(engine, "s3://bucket/run", ...)
    res = ckds.resume(engine, "ckpt")          # newest *consistent* tag, or a fresh start
    ...
    engine.save_checkpoint("ckpt", client_state={...})   # unchanged DeepSpeed calls

How DeepSpeed files map onto ckptlib (see docs/integrations/deepspeed.md):

- One DeepSpeed tag is one ckptlib step (``step-N`` under the root, ``N`` the engine's
  ``global_steps`` unless ``step_fn`` says otherwise). The tag is in the manifest metadata.
- Every file DeepSpeed asks to write under ``<save_dir>/<tag>/`` (``mp_rank_00_model_states.pt``,
  ``zero_pp_rank_R_mp_rank_00_optim_states.pt``, ...) becomes one entry of the step's state:
  ``{"files": PerRank({file name: state dict})}``; each rank writes the files it was given.
- Nothing is written to disk before ``commit(tag)``: DeepSpeed calls ``create`` -> ``save`` (per
  file) -> ``commit`` on every rank, all inside one ``save_checkpoint`` call, and the state dicts
  are held by reference until then (DeepSpeed does not mutate them in between). ``commit`` runs
  ckptlib's one save/commit protocol (every rank's payload durable, then one atomic manifest
  publish), so the tag becomes visible all at once or not at all, and only *after* that does
  DeepSpeed write its own ``latest`` file.
- Loads read only the requested file's tensors, checksummed while reading; a mismatch raises
  :class:`~ckptlib.errors.CorruptCheckpointError`. :func:`resume` picks the newest tag that
  passes a full checksum pass (split across ranks) before DeepSpeed touches the model, so a
  corrupt or half-written newest tag is skipped on every rank together.

Non-tensor values: ckptlib stores JSON-typed values only, and DeepSpeed's state dicts hold a few
Python objects. They are converted by a documented, allow-listed scheme (``OrderedDict`` with its
``_metadata``, ``torch.Size``, ``set``/``frozenset``, ``torch.device``, ``argparse.Namespace``,
DeepSpeed's ``ZeroStageEnum``, ``LossScaler``/``DynamicLossScaler`` and ``fragment_address``,
plus classes the user registers with :func:`register_type`). Anything else raises
:class:`~ckptlib.errors.UnsupportedValueError` at save time naming the value's path. Loading
never unpickles: allow-listed objects are rebuilt from JSON-typed attributes, and an unknown type
name in a checkpoint is refused with ``CorruptCheckpointError``.

Threads: everything runs on the training thread. ``install``/``resume``/``save_checkpoint`` are
collective (every rank, same order); ``load_checkpoint``'s file loads are per rank. ``deepspeed``
is imported only when :func:`install` is called.

Modules: :mod:`.codec` (the value conversions), :mod:`.tags` (tag -> step), :mod:`.engine`
(the ``CheckpointEngine``), :mod:`.install`, :mod:`.resume` (on ckptlib's one resume loop).
"""

from ckptlib.integrations.deepspeed.codec import MARK, decode_value, encode_value, register_type
from ckptlib.integrations.deepspeed.install import engine_of, install
from ckptlib.integrations.deepspeed.resume import ResumeResult, newest_consistent, resume
from ckptlib.integrations.deepspeed.tags import FORMAT

__all__ = [
    "FORMAT", "MARK", "ResumeResult", "decode_value", "encode_value", "engine_of", "install",
    "newest_consistent", "register_type", "resume",
]
