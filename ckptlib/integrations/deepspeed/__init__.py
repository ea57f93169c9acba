"""DeepSpeed integration: ``engine.save_checkpoint`` / ``load_checkpoint`` stored through ckptlib.

Usage (every rank, after ``deepspeed.initialize``): :func:`install`, then :func:`resume`, then
DeepSpeed's own calls unchanged; see docs/integrations/deepspeed.md. Threads: everything runs on
the training thread. ``install``/``resume``/``save_checkpoint`` are collective (every rank, same
order); ``load_checkpoint``'s file loads are per rank. ``deepspeed`` is imported by :func:`install`.

Modules: :mod:`.codec` (the allow-listed value conversions), :mod:`.tags` (which step holds a
tag), :mod:`.engine` (the ``CheckpointEngine``: how DeepSpeed files map onto a step),
:mod:`.install`, :mod:`.resume` (newest consistent tag, on ckptlib's one resume loop).
"""

from ckptlib.integrations.deepspeed.codec import MARK, decode_value, encode_value, register_type
from ckptlib.integrations.deepspeed.install import engine_of, install
from ckptlib.integrations.deepspeed.resume import ResumeResult, newest_consistent, resume
from ckptlib.integrations.deepspeed.tags import FORMAT

__all__ = [
    "FORMAT", "MARK", "ResumeResult", "decode_value", "encode_value", "engine_of", "install",
    "newest_consistent", "register_type", "resume",
]
