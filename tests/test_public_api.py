"""The public surface: ``ckptlib.__all__`` holds every name of API.md, and every public name,
and every public method or property of a public class, has a docstring (``help()`` and IDEs
show it to users)."""

from __future__ import annotations

import inspect

import ckptlib

API_NAMES = {  # /work/shared/API.md, Python sections
    "save", "load", "open", "CheckpointManager", "Shard", "PerRank", "CheckpointError",
    "CheckpointNotFoundError", "CorruptCheckpointError", "CommitError", "ReplicaMismatchError",
    "NonFiniteError",
}


def test_all_holds_the_api_names_and_each_resolves() -> None:
    assert set(ckptlib.__all__) >= API_NAMES
    assert all(getattr(ckptlib, name) is not None for name in ckptlib.__all__)


def test_every_public_name_and_method_has_a_docstring() -> None:
    missing = []
    for name in ckptlib.__all__:
        obj = getattr(ckptlib, name)
        if name == "__version__":
            continue
        if not (obj.__doc__ or "").strip():
            missing.append(name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr, member in vars(obj).items():
                fn = member.fget if isinstance(member, property) else member
                if attr.startswith("_") or not (inspect.isfunction(fn) or isinstance(member, property)):
                    continue
                if not (fn.__doc__ or "").strip():
                    missing.append(f"{name}.{attr}")
    assert missing == []
