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
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import enum
import fnmatch
import functools
import heapq
import importlib
import logging
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptlib.backends import Storage, open_storage
from ckptlib.coord.coordinator import Coordinator, default_coordinator
from ckptlib.engine.load import Merge, resolve_lazy, run_plan
from ckptlib.engine.scan import StepInfo, check_files, read_manifest, scan
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommitError,
    CorruptCheckpointError,
    UnsupportedValueError,
)
from ckptlib.format import layout
from ckptlib.format import tree as tree_codec
from ckptlib.format.leaves import PerRank
from ckptlib.format.manifest import Manifest
from ckptlib.manager import CheckpointManager

log = logging.getLogger("ckptlib")

FORMAT = "ckptlib.deepspeed/1"
"""Written into every step's metadata (``{"deepspeed": {"format": FORMAT, "tag": ...}}``)."""

MARK = "__ckptlib_deepspeed__"
"""Key of the marker dicts that encode non-JSON values (see :func:`encode_value`)."""

_TAG_STEP = re.compile(r"^global_step(\d+)$")

# ---------------------------------------------------------------------------------------------
# Non-JSON values: a small, explicit conversion scheme (no pickle, ever)
# ---------------------------------------------------------------------------------------------

_DEFAULT_TYPES = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
_registered: dict[str, type] = {}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_type(cls: type) -> type:
    """Allow instances of ``cls`` in saved state dicts (e.g. in ``client_state``).

    Enums are stored by member name; other classes by their ``__dict__``, whose values must
    themselves be storable. On load the instance is rebuilt with ``cls.__new__(cls)`` and its
    ``__dict__`` updated (``__init__`` is not called). Register on every process that loads,
    before loading. Returns ``cls`` (usable as a class decorator).
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_type needs a class, got {cls!r}")
    _registered[_qualname(cls)] = cls
    return cls


def _resolve_type(name: str, where: str) -> type:
    cls = _registered.get(name)
    if cls is not None:
        return cls
    if name in _DEFAULT_TYPES:
        module, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise CheckpointError(
                f"{where}: cannot import {name} to rebuild a saved value: {e}"
            ) from None
        if isinstance(cls, type):
            _registered[name] = cls
            return cls
    raise CorruptCheckpointError(
        f"saved value of type {name!r} is not allow-listed; refusing to build it "
        "(register the class with ckptlib.integrations.deepspeed.register_type if you trust it)",
        where,
    )


def _allowed(cls: type) -> bool:
    name = _qualname(cls)
    return name in _registered or name in _DEFAULT_TYPES


def encode_value(x: Any, path: str = "") -> Any:
    """A DeepSpeed state dict -> a tree ckptlib can store (tensors kept as they are).

    Called by the checkpoint engine's ``commit`` for every file. Plain dicts/lists/tuples and
    JSON scalars, bytes, ``torch.dtype`` and tensors pass through; the other supported types
    become ``{MARK: kind, ...}`` dicts (a user dict that has the key ``MARK`` itself is wrapped
    too, so decoding is unambiguous). Raises ``UnsupportedValueError`` naming ``path``.
    """
    cls = type(x)
    if (
        isinstance(x, torch.Tensor)
        or x is None
        or cls in (bool, int, float, str, bytes, torch.dtype)
    ):
        return x
    if cls.__module__ == "numpy" and hasattr(x, "item") and getattr(x, "ndim", None) == 0:
        return encode_value(x.item(), path)  # numpy scalars: stored as Python numbers
    if cls is dict:
        if MARK in x:
            return {
                MARK: "dict",
                "items": [[k, encode_value(v, f"{path}/{k}")] for k, v in x.items()],
            }
        return {_key(k, path): encode_value(v, f"{path}/{k}") for k, v in x.items()}
    if cls is list:
        return [encode_value(v, f"{path}/{i}") for i, v in enumerate(x)]
    if cls is tuple:
        return tuple(encode_value(v, f"{path}/{i}") for i, v in enumerate(x))
    if cls is torch.Size:
        return {MARK: "size", "v": list(x)}
    if cls is collections.OrderedDict:
        meta = getattr(x, "_metadata", None)
        return {
            MARK: "odict",
            "items": [[_key(k, path), encode_value(v, f"{path}/{k}")] for k, v in x.items()],
            "meta": None if meta is None else encode_value(meta, f"{path}/_metadata"),
        }
    if cls in (set, frozenset):
        return {MARK: cls.__name__, "v": [encode_value(v, f"{path}/<item>") for v in x]}
    if cls is torch.device:
        return {MARK: "device", "v": str(x)}
    if cls is argparse.Namespace:
        return {MARK: "namespace", "v": encode_value(dict(vars(x)), path)}
    if isinstance(x, enum.Enum) and _allowed(cls):
        return {MARK: "enum", "type": _qualname(cls), "v": x.name}
    if _allowed(cls) and hasattr(x, "__dict__"):
        return {MARK: "object", "type": _qualname(cls), "v": encode_value(dict(vars(x)), path)}
    raise UnsupportedValueError(
        f"cannot save {_qualname(cls)} at {path or '<root>'} through ckptlib (no pickle): convert it "
        "to tensors/JSON-typed values, or allow it with "
        "ckptlib.integrations.deepspeed.register_type(cls)"
    )


def _key(k: Any, path: str) -> Any:
    if type(k) is str or (type(k) is int):
        return k
    raise UnsupportedValueError(
        f"dict key {k!r} at {path or '<root>'} must be str or int to be saved without pickle"
    )


def decode_value(x: Any, where: str = "") -> Any:
    """Inverse of :func:`encode_value` on a loaded tree. Raises ``CorruptCheckpointError``
    for malformed markers or types that are not allow-listed."""
    if isinstance(x, dict):
        kind = x.get(MARK)
        if kind is None:
            return {k: decode_value(v, where) for k, v in x.items()}
        try:
            return _decode_marker(kind, x, where)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"malformed {kind!r} value: {type(e).__name__}: {e}", where
            ) from None
    if isinstance(x, list):
        return [decode_value(v, where) for v in x]
    if isinstance(x, tuple):
        return tuple(decode_value(v, where) for v in x)
    return x


def _decode_marker(kind: Any, x: dict[str, Any], where: str) -> Any:
    if kind == "dict":
        return {k: decode_value(v, where) for k, v in x["items"]}
    if kind == "odict":
        od = collections.OrderedDict((k, decode_value(v, where)) for k, v in x["items"])
        if x.get("meta") is not None:
            od._metadata = decode_value(x["meta"], where)  # type: ignore[attr-defined]
        return od
    if kind == "size":
        return torch.Size([int(v) for v in x["v"]])
    if kind == "set":
        return {decode_value(v, where) for v in x["v"]}
    if kind == "frozenset":
        return frozenset(decode_value(v, where) for v in x["v"])
    if kind == "device":
        return torch.device(str(x["v"]))
    if kind == "namespace":
        return argparse.Namespace(**decode_value(x["v"], where))
    if kind == "enum":
        cls = _resolve_type(str(x["type"]), where)
        if not issubclass(cls, enum.Enum):
            raise CorruptCheckpointError(f"{x['type']} is not an Enum", where)
        return cls[str(x["v"])]
    if kind == "object":
        cls = _resolve_type(str(x["type"]), where)
        attrs = decode_value(x["v"], where)
        if not isinstance(attrs, dict) or not all(isinstance(k, str) for k in attrs):
            raise CorruptCheckpointError(
                f"attributes of {x['type']} must be a dict with str keys", where
            )
        obj = cls.__new__(cls)
        obj.__dict__.update(attrs)
        return obj
    raise CorruptCheckpointError(f"unknown value kind {kind!r}", where)


# ---------------------------------------------------------------------------------------------
# The checkpoint engine
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _TagView:
    """One committed step opened for loading: manifest, decoded tree and file index."""

    storage: Storage
    folder: str
    step: int
    manifest: Manifest
    files: dict[str, Any]
    """DeepSpeed file name -> its decoded (still ckptlib-encoded) subtree."""


@dataclass
class ResumeResult:
    """What :func:`resume` did. ``tag`` is None when there was nothing to resume from."""

    tag: str | None = None
    step: int | None = None
    load_path: str | None = None
    client_state: dict[str, Any] | None = None
    skipped: list[str] = field(default_factory=list)
    """One line per newer step that was not used, with the reason."""


_ENGINE_CLASS: type | None = None


def _engine_class() -> type:
    """The CheckpointEngine subclass, defined on first use (imports deepspeed)."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

        _ENGINE_CLASS = type(
            "CkptlibCheckpointEngine",
            (_EngineMixin, CheckpointEngine),
            {
                "__doc__": _EngineMixin.__doc__,
                "__module__": __name__,
            },
        )
    return _ENGINE_CLASS


