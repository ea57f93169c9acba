"""The fence of a failed save on storage: abort folders and abort records. Pure.

A rank that gave up waiting for the coordinator (frozen or dead mid-publish) claims the save's
commit point first, so that the coordinator's later commit fails (``ckptlib.engine.commit.fence``):

- where folders rename atomically, it renames the save's ``<final>.tmp-<id>/`` to
  :func:`abort_dir` ``<final>.abort-<id>/`` (the coordinator's rename of the tmp folder into
  ``<final>`` then finds no source);
- on object stores it creates the save's claim ``<final>/<id>/claim.json`` (where an
  ``overwrite`` save commits, :func:`ckptlib.format.layout.claim_path`), then
  ``<final>/manifest.json`` (where any other save's create-only manifest put would go), each
  with a create-only put holding an abort record (:func:`encode_abort`).

Both are debris of a failed save: never committed, never corrupt. :func:`parse_abort` tells an
abort record from a manifest (the scanner reports the step as incomplete, cleanup removes it,
the next save of the step replaces it). Layout of the other names: :mod:`ckptlib.format.layout`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptlib.errors import CorruptCheckpointError
from ckptlib.format import jsonio

ABORT_RE = re.compile(r"^(.+)\.abort-([0-9a-f]{8,64})$")
"""``<final>.abort-<save id>``: group 1 the final folder, group 2 the save id."""

MAGIC = b'{"ckptlib_abort":'
"""Every abort record starts with these bytes (its keys are written in this order)."""

MAX_RECORD_BYTES = 1 << 16


@dataclass(frozen=True, slots=True)
class AbortRecord:
    save_id: str
    """The save that was abandoned (it can never commit)."""
    rank: int
    """The rank that gave up waiting and placed the fence."""
    reason: str
    time: float
    """Unix time the fence was placed."""

    def describe(self) -> str:
        return (f"save {self.save_id} failed and was fenced by rank {self.rank} ({self.reason}); "
                "never committed")


def abort_dir(final: str, save_id: str) -> str:
    return f"{final}.abort-{save_id}"


def encode_abort(save_id: str, rank: int, reason: str, time: float) -> bytes:
    body = {"ckptlib_abort": 1, "save_id": save_id, "rank": rank, "reason": reason[:1000], "time": time}
    return jsonio.dumps(body, sort_keys=False).encode()


def parse_abort(data: bytes, where: str = "") -> AbortRecord | None:
    """The abort record in ``data``, or None when ``data`` is not one (a manifest, say). Bytes
    that start like an abort record but are not a valid one raise ``CorruptCheckpointError``."""
    if not data.startswith(MAGIC):
        return None
    if len(data) > MAX_RECORD_BYTES:
        raise CorruptCheckpointError(f"abort record of {len(data)} bytes, over {MAX_RECORD_BYTES}", where)
    obj = jsonio.loads(data, where)
    try:
        if obj["ckptlib_abort"] != 1:
            raise ValueError(f"unknown abort record version {obj['ckptlib_abort']!r}")
        save_id, rank, reason, when = obj["save_id"], obj["rank"], obj["reason"], obj["time"]
        if not (isinstance(save_id, str) and re.fullmatch(r"[0-9a-f]{8,64}", save_id)):
            raise ValueError("bad save_id")
        if type(rank) is not int or not isinstance(reason, str) or type(when) not in (int, float):
            raise ValueError("bad field types")
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"malformed abort record: {e}", where) from None
    return AbortRecord(save_id, rank, reason, float(when))
