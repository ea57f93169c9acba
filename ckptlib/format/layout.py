"""Names on storage: step folders, temporary folders, markers. Pure.

The layout (step folders ``step-<12 digits>``, ``.tmp-<save_id>`` saves in progress,
``.del-<save_id>`` steps being deleted, ``<save_id>/r<rank>...bin`` payloads, the ``.ckptlib``
marker) is documented in docs/format.md, section 1; on object storage there is no rename and
the manifest is written last.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable
from typing import Any

MARKER = ".ckptlib"
STEP_DIGITS = 12
STEP_RE = re.compile(r"^step-(\d{1,20})$")
TMP_RE = re.compile(r"^(.+)\.(tmp|del)-([0-9a-f]{8,64})$")
CORRUPT_RE = re.compile(r"^(step-\d{1,20})\.corrupt-([0-9a-f]{8,64})$")
"""A damaged step folder a later save moved aside (engine/commit.py); ``ckptlib prune`` judges it."""
PAYLOAD_RE = re.compile(r"^r\d{5}[\w.-]*\.bin$")
"""Any name :func:`payload_name` makes (the retire code's debris rule)."""
CLAIM = "claim.json"
"""Object stores, ``overwrite=True``: ``<final>/<save id>/claim.json`` (:func:`claim_path`),
the commit point of a save replacing a step, created once with a create-only put holding the
new manifest (the coordinator) or an abort record (a rank fencing the save); see
``ckptlib.engine.commit``. Debris once the step's ``manifest.json`` names its save."""


MAX_STEP = 10**20 - 1
"""The largest step a folder name holds (:data:`STEP_RE`: at most 20 digits)."""


def step_dir(step: int) -> str:
    """``step-<n>`` for a step number: an int (not a bool) from 0 to :data:`MAX_STEP`, else
    ``TypeError``/``ValueError`` (every save and every read by step goes through here)."""
    try:
        if isinstance(step, bool):
            raise TypeError
        step = operator.index(step)  # an int as it is; numpy's ints too
    except TypeError:
        raise TypeError(f"step must be an int, got {step!r}") from None
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be from 0 to {MAX_STEP}, got {step}")
    return f"step-{step:0{STEP_DIGITS}d}"


def parse_step(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


def step_folders(entries: Iterable[Any]) -> tuple[int, ...]:
    """The steps of the ``step-N`` folders among a listing's ``entries`` (``.name``,
    ``.is_dir``), ascending."""
    return tuple(sorted(s for e in entries if e.is_dir and (s := parse_step(e.name)) is not None))


def tmp_dir(final: str, save_id: str) -> str:
    return f"{final}.tmp-{save_id}"


def del_dir(final: str, save_id: str) -> str:
    return f"{final}.del-{save_id}"


def claim_path(final: str, save_id: str) -> str:
    return f"{final}/{save_id}/{CLAIM}" if final else f"{save_id}/{CLAIM}"


def payload_name(rank: int, tag: str, index: int) -> str:
    """Payload file ``index`` of ``rank``: ``r<rank, 5 digits><tag>-<index>.bin``.

    Called by the writer (engine/writer.py). ``tag`` is empty unless one rank writes one save
    in several rounds (``p<k>`` for round k > 0), so names stay unique within a save.
    """
    return f"r{rank:05d}{tag}-{index}.bin"


def index_name(rank: int) -> str:
    """Format v2: ``rank``'s piece index file, ``r<rank, 5 digits>-index.bin`` (written once per
    save by engine/writer.py ``write_index``; it matches :data:`PAYLOAD_RE` for the debris rules)."""
    return f"r{rank:05d}-index.bin"


def is_payload_name(name: str) -> bool:
    return PAYLOAD_RE.match(name) is not None
