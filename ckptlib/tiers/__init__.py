"""Tiers: a node-local fast tier in front of the persistent tier (docs/tiers.md).

Who calls what (all from :class:`ckptlib.CheckpointManager` when it is given ``local=``):

- :mod:`.node`: which node a rank is on, and where replicas go (peer placement);
- :mod:`.local`: the save, on the manager's persist thread: one :class:`SaveSession` against
  the node-local storage, every node's folder committed with the same manifest, replicas made
  durable on peers first (:mod:`.replicas`); local retention;
- :mod:`.drain`: the background copy of a locally committed step to the persistent tier and its
  commit there (the manager's drain thread);
- :mod:`.restore`: candidates from every tier and the sources of each payload file, for the one
  resume loop (:func:`ckptlib.engine.resume.resume_newest`).
"""
