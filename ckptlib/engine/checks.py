"""Checked before trusted: what a save verifies of the state it writes, before it may commit.

Two checks, chosen by :class:`ckptlib.engine.save.SaveOptions`:

- ``nonfinite="refuse"``: a floating-point (or complex) tensor a rank writes holding NaN or Inf
  fails the save on every rank with :class:`NonFiniteError` naming the tensors;
- ``check_replicas=True``: every rank checksums its own copy of every replicated tensor (the
  bytes as saved): plain tensors, and DTensor pieces other ranks hold too (a ``Replicate``
  placement, HSDP), named ``NAME@[offset]``; it reports one digest of the plain ones and one of
  the pieces (with a digest of which pieces it holds) with its "done", and the coordinator
  compares them: the plain digests across all ranks, the piece digests across the ranks
  holding the same pieces; if they differ, every rank reports its checksums (one more meeting, only then)
  and the save fails on every rank with :class:`ReplicaMismatchError` naming the tensors and
  the ranks whose copies disagree with the others'. (``"auto"``: the tier save compares the
  copies it writes on several nodes anyway, ckptlib/tiers/local.py.)

Who calls what: :func:`ckptlib.engine.save.write_state` feeds every round of tensors to
:meth:`StateChecks.see` (the persist thread, after the snapshot) and reports
:meth:`StateChecks.error`; :meth:`ckptlib.engine.save.SaveSession.collect` puts
:meth:`StateChecks.digest` in the report; the coordinator's ``_decide`` compares them
(:func:`digests_agree`) and, on a mismatch, every rank's ``finish`` runs the follow-up with
:func:`mismatches`. Nothing of a failed step is committed, so retention (which runs only after a
commit) never removes a good step because of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from ckptlib.errors import NonFiniteError
from ckptlib.format.checksum import Hasher
from ckptlib.plan.flatten import TensorItem


def _bytes(t: torch.Tensor) -> Any:
    t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


FLOAT8_SLICE = 1 << 24
"""Elements of a float8 tensor widened to float32 at a time by :func:`all_finite` (64 MiB)."""


def all_finite(t: torch.Tensor) -> bool:
    """Whether the floating-point or complex tensor ``t`` holds no NaN or Inf (:meth:`StateChecks.see`,
    the save's thread). float8 tensors (the 1-byte floats) are widened to float32 a slice at a
    time: torch's ``isfinite`` is not implemented for most of them (float8_e4m3fn, the fnuz
    types) and calls float8_e8m0fnu's NaN (0xFF) finite."""
    if t.element_size() != 1:
        return bool(torch.isfinite(t).all())
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + FLOAT8_SLICE].float()).all())
               for i in range(0, flat.numel(), FLOAT8_SLICE))


class StateChecks:
    """One rank's checks of one save (module docstring). One thread (the save's) feeds it."""

    def __init__(self, nonfinite: str, check_replicas: bool | str, world: int) -> None:
        self.refuse = nonfinite == "refuse"
        self.replicas = check_replicas is True and world > 1
        self.bad: list[str] = []
        self.sums: dict[str, str] = {}
        """Checksum of each replicated tensor as seen so far (a tensor streamed in row pieces,
        engine/snapshot.py, is hashed across its pieces, in row order: the same sum as whole)."""
        self._hashers: dict[str, Hasher] = {}
        self.pieces: set[str] = set()
        """The names in ``sums`` of DTensor pieces (the others are plain tensors)."""

    def see(self, items: Iterable[TensorItem], mine: set[str]) -> None:
        """A round of this rank's tensors; ``mine``: the names it writes."""
        for it in items:
            t = it.tensor
            floating = t.is_floating_point() or t.is_complex()
            if self.refuse and it.name in mine and floating and t.numel() and not all_finite(t):
                self.bad.append(it.name)
            if self.replicas and (it.replicated or it.copies):
                key = it.name if it.replicated else f"{it.name}@{list(it.global_offset)}"
                h = self._hashers.setdefault(key, Hasher())
                h.update(_bytes(t))
                self.sums[key] = h.hexdigest()
                if it.copies:
                    self.pieces.add(key)

    def error(self) -> NonFiniteError | None:
        if not self.bad:
            return None
        names = sorted(set(self.bad))
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        return NonFiniteError(f"tensors hold NaN or Inf: {shown} (nonfinite='refuse'); nothing of this step is "
                              "committed and the previous steps stay")

    def digest(self) -> str | None:
        """What this rank reports (None: not checking): ``PLAIN/HELD/PIECES``, digests of the
        plain tensors' checksums, of which DTensor pieces with copies it holds, and of those
        pieces' checksums (:func:`digests_agree`)."""
        if not self.replicas:
            return None
        pieces = sorted(self.pieces)
        plain = sorted(n for n in self.sums if n not in self.pieces)
        return "/".join([_hash(f"{n}\0{self.sums[n]}" for n in plain), _hash(pieces),
                         _hash(f"{n}\0{self.sums[n]}" for n in pieces)])


def _hash(parts: Iterable[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p.encode() + b"\0")
    return h.hexdigest()


def digests_agree(digests: list[str | None]) -> bool:
    """Coordinator: whether every rank's :meth:`StateChecks.digest` agrees: the plain tensors
    across all ranks, the DTensor pieces across the ranks that hold the same pieces."""
    got = [d.split("/") for d in digests if d is not None]
    by_held: dict[str, set[str]] = {}
    for _, held, pieces in got:
        by_held.setdefault(held, set()).add(pieces)
    return len({plain for plain, _, _ in got}) <= 1 and all(len(v) == 1 for v in by_held.values())


def mismatches(sums: list[dict[str, str]]) -> dict[int, str]:
    """Coordinator, with every rank's checksums (rank order): rank -> why, for the ranks whose
    copy of some tensor differs from the copy most ranks hold (the message names the tensors).
    Where no copy is held by more ranks than every other (two ranks, or a 2:2 split), no copy
    can be trusted: every rank holding one of them is named, and told so."""
    out: dict[int, list[str]] = {}
    split: set[int] = set()
    for name in sorted({n for s in sums for n in s}):
        groups: dict[str, list[int]] = {}
        for r, s in enumerate(sums):
            if name in s:
                groups.setdefault(s[name], []).append(r)
        if len(groups) < 2:
            continue
        ranked = sorted(groups.values(), key=len, reverse=True)
        major = ranked[0] if len(ranked[0]) > len(ranked[1]) else None
        for ranks in ranked:
            if ranks is not major:
                for r in ranks:
                    out.setdefault(r, []).append(name)
                    if major is None:
                        split.add(r)
    return {r: f"ReplicaMismatchError: its copy of {', '.join(names[:10])} differs from the other ranks' "
               + ("(no copy is held by a majority of the ranks: any of them may be the faulty one; "
                  if r in split else "(")
               + "a silent fault in a data-parallel replica?)" for r, names in out.items()}
