"""The job's store does not grow with the number of saves (coord/session.py, "Store memory"):
every-step saves on thousands of ranks for weeks must not fill rank 0's memory with spent keys.
Real gloo processes, the real TCPStore hosted by rank 0."""

from __future__ import annotations

from .launch import run


def test_the_job_store_holds_as_many_keys_after_twelve_saves_as_after_three(tmp_path):
    world = 3
    res = run("store_keys", world, tmp_path, {"first": 3, "saves": 12}, timeout=180)
    after_three, after_twelve = res[0]["keys"]
    # Without the deletes each save left about 9 keys per rank (and a few of its own): 9 more
    # saves would add ~200 keys here. What may differ is what is in flight at the count.
    assert after_twelve - after_three <= world, (after_three, after_twelve)
