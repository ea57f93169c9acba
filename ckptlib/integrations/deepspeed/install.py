"""Install ckptlib's checkpoint engine into a DeepSpeed engine instance.

:func:`install` runs on the training thread of every rank, once, after
``deepspeed.initialize`` (collective: it creates the coordinator). It swaps
``engine.checkpoint_engine`` for :mod:`.engine`'s class and patches two methods of that one
engine instance (:func:`patch_engine`). :func:`engine_of` is how :mod:`.resume` finds it.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import weakref
from collections.abc import Callable
from typing import Any

from ckptlib.coord.coordinator import Coordinator, default_coordinator
from ckptlib.errors import CheckpointError
from ckptlib.integrations.deepspeed.engine import EngineMixin, engine_class


def install(
    engine: Any,
    url: str | os.PathLike[str] | None = None,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    compression: str | None = None,
    storage_options: dict[str, Any] | None = None,
    save_timeout: float = 600.0,
    step_fn: Callable[[Any, str], int] | None = None,
    coordinator: Coordinator | None = None,
) -> Any:
    """Make ``engine.save_checkpoint``/``load_checkpoint`` store through ckptlib. Collective:
    every rank calls it once, after ``deepspeed.initialize``, in the same order. Arguments and
    the returned engine (its ``previous`` is the one it replaced): docs/integrations/deepspeed.md.
    """
    if url is not None:
        url = os.fspath(url)
        if "://" not in url:
            url = os.path.abspath(url)

    def step_of(tag: str) -> int:
        return int(engine.global_steps if step_fn is None else step_fn(engine, tag))

    cls = engine_class()
    ce = cls(
        url,
        coordinator=coordinator or default_coordinator(),
        step_fn=step_of,
        previous=getattr(engine, "checkpoint_engine", None),
        manager_options={"keep_last": keep_last, "keep_every": keep_every,
                         "compression": compression, "save_timeout": save_timeout},
        storage_options=storage_options,
        engine_ref=weakref.ref(engine),
    )
    engine.checkpoint_engine = ce
    patch_engine(engine, ce)
    return ce


def patch_engine(engine: Any, ce: Any) -> None:
    """DeepSpeed finds model-state files with ``glob`` on the local disk; ours live in ckptlib.
    Replace that one lookup, on this engine instance only, with a match on the tag's files
    (under ZeRO-3, a tag saved at another data-parallel size is read through data-parallel
    rank 0's model-state file, as universal checkpoints are); and wrap this instance's
    ``load_checkpoint`` so that it runs inside ``ce.loading_into(engine)`` and caches are
    dropped when it returns."""
    original = type(engine)._get_all_ckpt_names

    def _get_all_ckpt_names(checkpoints_path: str, tag: str) -> list[str]:
        if engine.checkpoint_engine is not ce:
            return original(engine, checkpoints_path, tag)
        ce.forget_views()  # every load_checkpoint re-reads the manifest
        rank0 = engine.load_universal_checkpoint() or ce.reshard(checkpoints_path, str(tag)) is not None
        pattern = engine._get_ckpt_name(
            checkpoints_path, tag, mp_placeholder="*", pp_placeholder="0" if rank0 else None
        )
        want = os.path.basename(pattern)
        names = [
            n for n in ce.list_files(checkpoints_path, str(tag)) if fnmatch.fnmatchcase(n, want)
        ]
        return [ce.token(checkpoints_path, str(tag), n) for n in names]

    engine._get_all_ckpt_names = _get_all_ckpt_names
    load_checkpoint = engine.load_checkpoint

    @functools.wraps(load_checkpoint)
    def load_checkpoint_then_release(*args: Any, **kwargs: Any) -> Any:
        try:
            with ce.loading_into(engine):
                return load_checkpoint(*args, **kwargs)
        finally:
            ce.forget_views()  # never keep a loaded copy of the state alive after the load

    engine.load_checkpoint = load_checkpoint_then_release


def engine_of(engine: Any) -> Any:
    """The ckptlib checkpoint engine installed in ``engine``; ``CheckpointError`` if none."""
    ce = getattr(engine, "checkpoint_engine", None)
    if not isinstance(ce, EngineMixin):
        raise CheckpointError("call ckptlib.integrations.deepspeed.install(engine) first")
    return ce