class _EngineMixin:
    """DeepSpeed ``CheckpointEngine`` storing through ckptlib (build one with :func:`install`).

    Called by DeepSpeed on the training thread: ``create(info)`` once per tag on every rank,
    ``makedirs``/``save(state_dict, path)`` for the files this rank writes, ``commit(info)`` on
    every rank (collective: the ckptlib save), and ``load(path)`` per file when loading.
    """

    def __init__(
        self,
        url: str | None,
        *,
        coordinator: Coordinator,
        step_fn: Callable[[str], int],
        previous: Any,
        manager_options: dict[str, Any],
        storage_options: dict[str, Any] | None,
    ) -> None:
        self.name = "CkptlibCheckpointEngine"
        self.url = url
        self.coordinator = coordinator
        self.step_fn = step_fn
        self.previous = previous
        """The engine this one replaced (used for files outside a tag folder)."""
        self.manager_options = manager_options
        self.storage_options = storage_options
        self.last_save_seconds = 0.0
        self.last_resume: ResumeResult | None = None
        self._managers: dict[str, CheckpointManager] = {}
        self._info: Any = None
        self._pending: dict[str, Any] = {}
        self._views: dict[tuple[str, str], _TagView] = {}
        self._token_dir: str | None = None
        self._tokens: dict[str, tuple[str, str, str]] = {}
        self._loaded: dict[str, Any] = {}

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
        info = self._info
        return (
            None if info is None else os.path.normpath(os.path.join(info.save_dir, str(info.tag)))
        )

    # -- save side (DeepSpeed's call order: create, makedirs/save..., commit)
    def create(self, info: Any) -> None:
        if self._pending:
            log.warning(
                "ckptlib: dropping %d unsaved DeepSpeed files of an earlier save",
                len(self._pending),
            )
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
        everyone = coord.gather(mine, 60.0)
        verdict = coord.agree(
            None
            if everyone is None
            else {
                "any": any(f for f, _ in everyone),
                "errors": {str(r): msg for r, (_, msg) in enumerate(everyone) if msg},
            },
            60.0,
        )
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
        mgr = self.manager(self.root_for(info.save_dir))
        mgr.save(step, {"files": PerRank(encoded)}, metadata=meta).wait()
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
        sd = decode_value(resolve_lazy(value), where)
        if (
            isinstance(map_location, str | torch.device)
            and torch.device(map_location).type != "cpu"
        ):
            sd = _to_device(sd, torch.device(map_location))
        if token is not None:
            self._loaded = {os.fspath(path): _copy_containers(sd)}
        return sd

    def token(self, load_dir: str, tag: str, name: str) -> str:
        """A local, empty file standing for DeepSpeed file ``name`` of ``tag``.

        DeepSpeed's model-state loader asserts ``os.path.exists`` on the paths it is given,
        and ours are not on the local disk. The engine's ``_get_all_ckpt_names`` (patched by
        :func:`install`) hands out these tokens instead, and :meth:`load` maps a token back.
        They live in a private temporary folder, never in the user's checkpoint folders.
        """
        if self._token_dir is None:
            self._token_dir = tempfile.mkdtemp(prefix="ckptlib-deepspeed-")
            weakref.finalize(self, shutil.rmtree, self._token_dir, True)
        folder = os.path.join(self._token_dir, str(len(self._tokens)))
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
        open(path, "wb").close()
        self._tokens[path] = (os.fspath(load_dir), tag, name)
        return path

    def list_files(self, load_dir: str, tag: str) -> list[str]:
        return sorted(self.open_tag(load_dir, tag).files)

    def open_tag(self, load_dir: str, tag: str) -> _TagView:
        """The committed ckptlib step holding DeepSpeed ``tag`` (cached until the next
        ``load_checkpoint``). Raises ``CheckpointNotFoundError`` or ``CorruptCheckpointError``."""
        root = self.root_for(load_dir)
        key = (root, tag)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = _open_tag(open_storage(root, self.storage_options), tag)
        return view

    def forget_views(self) -> None:
        """Start and end of every ``load_checkpoint``: drop cached manifests, loaded state
        dicts and old tokens."""
        self._views.clear()
        self._loaded.clear()
        for path in self._tokens:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._tokens.clear()

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


