"""The plan of a save (format v1 and v2): which rank writes which piece.

Called by :func:`ckptlib.engine.save.write_state` (every rank, collective, on the save's thread,
after :meth:`~ckptlib.engine.save.SaveSession.begin` and before any write):
:func:`plan_items` puts up what this rank holds (:func:`_offer_v1` or :func:`_offer_v2`), the
coordinator assigns (:func:`ckptlib.plan.assign.assign`) and answers each rank its items.
:func:`describe_item` is also the coordinator's grid proposal input (:func:`~ckptlib.engine.save.persist`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptlib.coord.session import detail
from ckptlib.engine import wire
from ckptlib.format.dtypes import dtype_name
from ckptlib.plan.assign import NAMED, PieceDesc, PlanError, assign, difference, digest
from ckptlib.plan.flatten import TensorItem
from ckptlib.plan.grid import conform, describe, propose

if TYPE_CHECKING:
    from ckptlib.engine.save import SaveSession


def describe_item(it: TensorItem) -> PieceDesc:
    """What a rank tells the others about one of its pieces (name, where it sits in its global
    tensor, shape, bytes, dtype): no tensor data. Persist thread, every rank: built for the plan's
    offer (:func:`plan_items`) and for the grid proposal (``engine.save.persist``)."""
    t = it.tensor
    return PieceDesc(it.name, it.global_offset, tuple(t.shape), t.numel() * t.element_size(),
                     dtype_name(t.dtype), it.global_shape)


@dataclass(slots=True)
class _Offer:
    """What the ranks put up for assignment (:func:`_offer_v1` or :func:`_offer_v2`), for
    :func:`plan_items`. Coordinator-only fields are None elsewhere."""

    everyone: list[Any] | None
    """Coordinator: per rank ``(replica digest, replicated pieces (rank 0 only), ...)``."""
    explicit: list[list[PieceDesc]] | None
    """Coordinator: per rank, its sharded pieces to assign (sent piece by piece)."""
    mine: list[int]
    """This rank's entries in ``explicit``, as positions in its sharded items."""
    grid: list[TensorItem]
    """v2: this rank's sharded items written as its own grid cells (never gathered)."""
    base_load: list[int] | None = None
    """Coordinator, v2: bytes each rank writes as grid cells (balanced against)."""
    proposal: Any = None
    """v2: the agreed grid proposal (:mod:`ckptlib.plan.grid`)."""
    union: frozenset[str] = frozenset()
    """v2: the sharded tensors that are not a grid (their pieces are ``explicit``)."""
    staged: dict[int, str] | None = None
    """Coordinator: node leaders that could not open their staging folder (rank -> why)."""


def _offer_v1(save: SaveSession, rep_desc: list[PieceDesc], shd_desc: list[PieceDesc]) -> _Offer:
    """Format v1: every sharded piece is reported (one report)."""
    s = save.session
    sent = s.report([digest(rep_desc), wire.pieces_out(rep_desc) if s.is_coordinator else None,
                     wire.pieces_out(shd_desc), save.stage_error], deadline=save.deadline, hold=True)
    everyone = None if sent is None else [[d, wire.pieces_in(r or []), wire.pieces_in(x)] for d, r, x, _e in sent]
    staged = None if sent is None else {r: e for r, (_d, _r, _x, e) in enumerate(sent) if e}
    return _Offer(everyone, [e[2] for e in everyone] if everyone is not None else None, list(range(len(shd_desc))), [],
                  staged=staged)


def _offer_v2(save: SaveSession, shd: list[TensorItem], rep_desc: list[PieceDesc],
              shd_desc: list[PieceDesc]) -> _Offer:
    """Format v2: sharded tensors that form a grid with cell ``k`` on rank ``k`` are agreed on
    with :mod:`ckptlib.plan.grid`: the coordinator's proposal (shared with the save's opening,
    :meth:`SaveSession.begin`), each rank's exceptions reported with its replicated digest. The
    pieces of the tensors that are not a grid (their union) are asked for only when there are
    any (:func:`plan_items`, one more report)."""
    s = save.session
    raw = save.proposal if save.proposal is not None else s.share(
        wire.proposal_out(propose(shd_desc)) if s.is_coordinator else None, deadline=save.deadline)
    proposal = wire.proposal_in(raw)
    odd = conform(proposal, shd_desc, s.rank)
    odd_set = set(odd)
    grid_bytes = sum(d.nbytes for d in shd_desc if d.name not in odd_set)
    sent = s.report([digest(rep_desc), wire.pieces_out(rep_desc) if s.is_coordinator else None, odd, grid_bytes,
                     save.stage_error], deadline=save.deadline, hold=True)
    everyone = None if sent is None else [[d, wire.pieces_in(r or []), o, g] for d, r, o, g, _e in sent]
    staged = None if sent is None else {r: e for r, (*_x, e) in enumerate(sent) if e}
    union = frozenset().union(*(e[2] for e in everyone)) if everyone is not None else frozenset()
    return _Offer(everyone, [[]] * s.world, [], [], [e[3] for e in everyone] if everyone is not None else None,
                  proposal, union, staged)


