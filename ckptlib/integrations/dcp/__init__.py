"""torch.distributed.checkpoint (DCP) storage through ckptlib (docs/integrations/dcp.md).

:class:`CkptlibWriter` / :class:`CkptlibReader` plug into ``dcp.save`` / ``dcp.async_save`` /
``dcp.load``: DCP plans, ckptlib stores (checksummed payloads, one atomic commit, any backend,
a JSON manifest instead of DCP's pickled ``.metadata``). :func:`load_latest` resumes on
ckptlib's one resume loop. Modules: :mod:`.metadata` (DCP ``Metadata`` <-> JSON),
:mod:`.writer`, :mod:`.reader`, :mod:`.resume`, :mod:`.location` (checkpoint folder URLs).

Non-tensor values are stored as JSON and never unpickled from storage, unless
``allow_pickled_objects=True`` on the writer *and* the reader (the docs' "bytes policy").
Importing this package imports torch.distributed.checkpoint; ``import ckptlib`` does not.
"""

from ckptlib.integrations.dcp.location import step_url
from ckptlib.integrations.dcp.metadata import StoredItem, metadata_from_json, metadata_to_json
from ckptlib.integrations.dcp.reader import CkptlibReader
from ckptlib.integrations.dcp.resume import DcpCheckpoint, latest_checkpoint, load_latest
from ckptlib.integrations.dcp.writer import CkptlibWriter

__all__ = [
    "CkptlibReader", "CkptlibWriter", "DcpCheckpoint", "StoredItem", "latest_checkpoint",
    "load_latest", "metadata_from_json", "metadata_to_json", "step_url",
]
