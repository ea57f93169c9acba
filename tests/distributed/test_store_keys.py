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


def test_managers_with_a_local_tier_made_and_closed_in_one_process_leave_nothing_behind(tmp_path):
    # Each manager with a local tier makes a drain coordinator (a store connection, a worker
    # thread on the ranks that do not host the store, a meeting key). Before, none was
    # released at close, and a rank's worker held the coordinator alive: every manager made and
    # closed left a thread and a connection per rank and 3 keys in the job's store, for good.
    world = 2
    res = run("tier_managers", world, tmp_path, {"first": 2, "managers": 6}, timeout=240)
    for rank, r in enumerate(res):
        after_two, after_six = r["counts"]
        assert after_six["threads"] == after_two["threads"], (rank, after_two, after_six)
        assert after_six["fds"] == after_two["fds"], (rank, after_two, after_six)
    after_two, after_six = res[0]["counts"]
    assert after_six["keys"] - after_two["keys"] <= world, (after_two, after_six)


def test_failed_saves_leave_no_key_behind(tmp_path):
    # A save that fails ends its session with the coordinator's "abort" key, which the other
    # ranks' waits watch. Before, nobody deleted it: a job whose saves failed for a day (a
    # storage outage, every-step saves) left one key per failed save in the job's store.
    world = 2
    res = run("failed_saves", world, tmp_path, {"failures": 12}, timeout=240)
    assert [r["failed"] for r in res] == [12, 12]
    first, after_two, after_all = res[0]["keys"]
    assert after_all - after_two <= world, (first, after_two, after_all)  # not one per failed save
    assert after_all - first <= world, (first, after_two, after_all)
