"""The DeepSpeed ``CheckpointEngine`` that stores through ckptlib (built by :func:`.install`).

One DeepSpeed tag is one ckptlib step holding ``{"files": PerRank({file name: state dict})}``
and, under ZeRO, ``"zero"``: the partition layout (:mod:`.zero`). DeepSpeed calls ``create`` ->
``save`` (per file; held by reference, nothing written) -> ``commit`` (collective: :mod:`.codec`
conversion, then ckptlib's save/commit) on every rank's training thread, so a tag becomes
visible all at once, before DeepSpeed writes ``latest``. ``load(path)`` reads one file's
tensors, checksummed; inside ``engine.load_checkpoint`` (:meth:`EngineMixin.loading_into`) a
tag saved at another data-parallel size is served through :mod:`.reshard`. Tags are found by
:mod:`.tags`; ``deepspeed`` is imported by :func:`engine_class`. Details:
docs/integrations/deepspeed.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ckptlib.backends import open_storage
from ckptlib.coord.coordinator import Coordinator
from ckptlib.engine.load import Merge, resolve_lazy, run_plan
from ckptlib.engine.scan import check_files, check_files_together
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitError,
    UnsupportedValueError,
)
from ckptlib.format.leaves import PerRank
from ckptlib.integrations.deepspeed import zero
from ckptlib.integrations.deepspeed.codec import decode_value, encode_value
from ckptlib.integrations.deepspeed.reshard import OPTIM_FILE, Reshard, open_reshard
from ckptlib.integrations.deepspeed.tags import FORMAT, TagView, open_tag
from ckptlib.manager import CheckpointManager

if TYPE_CHECKING:
    from ckptlib.integrations.deepspeed.resume import ResumeResult

log = logging.getLogger("ckptlib")

_engine_cls: type | None = None

LOAD_TIMEOUT = 600.0
"""Seconds the ranks of a ``load_checkpoint`` wait for each other at its size check (a dead or
frozen rank fails the others within the coordination timeout)."""


def engine_class() -> type:
    """The CheckpointEngine subclass, defined on first use (imports deepspeed)."""
    global _engine_cls
    if _engine_cls is None:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

        _engine_cls = type(
            "CkptlibCheckpointEngine",
            (EngineMixin, CheckpointEngine),
            {"__doc__": EngineMixin.__doc__, "__module__": __name__},
        )
    return _engine_cls


@dataclass(eq=False)
class EngineMixin:
    """DeepSpeed ``CheckpointEngine`` storing through ckptlib (build one with :func:`install`).

    Called by DeepSpeed on the training thread: ``create(info)`` once per tag on every rank,
    ``makedirs``/``save(state_dict, path)`` for the files this rank writes, ``commit(info)`` on
    every rank (collective: the ckptlib save), and ``load(path)`` per file when loading.
    """

    url: str | None
    _: KW_ONLY
    coordinator: Coordinator
    step_fn: Callable[[str], int]
    previous: Any
    """The engine this one replaced (used for files outside a tag folder)."""
    manager_options: dict[str, Any]
    storage_options: dict[str, Any] | None
    engine_ref: Callable[[], Any] = field(default=lambda: None, repr=False)
    """Weak reference to the DeepSpeed engine (its ZeRO layout is saved with every tag)."""
    name: str = field(default="CkptlibCheckpointEngine", init=False)
    last_save_seconds: float = field(default=0.0, init=False)
    last_resume: ResumeResult | None = field(default=None, init=False)
    last_reshard: dict[str, Any] | None = field(default=None, init=False)
    """After a load at another data-parallel size: ``{"tag", "saved_dp", "dp", "bytes_needed",
    "bytes_read"}`` of this rank's rebuilt optimizer-states file (None otherwise)."""
    _managers: dict[str, CheckpointManager] = field(default_factory=dict, init=False, repr=False)
    _info: Any = field(default=None, init=False, repr=False)
    _pending: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _views: dict[tuple[str, str], TagView] = field(default_factory=dict, init=False, repr=False)
    _token_dir: str | None = field(default=None, init=False, repr=False)
    _token_cleanup: weakref.finalize | None = field(default=None, init=False, repr=False)
    _tokens: dict[str, tuple[str, str, str]] = field(default_factory=dict, init=False, repr=False)
    _loaded: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _into: Any = field(default=None, init=False, repr=False)
    _reshards: dict[tuple[str, str], Reshard | None] = field(default_factory=dict, init=False, repr=False)

    # -- roots
    def root_for(self, save_dir: str) -> str:
        """The ckptlib root for a DeepSpeed ``save_dir`` (``url`` when installed with one)."""
        return self.url if self.url is not None else os.path.abspath(os.fspath(save_dir))

    def manager(self, root: str) -> CheckpointManager:
        mgr = self._managers.get(root)
        if mgr is None:
            mgr = self._managers[root] = CheckpointManager(
                root,
                async_save=False,
                coordinator=self.coordinator,
                storage_options=self.storage_options,
                **self.manager_options,
            )
        return mgr

    def _tag_dir(self) -> str | None:
        i = self._info
        return None if i is None else os.path.normpath(os.path.join(i.save_dir, str(i.tag)))

    # -- save side (DeepSpeed's call order: create, makedirs/save..., commit)
    def create(self, info: Any) -> None:
        if self._pending:
            log.warning("ckptlib: dropping %d unsaved DeepSpeed files of an earlier save",
                        len(self._pending))
        self._info = info
        self._pending = {}

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        path = os.fspath(path)
        if self._info is not None and os.path.normpath(path) == self._tag_dir():
            return  # the tag folder lives in ckptlib, not on the local disk
        if "://" not in path:
            os.makedirs(path, exist_ok=True)  # save_dir: DeepSpeed writes `latest` there

    def save(self, state_dict: Any, path: str) -> None:
        tag_dir = self._tag_dir()
        rel = os.path.relpath(os.path.normpath(os.fspath(path)), tag_dir) if tag_dir else ".."
        if rel.startswith("..") or os.sep in rel:
            # Not a checkpoint file (e.g. save_16bit_model's export): DeepSpeed's own engine.
            if self.previous is None:
                raise CheckpointError(
                    f"ckptlib DeepSpeed engine cannot store {path} (outside {tag_dir})"
                )
            self.previous.save(state_dict, path)
            return
        self._pending[rel] = state_dict

    def commit(self, info: Any) -> bool:
        """Collective: write every rank's files as one ckptlib step. Raises ``CommitError`` on
        every rank if any rank failed or died (a rank whose state holds a value that cannot be
        stored raises ``UnsupportedValueError`` itself, the others ``CommitError``, before any
        byte is written). Nothing is visible before this returns."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, {}
        self._info = None
        coord = self.coordinator
        encoded: dict[str, Any] = {}
        error: UnsupportedValueError | None = None
        try:  # before any collective of the save, so that every rank learns of a bad value
            encoded = {name: encode_value(sd, name) for name, sd in pending.items()}
        except UnsupportedValueError as e:
            error = e
        mine = (bool(pending), None if error is None else str(error))
        with coord.session("deepspeed check", coord.deadline(60.0)) as s:  # no save in flight: mgr.save waits
            everyone = s.report(list(mine))
            verdict = s.share(None if everyone is None else {
                "any": any(f for f, _ in everyone),
                "errors": {str(r): msg for r, (_, msg) in enumerate(everyone) if msg},
            })
        if verdict["errors"]:
            if error is not None:
                raise error
            failures = {int(r): msg for r, msg in verdict["errors"].items()}
            detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
            raise CommitError(f"DeepSpeed tag {info.tag!r} was not saved: {detail}", failures)
        if not verdict["any"]:
            return True
        tag = str(info.tag)
        step = self.step_fn(tag)
        meta = {"deepspeed": {"format": FORMAT, "tag": tag, "version": _ds_version()}}
        state: dict[str, Any] = {"files": PerRank(encoded)}
        layout = zero.describe(self.engine_ref())
        if layout is not None:  # the same on every rank (ckptlib's save checks it)
            state["zero"] = layout.to_json()
        mgr = self.manager(self.root_for(info.save_dir))
        mgr.save(step, state, metadata=meta).wait()
        self.last_save_seconds = time.perf_counter() - t0
        return True

    # -- load side
    def load(self, path: str, map_location: Any = None) -> Any:
        """One DeepSpeed file's state dict, read from ckptlib (checksums verified).

        DeepSpeed reads the model-state file twice per ``load_checkpoint`` (once to check the
        model-parallel size, once to use it). The second read of a token path is served from
        a copy of the first one's containers (same tensors), then forgotten.
        """
        again = self._loaded.pop(os.fspath(path), None)
        if again is not None:
            return again
        token = self._tokens.get(os.fspath(path))
        if token is not None:
            load_dir, tag, name = token
        else:
            tag_dir, name = os.path.split(os.path.normpath(os.fspath(path)))
            load_dir, tag = os.path.split(tag_dir)
        view = self.open_tag(load_dir, tag)
        reshard = self.reshard(load_dir, tag)
        if reshard is not None and OPTIM_FILE.match(name):
            sd = reshard.optimizer_states(name)
            self.last_reshard = {"tag": tag, "saved_dp": reshard.saved.dp, "dp": reshard.target.layout.dp,
                                 "bytes_needed": reshard.stats["bytes_needed"],
                                 "bytes_read": reshard.stats["bytes_read"]}
        else:
            sd = self._read_file(view, tag, name)
            if reshard is not None:
                reshard.model_states(name, sd)
        if (
            isinstance(map_location, str | torch.device)
            and torch.device(map_location).type != "cpu"
        ):
            sd = _to_device(sd, torch.device(map_location))
        if token is not None:
            self._loaded = {os.fspath(path): _copy_containers(sd)}
        return sd

    def _read_file(self, view: TagView, tag: str, name: str) -> Any:
        """One saved file's state dict, as saved."""
        node = view.files.get(name)
        if node is None:
            raise CheckpointNotFoundError(
                f"{name} is not part of DeepSpeed tag {tag!r} (ckptlib step {view.step} at "
                f"{view.storage.url}); it has: {sorted(view.files)}"
            )
        where = f"{view.storage.url.rstrip('/')}/{view.folder} [{name}]"
        plan = Merge(view.manifest, where=where)
        value = plan.fresh(node)
        run_plan(plan, view.storage, view.folder, view.manifest, verify=True)
        return decode_value(resolve_lazy(value), where)

    @contextlib.contextmanager
    def loading_into(self, engine: Any) -> Iterator[None]:
        """While DeepSpeed's ``load_checkpoint`` of ``engine`` runs (wrapped by
        :func:`.install`): :meth:`load` serves tags saved at another data-parallel size as
        this rank's files at ``engine``'s size. Outside it, files load as saved."""
        self._into, self.last_reshard = engine, None
        try:
            yield
        finally:
            self._into = None
            self._reshards.clear()

    def reshard(self, load_dir: str, tag: str) -> Reshard | None:
        """The :class:`.reshard.Reshard` serving ``tag`` to the engine being loaded (None:
        outside :meth:`loading_into`, or the tag loads as saved). Cached per load."""
        if self._into is None:
            return None
        key = (self.root_for(load_dir), tag)
        if key not in self._reshards:
            into = self._into
            self._reshards[key] = open_reshard(self.open_tag(load_dir, tag), lambda: zero.target(into))
        return self._reshards[key]

    def token(self, load_dir: str, tag: str, name: str) -> str:
        """A local, empty file standing for DeepSpeed file ``name`` of ``tag``.

        DeepSpeed's model-state loader asserts ``os.path.exists`` on the paths it is given,
        and ours are not on the local disk. The engine's ``_get_all_ckpt_names`` (patched by
        :func:`install`) hands out these tokens instead, and :meth:`load` maps a token back.
        They live in a private temporary folder, never in the user's checkpoint folders, which
        :meth:`forget_views` removes at the end of every ``load_checkpoint`` (and this engine's
        finalizer, at the latest, at interpreter exit).
        """
        if self._token_dir is None:
            self._token_dir = tempfile.mkdtemp(prefix="ckptlib-deepspeed-")
            self._token_cleanup = weakref.finalize(self, shutil.rmtree, self._token_dir, True)
        folder = os.path.join(self._token_dir, str(len(self._tokens)))
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
        open(path, "wb").close()
        self._tokens[path] = (os.fspath(load_dir), tag, name)
        return path

    def list_files(self, load_dir: str, tag: str) -> list[str]:
        return sorted(self.open_tag(load_dir, tag).files)

    def open_tag(self, load_dir: str, tag: str) -> TagView:
        """The committed ckptlib step holding DeepSpeed ``tag`` (cached until the next
        ``load_checkpoint``). Raises ``CheckpointNotFoundError`` or ``CorruptCheckpointError``.

        Inside ``load_checkpoint`` (:meth:`loading_into`), which every rank runs together and
        which opens its tag on every rank in the same order, the payload files' sizes are checked
        by the coordinator alone and its verdict shared (:func:`check_files_together`): a load of
        N ranks asks N sizes, not N². Outside it (a single rank's ``load``), this rank checks them.
        """
        root = self.root_for(load_dir)
        key = (root, tag)
        view = self._views.get(key)
        if view is None:
            check = check_files if self._into is None else functools.partial(
                check_files_together, self.coordinator, label="deepspeed load", timeout=LOAD_TIMEOUT)
            view = self._views[key] = open_tag(open_storage(root, self.storage_options), tag, check)
        return view

    def forget_views(self) -> None:
        """Start and end of every ``load_checkpoint``: drop cached manifests, loaded state
        dicts and the tokens with their folder (a process that is killed or leaves with
        ``os._exit`` after a load leaves nothing in the temporary folder)."""
        self._views.clear()
        self._loaded.clear()
        self._reshards.clear()
        self._tokens.clear()
        if self._token_cleanup is not None:
            self._token_cleanup()  # removes the folder once; the next token makes a new one
            self._token_cleanup = self._token_dir = None

    # -- the rest of DeepSpeed's interface
    def is_decoupled(self) -> bool:
        return False

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed then skips its defensive clones before save()

    def cleanup(self) -> None:
        for mgr in self._managers.values():
            mgr.close()
        self._managers.clear()


def _ds_version() -> str:
    try:
        import deepspeed

        return str(deepspeed.__version__)
    except Exception:  # pragma: no cover
        return "unknown"


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = _to_device(v, device)
        return x
    if isinstance(x, list):
        return [_to_device(v, device) for v in x]
    if isinstance(x, tuple) and type(x) is tuple:
        return tuple(_to_device(v, device) for v in x)
    return x


def _copy_containers(x: Any) -> Any:
    """A copy of the dicts/lists/tuples of ``x`` holding the same tensors and values."""
    if isinstance(x, dict):
        out = type(x)((k, _copy_containers(v)) for k, v in x.items())
        if hasattr(x, "_metadata"):
            out._metadata = x._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(x, list):
        return [_copy_containers(v) for v in x]
    if type(x) is tuple:
        return tuple(_copy_containers(v) for v in x)
    return x