def plan_items(save: SaveSession, items: list[TensorItem]) -> list[TensorItem]:
    """Every rank (collective): this rank's items -- replicas deduplicated, bytes balanced
    (the coordinator plans) -- and, format v2 (``save.v2``), on the coordinator
    ``save.layout`` (every tensor's sharding for the v2 manifest). What is put up for
    assignment differs by format (:func:`_offer_v1`, :func:`_offer_v2`); the assignment and
    its distribution (one :meth:`Session.answer_each`) are one. Format v2 with tensors that are
    not a grid: the first answer names them ("more"), every rank reports their pieces, and a
    second answer carries the plans. Raises :class:`CommitError` on every rank when planning
    fails or a node leader could not open its staging folder."""
    s = save.session
    if s.world <= 1:
        if save.v2:
            save.layout = describe([], set(), [], [], [(0, describe_item(it)) for it in items])
        return items
    rep = [it for it in items if it.replicated]
    shd = [it for it in items if not it.replicated]
    rep_desc = [describe_item(it) for it in rep]
    shd_desc = [describe_item(it) for it in shd]
    offer = _offer_v2(save, shd, rep_desc, shd_desc) if save.v2 else _offer_v1(save, rep_desc, shd_desc)

    def plans() -> list[Any]:
        everyone, explicit = offer.everyone, offer.explicit
        assert everyone is not None and explicit is not None
        try:
            if offer.staged:
                raise PlanError(detail(offer.staged))
            got = assign(everyone[0][1], [e[0] for e in everyone], explicit, offer.base_load)
            if save.v2:
                writer = [0] * len(rep_desc)
                for r, p in enumerate(got):
                    for i in p.replicated:
                        writer[i] = r
                chosen = [(r, explicit[r][i]) for r, p in enumerate(got) for i in p.sharded]
                save.layout = describe(offer.proposal, set(offer.union), everyone[0][1], writer, chosen)
            return [["ok", wire.plan_out(p)] for p in got]
        except PlanError as e:
            failures = {str(r): m for r, m in (offer.staged or {0: str(e)}).items()}
            # The first ranks whose plain tensors differ get rank 0's list, to name them (difference).
            named = set() if offer.staged else set(e.ranks[:NAMED])
            ref = wire.pieces_out(everyone[0][1]) if named else None
            return [["error", failures, ref if r in named else None] for r in range(s.world)]

    first: list[Any] | None = None
    if s.is_coordinator:
        first = [["more", sorted(offer.union)]] * s.world if offer.union and not offer.staged else plans()
    status, sent, *ref = s.answer_each(first, deadline=save.deadline)
    if save.v2:  # which sharded tensors are not a grid: their pieces, written as assigned
        union = set(sent) if status == "more" else set()
        offer.mine = [i for i, d in enumerate(shd_desc) if d.name in union]
        offer.grid = [it for it, d in zip(shd, shd_desc, strict=True) if d.name not in union and all(d.shape)]
        if status == "more":
            got = s.report(wire.pieces_out(shd_desc[i] for i in offer.mine), deadline=save.deadline, hold=True)
            if got is not None:
                offer.explicit = [wire.pieces_in(x) for x in got]
            status, sent, *ref = s.answer_each(plans() if s.is_coordinator else None, deadline=save.deadline)
    if status == "error":
        failures = {int(r): m for r, m in sent.items()}
        if ref and ref[0] is not None and (differs := difference(wire.pieces_in(ref[0]), rep_desc)):
            failures[s.rank] = f"its plain tensors differ from rank 0's: {differs}"
        raise save.plan_failed(failures)
    plan = wire.plan_in(sent)
    return [rep[i] for i in plan.replicated] + offer.grid + [shd[offer.mine[i]] for i in plan.sharded]