def _tag_of(m: Manifest, where: str) -> str | None:
    meta = tree_codec.decode(m.metadata, (), where) if m.metadata is not None else None
    if isinstance(meta, dict) and isinstance(meta.get("deepspeed"), dict):
        tag = meta["deepspeed"].get("tag")
        return tag if isinstance(tag, str) else None
    return None


def _open_tag(storage: Storage, tag: str) -> _TagView:
    where = storage.url.rstrip("/")
    infos: list[StepInfo]
    m_step = _TAG_STEP.match(tag)
    found: tuple[str, int, Manifest] | None = None
    if m_step:  # fast path: the default tag names its step
        folder = layout.step_dir(int(m_step.group(1)))
        try:
            m = read_manifest(storage, folder)
            if m.step == int(m_step.group(1)) and _tag_of(m, f"{where}/{folder}") == tag:
                found = (folder, int(m_step.group(1)), m)
        except CheckpointNotFoundError:
            pass
    if found is None:
        try:
            infos = scan(storage)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(
                f"no ckptlib checkpoints under {where} (looking for tag {tag!r})"
            ) from None
        bad = []
        for info in infos:
            if info.status == "committed" and info.manifest is not None:
                if _tag_of(info.manifest, f"{where}/{info.path}") == tag:
                    found = (info.path, info.step, info.manifest)
                    break
            elif info.status == "corrupt":
                bad.append(f"step {info.step}: {info.reason}")
        if found is None:
            detail = f" (unreadable steps: {'; '.join(bad)})" if bad else ""
            raise CheckpointNotFoundError(
                f"DeepSpeed tag {tag!r} is not a committed ckptlib step under {where}{detail}"
            )
    folder, step, m = found
    check_files(storage, folder, m)
    manifest_where = f"{where}/{folder}/manifest.json"
    tree = tree_codec.decode(m.tree, m.tensors, manifest_where)
    files: dict[str, Any] = {}
    ranks = tree.get("files") if isinstance(tree, dict) else None
    if not isinstance(ranks, tree_codec.PerRankSaved):
        raise CorruptCheckpointError(
            "not a DeepSpeed checkpoint (no per-rank 'files')", manifest_where
        )
    for per_rank in ranks.values:
        if not isinstance(per_rank, dict):
            raise CorruptCheckpointError("per-rank 'files' entry is not a dict", manifest_where)
        for name, node in per_rank.items():
            if name in files:
                raise CorruptCheckpointError(
                    f"file {name!r} saved by more than one rank", manifest_where
                )
            files[name] = node
    return _TagView(storage, folder, step, m, files)


