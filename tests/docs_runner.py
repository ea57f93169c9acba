"""Runs doc examples for ``tests/test_docs_examples.py``, in a fresh Python process.

Called as ``python docs_runner.py BLOCKS.json RESULTS.json`` by the test (one process per doc
file, or one per rank for a block marked ``ranks=N``, started through tests/launcher.py).
Each block runs in its own globals and its own empty working folder, in document order; a
block that raises (or exits with a code other than 0) is recorded with its traceback and the next block still runs. The results
file is a JSON list of ``{"id", "ok", "error"}``, written once every block has run.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path


def run_block(block: dict) -> dict:
    """Run one block (``{"id", "code", "dir"}``) in ``dir``; say whether it raised."""
    here = os.getcwd()
    folder = Path(block["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    os.chdir(folder)
    print(f"--- {block['id']}", flush=True)
    try:
        exec(compile(block["code"], block["id"], "exec"), {"__name__": "__main__"})
    except SystemExit as e:  # a script's normal end (a preemption exit): ok when its code is 0
        print(f"[exit {e.code}]", flush=True)
        if e.code not in (0, None):
            return {"id": block["id"], "ok": False, "error": f"SystemExit({e.code!r})"}
    except BaseException:
        return {"id": block["id"], "ok": False, "error": traceback.format_exc(limit=-8)}
    finally:
        sys.stdout.flush()
        os.chdir(here)
    return {"id": block["id"], "ok": True, "error": ""}


def main(argv: list[str]) -> int:
    blocks = json.loads(Path(argv[0]).read_text())
    rank = os.environ.get("RANK")
    out = Path(argv[1] if rank is None else f"{argv[1]}.{rank}")
    results = [run_block(b) for b in blocks]
    with contextlib.suppress(Exception):  # a block that left a process group behind
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    out.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
