"""Several flows of one process on the job's one coordinator (ckptlib/coord/turns.py): two
managers saving asynchronously, and restores on the training thread while their saves are in
flight. Real gloo processes, the real TCPStore."""

from __future__ import annotations

from .launch import run


def test_two_async_managers_and_a_restore_between_their_saves(tmp_path):
    # Before, the second manager's save opened a session while the first one's was open on
    # another thread: "a save session is still open on this coordinator" on every rank, at the
    # first step; and had the threads reached the store in another order on another rank, the
    # two saves would have met under each other's keys.
    steps, every = 9, 3
    res = run("two_managers", 2, tmp_path, {"steps": steps, "every": every}, timeout=240)
    for rank, r in enumerate(res):
        # The restore's session meets after both saves handed over before it: the step just
        # saved, not the one before it.
        assert r["restores"] == [[s, True] for s in range(every, steps + 1, every)], (rank, r)
        assert r["last"] == [[steps, True], [steps, True]], (rank, r)


def test_a_wait_inside_an_earlier_session_is_refused_at_once_and_the_save_commits_after_it(tmp_path):
    # A signal handler that saves and waits while the training thread is inside another flow's
    # session (a Megatron load, say): the save cannot meet before that session ends. Before,
    # both waits blocked until the save's deadline (40 s here), then the save failed.
    res = run("wait_inside_session", 2, tmp_path, {}, timeout=240)
    for rank, r in enumerate(res):
        for who in ("handle", "manager", "close"):
            assert "inside 'load'" in r[who] and "would wait for itself" in r[who], (rank, who, r)
        assert r["refused_s"] < 20, (rank, r)  # far below the save's 40 s deadline: not a timing claim
        assert r["done_in_handler"] is False, (rank, r)
        assert r["met"] == [0, 1], (rank, r)  # the interrupted session met as usual afterwards
        assert r["restored"] == [[5, True], [6, True]], (rank, r)