# ---------------------------------------------------------------------------------------------
# install / resume
# ---------------------------------------------------------------------------------------------


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
    every rank calls it once, after ``deepspeed.initialize``, in the same order.

    ``url``: the ckptlib root for every save (any backend: path, ``file://``, ``s3://``,
    ``memory://``); None stores each ``save_dir`` passed to ``save_checkpoint`` as its own
    root (DeepSpeed still writes its ``latest`` hint file there). ``keep_last``/
    ``keep_every``: ckptlib retention. ``step_fn(engine, tag)``: the ckptlib step number of a
    save (default: ``engine.global_steps``); steps must grow for :func:`resume` to pick the
    newest. Returns the new checkpoint engine (also ``engine.checkpoint_engine``); the one it
    replaced is its ``previous`` attribute.
    """
    if url is not None:
        url = os.fspath(url)
        if "://" not in url:
            url = os.path.abspath(url)
    if step_fn is None:

        def step_of(tag: str) -> int:
            return int(engine.global_steps)
    else:

        def step_of(tag: str) -> int:
            return int(step_fn(engine, tag))

    cls = _engine_class()
    ce = cls(
        url,
        coordinator=coordinator or default_coordinator(),
        step_fn=step_of,
        previous=getattr(engine, "checkpoint_engine", None),
        manager_options={
            "keep_last": keep_last,
            "keep_every": keep_every,
            "compression": compression,
            "save_timeout": save_timeout,
        },
        storage_options=storage_options,
    )
    engine.checkpoint_engine = ce
    _patch_names(engine, ce)
    return ce


def _patch_names(engine: Any, ce: Any) -> None:
    """DeepSpeed finds model-state files with ``glob`` on the local disk; ours live in ckptlib.
    Replace that one lookup, on this engine instance only, with a match on the tag's files;
    and wrap this instance's ``load_checkpoint`` so that caches are dropped when it returns."""
    original = type(engine)._get_all_ckpt_names

    def _get_all_ckpt_names(checkpoints_path: str, tag: str) -> list[str]:
        if engine.checkpoint_engine is not ce:
            return original(engine, checkpoints_path, tag)
        ce.forget_views()  # every load_checkpoint re-reads the manifest
        universal = engine.load_universal_checkpoint()
        pattern = engine._get_ckpt_name(
            checkpoints_path, tag, mp_placeholder="*", pp_placeholder="0" if universal else None
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
            return load_checkpoint(*args, **kwargs)
        finally:
            ce.forget_views()  # never keep a loaded copy of the state alive after the load

    engine.load_checkpoint = load_checkpoint_then_release


def _engine_of(engine: Any) -> Any:
    ce = getattr(engine, "checkpoint_engine", None)
    if not isinstance(ce, _EngineMixin):
        raise CheckpointError("call ckptlib.integrations.deepspeed.install(engine) first")
    return ce


def _share(files: list[tuple[str, int]], world: int) -> list[list[int]]:
    """File indices per rank, balanced by bytes (largest first). Same answer on every rank."""
    out: list[list[int]] = [[] for _ in range(world)]
    heap = [(0, r) for r in range(world)]
    for i in sorted(range(len(files)), key=lambda i: (-files[i][1], i)):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + files[i][1], r))
    return out


