"""The resume planner: Megatron iterations judged like ckptlib steps, loaded on the one loop.

:func:`iterations` / :func:`latest_iteration` are plain I/O (any thread, no collective).
:func:`load_latest` runs on the training thread of every rank, in the same order, on
:func:`ckptlib.engine.resume.resume_newest`: the coordinator lists the iterations, the ranks
meet with the coordinator's deadlines, each rank's ``dist_checkpointing.load`` is the attempt,
and a damaged iteration is skipped on every rank together. Iterations are judged newest first,
only as far as the caller needs (:func:`iter_iterations`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace
from megatron.core.dist_checkpointing.mapping import ShardedStateDict

from ckptlib.backends import open_storage
from ckptlib.coord.coordinator import default_coordinator
from ckptlib.engine.resume import Candidate, resume_newest
from ckptlib.engine.scan import check_step
from ckptlib.errors import CheckpointError
from ckptlib.format import jsonio
from ckptlib.integrations.megatron.layout import (
    BACKEND,
    FOLDER,
    ITER_RE,
    check_common,
    metadata,
    read_small,
)
from ckptlib.integrations.megatron.load import LoadCommonStrategy, LoadStrategy


def iteration_dir(save_dir: str | os.PathLike[str], iteration: int) -> str:
    """Megatron's folder name for ``iteration`` (``iter_0000100``)."""
    return os.path.join(os.fspath(save_dir), f"iter_{iteration:07d}")


@dataclass(slots=True)
class IterationInfo:
    iteration: int
    path: str
    status: str
    """``committed``, ``incomplete`` or ``corrupt``."""
    reason: str = ""
    world_size: int = 0
    """Number of ranks that saved it (from the manifest; 0 if unknown)."""


MAX_METADATA_BYTES = 1 << 20
"""Largest ``metadata.json`` read (Megatron writes a few hundred bytes)."""


def _judge(path: str, iteration: int, deep: bool) -> IterationInfo:
    info = IterationInfo(iteration, path, "corrupt")
    try:
        cfg = jsonio.loads(read_small(path, "metadata.json", MAX_METADATA_BYTES), os.path.join(path, "metadata.json"))
    except FileNotFoundError:
        info.status, info.reason = "incomplete", "no metadata.json (save not finalized)"
        return info
    except (OSError, CheckpointError) as e:
        info.reason = f"metadata.json unreadable: {e}"
        return info
    if not isinstance(cfg, dict) or cfg.get("sharded_backend") != BACKEND:
        info.reason = f"not a ckptlib checkpoint (sharded_backend={cfg.get('sharded_backend') if isinstance(cfg, dict) else cfg!r})"
        return info
    st = check_step(open_storage(path), FOLDER, iteration, deep=deep)
    info.world_size = st.world_size
    if st.status != "committed":
        info.status, info.reason = st.status, st.reason
        return info
    try:
        check_common(path, metadata(path))
    except CheckpointError as e:
        info.reason = str(e)
        return info
    info.status = "committed"
    return info


def iterations(save_dir: str | os.PathLike[str], *, deep: bool = False) -> list[IterationInfo]:
    """Every ``iter_*`` folder under ``save_dir``, newest first, judged like ckptlib steps:
    metadata.json names the ckptlib backend, the manifest validates and names the same
    iteration, payload sizes match, common.pt matches its checksum (``deep``: every chunk's
    checksum too). ``latest_checkpointed_iteration.txt`` is ignored."""
    return list(iter_iterations(save_dir, deep=deep))


def iter_iterations(save_dir: str | os.PathLike[str], *, deep: bool = False) -> Iterator[IterationInfo]:
    """:func:`iterations` judged lazily: the folder is listed now, each iteration judged only
    when the caller iterates that far, so :func:`latest_iteration` and :func:`load_latest`
    judge the newest iterations up to the first good one, not every one."""
    root = Path(save_dir)
    if not root.is_dir():
        return iter(())
    found = []
    for p in root.iterdir():
        m = ITER_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), str(p)))
    return (_judge(path, it, deep) for it, path in sorted(found, reverse=True))


def latest_iteration(save_dir: str | os.PathLike[str], *, deep: bool = False) -> int | None:
    """The newest consistent iteration under ``save_dir`` (quick check; ``deep=True`` also
    reads every chunk), or None. Pure I/O, no collective."""
    return next((i.iteration for i in iter_iterations(save_dir, deep=deep) if i.status == "committed"), None)


def load_latest(
    sharded_state_dict: ShardedStateDict | Callable[[], ShardedStateDict],
    save_dir: str | os.PathLike[str],
    *,
    strict: Any = None,
    timeout: float = 600.0,
) -> tuple[int | None, Any]:
    """Load the newest iteration that every rank can read intact; ``(None, None)`` if none.

    Collective (every rank, same order), on ckptlib's resume loop (module docstring): rank 0
    lists :func:`iterations`; each rank's part is a ``dist_checkpointing.load`` with the
    ckptlib strategies; a :class:`CorruptCheckpointError` on any rank moves every rank to the
    next older iteration. ``sharded_state_dict`` may be a callable returning a fresh one (needed
    with ShardedTensorFactories, which a load consumes); else its containers are copied per try.
    """
    from megatron.core import dist_checkpointing as mdc

    kwargs = {} if strict is None else {"strict": strict}

    def listing() -> Iterator[Candidate]:  # judged as the resume loop gets there
        return (Candidate(i.iteration, i.path, i.status, i.reason) for i in iter_iterations(save_dir))

    def attempt(c: Candidate) -> Any:
        sd = sharded_state_dict() if callable(sharded_state_dict) else dict_list_map_outplace(lambda x: x, sharded_state_dict)
        return mdc.load(
            sd, c.folder, sharded_strategy=LoadStrategy(judged=True),  # the listing judged its sizes
            common_strategy=LoadCommonStrategy(), **kwargs
        )

    got = resume_newest(
        default_coordinator(), listing, attempt, timeout=timeout, where=os.fspath(save_dir), label="iteration"
    )
    return (None, None) if got is None else (got.candidate.step, got.value)
