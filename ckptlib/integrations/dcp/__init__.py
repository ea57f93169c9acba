"""torch.distributed.checkpoint (DCP) storage through ckptlib.

:class:`CkptlibWriter` and :class:`CkptlibReader` plug into ``dcp.save`` / ``dcp.async_save``
/ ``dcp.load``: DCP keeps doing what it is good at (planning, deduplication, resharding,
``get_state_dict``/``set_state_dict``), ckptlib does the storage -- packed, checksummed payload
files written by its save session (:class:`ckptlib.engine.save.SaveSession`), one atomic
commit (rename on POSIX, create-only put on object stores), any ckptlib backend (local path,
``memory://``, ``s3://``) with its retries, and a JSON manifest instead of DCP's pickled
``.metadata``. :func:`load_latest` is the resume helper on ckptlib's one resume loop: newest
consistent step first, older ones when a step turns out to be corrupt, every agreement
between ranks bounded by the coordinator's deadline.

Modules, by concern: :mod:`.metadata` (DCP ``Metadata`` <-> JSON), :mod:`.writer`,
:mod:`.reader`, :mod:`.resume`, :mod:`.location` (checkpoint folder URLs). Each module's
docstring says which DCP call runs what, on which rank and thread.

Non-tensor values (DCP's ``BYTE_IO`` items: learning rates, step counters, ...). DCP would
``torch.save`` them on save and ``torch.load(weights_only=False)`` them on load, i.e. unpickle
bytes read from storage. ckptlib instead stores plain values (None, bool, int, float, str,
bytes, dtype, and lists/tuples/dicts of those) as JSON in the manifest; on load it rebuilds
the value from JSON and hands DCP's planner a stream that it serialised itself, in this
process, from that value -- so the only pickle DCP's planner ever unpickles was produced
locally from validated JSON, never read from storage. Any other object is refused with
:class:`~ckptlib.errors.UnsupportedValueError` unless ``allow_pickled_objects=True`` on the
writer (the ``torch.save`` bytes are then stored as a checksummed payload) *and* on the reader
(which then hands those stored bytes to DCP's planner, which unpickles them).

Importing this package imports torch.distributed.checkpoint; ``import ckptlib`` does not
import it.
"""

from ckptlib.integrations.dcp.location import step_url
from ckptlib.integrations.dcp.metadata import StoredItem, metadata_from_json, metadata_to_json
from ckptlib.integrations.dcp.reader import CkptlibReader
from ckptlib.integrations.dcp.resume import DcpCheckpoint, latest_checkpoint, load_latest
from ckptlib.integrations.dcp.writer import CkptlibWriter

__all__ = [
    "CkptlibReader",
    "CkptlibWriter",
    "DcpCheckpoint",
    "StoredItem",
    "latest_checkpoint",
    "load_latest",
    "metadata_from_json",
    "metadata_to_json",
    "step_url",
]