def _candidates(storage: Storage) -> list[tuple[int, str, str, str, str | None]]:
    """(step, folder, status, reason, tag), newest first. Coordinator only."""
    try:
        infos = scan(storage)
    except CheckpointNotFoundError:
        return []
    out = []
    for i in infos:
        tag = None
        if i.status == "committed" and i.manifest is not None:
            try:
                tag = _tag_of(i.manifest, f"{storage.url}/{i.path}")
            except CorruptCheckpointError as e:
                out.append((i.step, i.path, "corrupt", str(e), None))
                continue
            if tag is None:
                out.append(
                    (
                        i.step,
                        i.path,
                        "corrupt",
                        "not a DeepSpeed checkpoint (no tag in metadata)",
                        None,
                    )
                )
                continue
        out.append((i.step, i.path, i.status, i.reason, tag))
    return out


def newest_consistent(
    engine: Any,
    load_dir: str | os.PathLike[str] | None = None,
    *,
    verify: bool = True,
    timeout: float = 600.0,
) -> tuple[str | None, int | None, list[str]]:
    """``(tag, step, skipped)``: the newest step whose manifest, file sizes and (``verify``)
    every checksum are good, checked on all ranks together. Collective. ``tag`` is None when
    no step exists; raises ``CorruptCheckpointError`` when steps exist but none is usable."""
    ce = _engine_of(engine)
    if load_dir is None and ce.url is None:
        raise ValueError("pass load_dir (or install with a url)")
    root = ce.root_for(os.fspath(load_dir) if load_dir is not None else "")
    storage = open_storage(root, ce.storage_options)
    coord: Coordinator = ce.coordinator
    cands = coord.agree(_candidates(storage) if coord.is_coordinator else None, timeout)
    skipped: list[str] = []
    for step, folder, status, reason, tag in cands:
        if status != "committed":
            skipped.append(f"step {step}: {status}: {reason}")
            log.warning("ckptlib: skipping step %d (%s): %s", step, status, reason)
            continue
        verdict = ("ok", "")
        if verify:
            try:
                m = read_manifest(storage, folder)
                check_files(storage, folder, m)
                from ckptlib.engine.verify import verify_chunks

                mine = _share([(f.path, f.size) for f in m.files], coord.world_size)[coord.rank]
                verify_chunks(storage, folder, m, files=set(mine))
            except CorruptCheckpointError as e:
                verdict = ("corrupt", str(e))
            except CheckpointNotFoundError as e:
                verdict = ("corrupt", f"vanished: {e}")
            except (CheckpointError, OSError) as e:  # storage trouble: every rank raises it
                verdict = ("error", f"{type(e).__name__}: {e}")
            verdicts = [verdict]
            if coord.world_size > 1:
                verdicts = coord.agree(coord.gather(verdict, timeout), timeout)
            errors = [
                f"rank {r}: {msg}" for r, (kind, msg) in enumerate(verdicts) if kind == "error"
            ]
            if errors:
                raise CheckpointError(
                    f"cannot verify step {step} under {root}: " + "; ".join(errors)
                )
            bad = [f"rank {r}: {msg}" for r, (kind, msg) in enumerate(verdicts) if kind != "ok"]
            if bad:
                skipped.append(f"step {step}: corrupt: {'; '.join(bad)}")
                log.warning(
                    "ckptlib: step %d is corrupt, trying an older one: %s", step, "; ".join(bad)
                )
                continue
        return tag, step, skipped
    if any(": corrupt:" in s for s in skipped):
        raise CorruptCheckpointError(
            f"no usable DeepSpeed checkpoint under {root}: " + "; ".join(skipped)
        )
    return None, None, skipped


