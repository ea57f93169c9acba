"""Restore the newest consistent step: the resume planner's load half.

Called by ``CheckpointManager.restore`` on the caller's thread, on every rank when the job is
distributed. The coordinator scans storage and every rank gets the same list of candidates
(so ranks never disagree because of a stale listing); then, newest first, every rank loads
its part and the ranks agree on the result: if any rank found the step corrupt, all move on
to the next older step together (each skip logged with its reason). Other errors (a target
that does not match the checkpoint) are raised on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

from ckptlib import crashpoints
from ckptlib.backends import Storage
from ckptlib.coord.coordinator import Coordinator
from ckptlib.engine import load as load_flow
from ckptlib.engine.scan import scan
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
)

log = logging.getLogger("ckptlib")


def candidates(storage: Storage) -> list[tuple[int, str, str, str]]:
    """(step, folder, status, reason) for every step, newest first."""
    try:
        infos = scan(storage)
    except CheckpointNotFoundError:
        return []
    return [(i.step, i.path, i.status, i.reason) for i in infos]


def restore(
    storage: Storage,
    state: Any,
    coord: Coordinator,
    *,
    step: int | None = None,
    verify: bool = True,
    per_rank: str = "error",
    timeout: float = 600.0,
) -> int | None:
    cands = coord.agree(candidates(storage) if coord.is_coordinator else None, timeout)
    if step is not None:
        cands = [c for c in cands if c[0] == step]
        if not cands:
            raise CheckpointNotFoundError(f"no step {step} under {storage.url}")
    problems = []
    for cstep, folder, status, reason in cands:
        if status != "committed":
            if status == "corrupt":
                problems.append(f"step {cstep}: {reason}")
            log.warning("ckptlib: skipping step %d (%s): %s", cstep, status, reason)
            continue
        outcome: tuple[str, str] = ("ok", "")
        crashpoints.point("restore", coord.rank)
        try:
            load_flow.load_checkpoint(
                storage, folder, state, verify=verify,
                rank=coord.rank, world_size=coord.world_size, per_rank=per_rank,
            )
        except CorruptCheckpointError as e:
            outcome = ("corrupt", str(e))
        except CheckpointError as e:
            outcome = (type(e).__name__, str(e))
        if coord.world_size > 1:
            everyone = coord.gather(outcome, timeout)
            verdict = coord.agree(everyone, timeout)
        else:
            verdict = [outcome]
        fatal = [(r, kind, msg) for r, (kind, msg) in enumerate(verdict) if kind not in ("ok", "corrupt")]
        if fatal:
            r, kind, msg = fatal[0]
            raise StateMismatchError(f"rank {r}: {msg}") if kind == "StateMismatchError" else CheckpointError(
                f"rank {r}: {kind}: {msg}"
            )
        bad = [(r, msg) for r, (kind, msg) in enumerate(verdict) if kind == "corrupt"]
        if bad:
            detail = "; ".join(f"rank {r}: {msg}" for r, msg in bad)
            problems.append(f"step {cstep}: {detail}")
            log.warning("ckptlib: step %d is corrupt, trying an older one: %s", cstep, detail)
            continue
        log.info("ckptlib: restored step %d from %s", cstep, storage.url)
        return cstep
    if problems:
        raise CorruptCheckpointError(f"no usable checkpoint under {storage.url}: " + "; ".join(problems))
    return None
