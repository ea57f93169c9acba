"""The tests' multi-process launcher (tests/launcher.py) reports what each rank left behind.

A rank that dies while writing its result file leaves it empty or torn. ``finish`` then
reports no result for it and adds a line to its output naming the file, its size and the
exit status, so the test that reads it fails with the rank's output and not with a
``JSONDecodeError`` raised inside the harness (seen once in ``make chaos``:
random_kill case5's final job, rank 0).
"""

from __future__ import annotations

from pathlib import Path

import launcher

WRITE = "import json, sys; open(sys.argv[1], 'w').write(sys.argv[2])"


def test_whole_torn_and_missing_result_files(tmp_path: Path) -> None:
    texts = {0: '{"ok": 1}', 1: "", 2: '{"ok": '}  # rank 3 writes nothing

    def argv(rank: int, port: str) -> list[str]:
        if rank == 3:
            return ["-c", "print('no result from rank 3')"]
        return ["-c", WRITE, str(tmp_path / f"r{rank}.json"), texts[rank]]

    procs = launcher.start(argv, 4)
    out = launcher.finish("torn", procs, lambda r: tmp_path / f"r{r}.json", timeout=120)
    assert [o.returncode for o in out] == [0, 0, 0, 0]
    assert out[0].result == {"ok": 1}
    assert out[1].result is None and "r1.json is not JSON (0 bytes; exit 0)" in out[1].log
    assert out[2].result is None and "r2.json is not JSON (7 bytes; exit 0)" in out[2].log
    assert out[3].result is None and "no result from rank 3" in out[3].log and "is not JSON" not in out[3].log