def resume(
    engine: Any,
    load_dir: str | os.PathLike[str] | None = None,
    *,
    verify: bool = True,
    timeout: float = 600.0,
    **load_checkpoint_kwargs: Any,
) -> ResumeResult:
    """Load the newest consistent tag into ``engine`` (collective; every rank calls it).

    Ignores DeepSpeed's ``latest`` file: the ranks agree on the candidates ckptlib's scan
    finds, deep-verify the newest (each rank checks a byte-balanced share of its files), skip
    it on every rank together if anything is wrong, and only then call
    ``engine.load_checkpoint(load_dir, tag=..., **load_checkpoint_kwargs)``. With
    ``verify=False`` the checksum pass is skipped (the load still verifies what it reads and
    raises on a mismatch, but can no longer fall back). Returns a :class:`ResumeResult`
    (``tag`` None: nothing saved yet, the engine is untouched).
    """
    ce = _engine_of(engine)
    tag, step, skipped = newest_consistent(engine, load_dir, verify=verify, timeout=timeout)
    result = ResumeResult(skipped=skipped)
    if tag is not None:
        ds_dir = os.fspath(load_dir) if load_dir is not None else ce.url
        load_path, client_state = engine.load_checkpoint(ds_dir, tag=tag, **load_checkpoint_kwargs)
        result = ResumeResult(tag, step, load_path, client_state, skipped)
        log.info("ckptlib: resumed DeepSpeed tag %s (step %d)", tag, step)
    ce.last_resume = result
    return result
