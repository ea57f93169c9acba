"""Restore across tiers: candidates from every node's local folder and the persistent tier; each
payload file read from the fastest source that verifies.

:func:`restore` (``CheckpointManager.restore`` with a local tier; every rank, caller's thread)
is the one resume loop, :func:`ckptlib.engine.resume.resume_newest`, given two things:

- the candidates (:func:`candidates`): every rank lists the steps committed in its node's
  folder; the coordinator merges their numbers with the persistent root's, newest first, and
  judges a persistent step only when the resume loop gets that far (it shares candidates in
  batches up to the next committed one), so a restore whose newest step loads judges at most
  one persistent step. A step counts once (``extra``: the local save id and the persistent
  copy's);
- ``attempt(candidate)``, collective, two rounds: each rank verifies the copies its node holds
  (:func:`ckptlib.tiers.sources.holdings`) and reports them with a digest of its manifest;
  round 1, the coordinator has manifests sent to ranks without one (or another one); round 2,
  it checks that every file has a copy somewhere (or the step is persisted; else the step is
  damaged and the loop falls back, together, to an older one), and gives each rank a source
  for each file its load reads and its node lacks: a peer on another node holding a verified
  copy, else the persistent tier (the plans: :mod:`ckptlib.tiers.restore_plan`; the bytes move
  with :func:`ckptlib.tiers.replicas.run_round`). The rank then loads through a read-only
  :class:`ckptlib.tiers.sources.SourceView` (own local > peer copy > persistent) with the
  reader's checksum checks; a copy that fails them sends the rank to the persistent copy before
  the step is given up.

Then :func:`ckptlib.tiers.write_back.write_back` (collective, same thread) puts what each node
lost back into its folder. :func:`step_infos` is ``CheckpointManager.steps`` with a local tier.

Waits: :func:`restore` opens one coordination session (``coord.session("tier restore", ...)``;
opening it needs no meeting) around everything: the topology, the collection of every rank's
local steps, the resume loop and the write-back. Every meeting in it is a :meth:`Session.share`,
:meth:`Session.exchange` or :meth:`Session.consult` (the coordinator gets every rank's report and
answers each rank its own plan), so a rank that is slow but alive (a slow local listing, a slow
disk verifying checksums) is waited for up to the restore's ``timeout`` per wait, while a dead
or frozen one fails the others within the coordination timeout; its coordinator leaves last,
so the last verdict never vanishes with its process. The bulk bytes stay on gloo; their wait is
:func:`ckptlib.tiers.replicas.round_timeout`.

"Files" are every file :func:`ckptlib.tiers.inventory.step_files` lists: payloads and, format
v2, the ranks' piece index files (verified by size and checksum, then used to verify the
payloads of their rank).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ckptlib.backends import Storage, join
from ckptlib.coord.coordinator import Coordinator
from ckptlib.coord.session import Session
from ckptlib.engine import load as load_flow
from ckptlib.engine.resume import Candidate, missing_step, resume_newest
from ckptlib.engine.scan import StepInfo, newest_committed, read_capped, step_judges
from ckptlib.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
)
from ckptlib.format import layout
from ckptlib.format.manifest import MANIFEST_NAME
from ckptlib.tiers.inventory import (
    local_save_id,
    local_steps,
)
from ckptlib.tiers.local import LocalTier
from ckptlib.tiers.replicas import round_timeout, run_round
from ckptlib.tiers.restore_plan import answers, needs, plan_files, plan_manifests
from ckptlib.tiers.sources import SourceView, all_files, holdings
from ckptlib.tiers.write_back import write_back

log = logging.getLogger("ckptlib")
T = TypeVar("T")


def candidates(tier: LocalTier, persistent: Storage, held: list[dict[int, str]], step: int | None = None
               ) -> Iterator[Candidate]:
    """Coordinator: every step of either tier (``step``: that one only), newest first, each
    persistent step judged (manifest and sizes) only when the caller iterates that far, so a
    restore whose newest step loads judges at most one persistent step. ``held``: each rank's
    :func:`local_steps`. A step committed on the persistent tier is its candidate, else the local
    one. ``extra``: ``save_id`` (the local save), ``persistent`` (the persistent copy's save id,
    or None). The persistent root is listed at the first step asked for; when it cannot be
    (the persistent tier is down), the local steps alone are the candidates, if there are any."""
    local: dict[int, Counter[str]] = {}
    for mine in held:
        for n, sid in mine.items():
            local.setdefault(int(n), Counter())[sid] += 1
    try:
        judges = dict(_unless_down(lambda: step_judges(persistent), persistent, bool(local)) or ())
    except CheckpointNotFoundError:
        judges = {}
    for n in sorted(judges.keys() | local.keys(), reverse=True):
        if step is None or n == step:
            info = next(iter(judges[n]()), None) if n in judges else None  # None: an empty folder
            if info is not None or n in local:
                yield _candidate(n, info, local.get(n))


def _candidate(step: int, info: StepInfo | None, ids: Counter[str] | None) -> Candidate:
    """:func:`candidates`' one for ``step``: ``info``, the persistent tier's first entry of it
    (committed first), or ``ids``, the local saves of it (the most held wins)."""
    if info is not None and info.status == "committed" and info.manifest is not None:
        return Candidate(step, layout.step_dir(step), "committed", "",
                         {"save_id": local_save_id(info.manifest), "persistent": info.save_id})
    if info is not None and (info.status == "committed" or ids is None):
        return Candidate(step, layout.step_dir(step), info.status, info.reason, None)
    assert ids is not None
    return Candidate(step, layout.step_dir(step), "committed", "",
                     {"save_id": ids.most_common(1)[0][0], "persistent": None})


def restore(tier: LocalTier, persistent: Storage, state: Any, coord: Coordinator, *, step: int | None = None,
            verify: bool = True, per_rank: str = "error", timeout: float = 600.0, strict: bool = True,
            keys: dict[str, list[str]] | None = None) -> int | None:
    """``CheckpointManager.restore`` with a local tier (module docstring). Every rank.
    ``strict``/``keys``: as :func:`ckptlib.engine.resume.restore`."""
    with coord.session("tier restore", coord.deadline(timeout)) as s:  # every meeting below, write-back included
        return _restore(tier, persistent, state, s, step=step, verify=verify, per_rank=per_rank,
                        timeout=timeout, strict=strict, keys=keys)


def _restore(tier: LocalTier, persistent: Storage, state: Any, s: Session, *, step: int | None,
             verify: bool, per_rank: str, timeout: float, strict: bool, keys: dict[str, list[str]] | None,
             ) -> int | None:
    topo = tier.topo(s, timeout)
    mine = {str(n): sid for n, sid in local_steps(tier.storage).items()}
    held: list[dict[str, str]] = []

    def keep(steps: list[dict[str, str]]) -> list[None]:  # coordinator: for listing()
        held[:] = steps
        return [None] * len(steps)

    s.consult(mine, keep, deadline=s.now() + timeout)

    def listing() -> Iterator[Candidate]:
        return candidates(tier, persistent, [{int(n): sid for n, sid in h.items()} for h in held], step)

    def deadline() -> float:
        return s.now() + timeout

    def attempt(c: Candidate) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        extra = c.extra or {}
        pers_id = extra.get("persistent")
        where = f"{c.folder} (tiers)"
        have, mdata, files = holdings(tier.storage, c.folder, str(extra.get("save_id")), verify)
        report = {"held": sorted(have), "msize": len(mdata) if mdata is not None else 0,
                  "mdigest": None if mdata is None else hashlib.blake2b(mdata, digest_size=16).hexdigest()}
        # Round 1: is the step whole somewhere; a manifest for every rank. The coordinator gets
        # every report (a wait on a slow rank lasts while it is alive), each rank its own plan.
        kept: dict[str, Any] = {}  # coordinator: every rank's report, for round 2 and the write-back

        def manifests(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
            kept["reports"] = reports
            return answers(plan_manifests(reports, pers_id is not None))

        plan = s.consult(report, manifests, deadline=deadline())
        if plan["error"]:
            raise CorruptCheckpointError(f"step {c.step} cannot be restored from any tier: {plan['error']}")
        mdata = run_round(s, plan, tier.storage, have, mdata, round_timeout(s, plan, deadline())
                          ).get(MANIFEST_NAME, mdata)
        if mdata is None and pers_id is not None:  # only the persistent copy has a manifest
            try:
                mdata = read_capped(persistent, join(c.folder, MANIFEST_NAME))
            except (CheckpointError, OSError) as e:
                log.warning("ckptlib: cannot read the persistent manifest of step %d: %s", c.step, e)
        # Round 2: the files this rank reads and its node lacks, from peers (else persistent).
        need = needs(mdata, state, s, per_rank, where, tier.storage, c.folder, have)
        sizes = all_files(mdata, where)
        if need is None:  # unknown: every file the manifest names
            need = set(sizes)
        mine = sorted(need - set(have))
        plan = s.consult(mine, lambda needs: answers(plan_files(kept["reports"], needs, topo.nodes,
                                                                  pers_id is not None, sizes or None)),
                         deadline=deadline())
        if plan["error"]:
            raise CorruptCheckpointError(f"step {c.step} cannot be restored from any tier: {plan['error']}")
        fetched = run_round(s, plan, tier.storage, have, mdata, round_timeout(s, plan, deadline()))
        if mdata is None:
            raise CorruptCheckpointError(f"step {c.step}: no readable manifest on any tier")
        view_args: dict[str, Any] = {}
        if pers_id is not None:
            view_args = {"persistent": persistent, "persistent_prefix": pers_id}
        else:
            view_args = {"persistent": None, "persistent_prefix": ""}
        view = SourceView(c.folder, manifest=mdata, local=tier.storage, local_paths=have, fetched=fetched,
                          sizes=sizes, **view_args)
        try:
            load_flow.load_checkpoint(view, c.folder, state, verify=verify, rank=s.rank,
                                      world_size=s.world, per_rank=per_rank, strict=strict, keys=found)
        except CorruptCheckpointError as e:
            if pers_id is None or (not have and not fetched):
                raise
            log.warning("ckptlib: a local or peer copy of step %d is bad (%s); reading the persistent copy", c.step, e)
            load_flow.load_checkpoint(persistent, c.folder, state, verify=verify, rank=s.rank,
                                      world_size=s.world, per_rank=per_rank, strict=strict, keys=found)
        last.update(step=c.step, folder=c.folder, manifest=mdata, have=have, fetched=fetched, reports=kept.get("reports"),
                    node_had=files is not None, persistent=pers_id)
        return found

    last: dict[str, Any] = {}
    got = resume_newest(s, listing, attempt, timeout=timeout, where=f"{tier.storage.url} and {persistent.url}")
    if got is not None and keys is not None:
        keys.update(got.value)
    if got is not None and last.get("step") == got.candidate.step:
        write_back(tier, persistent, s, topo, last, timeout=timeout)
    if got is None and step is not None:
        raise missing_step(step, f"{tier.storage.url} or {persistent.url}",
                           f"ckptlib ls {persistent.url} --local <the local= template>")
    return got.candidate.step if got else None


def newest_step(tier: LocalTier, persistent: Storage) -> int | None:
    """``CheckpointManager.latest_step`` with a local tier (caller's thread): the newer of the
    persistent root's newest committed step (judged newest first, :func:`newest_committed`) and
    this node's newest local one. A persistent tier that cannot be listed is warned about and
    left out while the node holds a step (as :func:`candidates` does for a restore)."""
    local = max(local_steps(tier.storage), default=None)
    persisted = _unless_down(lambda: newest_committed(persistent), persistent, local is not None)
    return max((n for n in (local, persisted) if n is not None), default=None)


def _unless_down(call: Callable[[], T], persistent: Storage, local: bool) -> T | None:
    """``call()`` (a listing of the persistent tier), or None when that tier cannot be listed
    and the node holds steps (``local``), with a warning: the local steps still restore. With
    none, the ``StorageError`` is raised: nothing is known then. :func:`candidates`,
    :func:`newest_step`."""
    try:
        return call()
    except StorageError as e:
        if not local:
            raise
        log.warning("ckptlib: cannot list the persistent tier %s (%s): going by the local tier's steps only "
                    "(a newer step drained there by another job would not be seen)", persistent.url, e)
        return None


def step_infos(tier: LocalTier, persistent: list[StepInfo], drains: dict[int, Any]) -> list[StepInfo]:
    """``CheckpointManager.steps`` with a local tier: the persistent tier's steps and this node's
    locally committed ones, each with ``tiers`` filled in; ``drains``: step -> its latest
    drain ticket (pending/failed show as the persistent status of a step not committed there)."""
    by_step: dict[int, StepInfo] = {}
    out: list[StepInfo] = []
    for i in persistent:
        i.tiers = {"local": None, "persistent": i.status}
        out.append(i)
        if i.step not in by_step or i.status == "committed":
            by_step[i.step] = i
    for step in local_steps(tier.storage):
        info = by_step.get(step)
        if info is None:
            info = StepInfo(step, "committed", path=layout.step_dir(step), tiers={"local": None, "persistent": None})
            by_step[step] = info
            out.append(info)
        assert info.tiers is not None
        info.tiers["local"] = "committed"
        if info.status != "committed":
            info.status, info.reason = "committed", ""
    for step, ticket in dict(drains).items():  # a copy (one C call): the persist thread changes it
        info = by_step.get(step)
        if (info is not None and info.tiers is not None and info.tiers["persistent"] != "committed"
                and ticket.status in ("pending", "failed")):
            info.tiers["persistent"] = ticket.status
    return out
