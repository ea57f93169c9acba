#!/usr/bin/env python3
"""CI wheel check: build the wheel, install it alone into a fresh venv, run the README on it.

Called by ``.ci/run`` (after ``make venv``, before ``make test``) and by ``make wheel-check``;
runs on the development venv's Python, which has ``build``, ``setuptools`` and ``wheel``.
In order, in one temporary folder (removed afterwards unless ``--keep``):

1. Copy the files git knows about (tracked, plus untracked ones not ignored) and build the
   wheel there with ``python -m build --wheel --no-isolation -x``: offline, and no stale
   ``build/lib`` from an earlier build can leak into it.
2. Check the wheel's contents: ``ckptlib/py.typed`` is in it, nothing from ``tests/``,
   ``bench/`` or ``examples/`` is, and its metadata declares the extras the README installs.
3. Create a fresh venv and ``pip install`` the wheel with its core dependencies only, under
   ``requirements/constraints.txt`` (the CPU ``torch==2.13.0`` from the local wheel folder;
   an unpinned torch could pull a multi-GB CUDA build). Check that no extra's package
   (s3fs, tensorstore, ...) came along, so the quick start really needs only the core.
4. In an empty folder, run the README's five-minute start (the python block between the
   ``quickstart:python`` markers) with the fresh venv's Python, twice, through :data:`PROBE`,
   and check the two runs (:func:`check_runs`: the first trains 30 steps, the second trains
   none, and the state both runs restore is bit for bit the one the first run trained); then
   every ``ckptlib`` line of the ``quickstart:cli`` block with the installed ``ckptlib``
   script, and ``ckptlib --version`` (must match the wheel's version).

Exit 0 when every check passed; otherwise the failing step's output and exit 1.
``tests/test_readme.py`` uses :func:`readme_blocks` to run the same blocks against the source
tree, so the README is checked even where this script is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
CONSTRAINTS = REPO / "requirements" / "constraints.txt"
EXTRAS = ("s3", "zarr", "deepspeed", "megatron", "lightning", "accelerate")
# Packages that only extras bring; none may be present after a core install.
EXTRA_ONLY_MODULES = ("s3fs", "tensorstore", "deepspeed", "megatron", "lightning", "accelerate")
# Each command gets this long (seconds); pip installing torch from disk is the slowest step.
STEP_TIMEOUT = 900


class CheckFailed(Exception):
    """One check failed; the message says which and shows the evidence."""


PROBE = """
import hashlib, json, runpy

ns = runpy.run_path("quickstart.py", run_name="__main__")


def digest(state):
    h = hashlib.sha256()
    for t in state["model"].state_dict().values():
        h.update(t.detach().numpy().tobytes())
    for per_param in state["optim"].state_dict()["state"].values():
        for v in per_param.values():
            h.update(v.detach().numpy().tobytes() if hasattr(v, "numpy") else repr(v).encode())
    h.update(repr(state["step"]).encode())
    return h.hexdigest()


print("quickstart-probe " + json.dumps({"state": digest(ns["state"]), "resumed": digest(ns["resumed"])}))
"""
"""Runs ``quickstart.py`` (in the current folder) as ``__main__``, then prints the SHA-256 of
the weights, optimizer state and step of its two states: ``state`` (what the training loop
trained, or restored and left as it was) and ``resumed`` (what its fresh manager restored)."""

TRAINED_RE = re.compile(r"^resumed at step (\d+), trained (\d+) steps$", re.M)


def _run_facts(out: str, which: str) -> tuple[int, int, dict[str, str]]:
    """(resumed at, steps trained, digests) from one probed quick start run's output."""
    counts = TRAINED_RE.findall(out)
    probe = [line for line in out.splitlines() if line.startswith("quickstart-probe ")]
    if len(counts) != 1 or len(probe) != 1:
        raise CheckFailed(f"{which} quick start run: no `resumed at step N, trained K steps` line or no "
                          f"probe line in its output:\n{out}")
    return int(counts[0][0]), int(counts[0][1]), json.loads(probe[0].split(" ", 1)[1])


def check_runs(first: str, second: str) -> None:
    """The two probed quick start runs (:data:`PROBE`) did what the README says: the first
    trained 30 steps from scratch, the second resumed at step 30 and trained none; both runs'
    fresh managers restored the state the first run trained, bit for bit, and so did the
    second run's training loop. Raises :class:`CheckFailed` otherwise."""
    start1, trained1, d1 = _run_facts(first, "first")
    start2, trained2, d2 = _run_facts(second, "second")
    if (start1, trained1) != (0, 30):
        raise CheckFailed(f"first run: resumed at step {start1}, trained {trained1} steps; expected 0 and 30")
    if (start2, trained2) != (30, 0):
        raise CheckFailed(f"second run: resumed at step {start2}, trained {trained2} steps; expected 30 and 0 "
                          "(a resume must not train again)")
    trained = d1["state"]
    for what, got in (("first run's restore", d1["resumed"]), ("second run's loop", d2["state"]),
                      ("second run's restore", d2["resumed"])):
        if got != trained:
            raise CheckFailed(f"{what} restored other weights or optimizer state than the first run trained")


def readme_blocks(text: str) -> tuple[str, list[str]]:
    """The quick start from README text: (python source, [ckptlib command lines]).

    The python block is the fenced block between ``<!-- quickstart:python:begin -->`` and
    ``<!-- quickstart:python:end -->``; commands are the lines starting with ``ckptlib `` in
    the fenced block between the ``quickstart:cli`` markers, with ``# comments`` removed.
    """

    def fenced(name: str, lang: str) -> str:
        m = re.search(
            rf"<!-- quickstart:{name}:begin -->\s*```{lang}\n(.*?)```\s*<!-- quickstart:{name}:end -->",
            text,
            re.S,
        )
        if m is None:
            raise CheckFailed(
                f"README.md: no ```{lang} block between <!-- quickstart:{name}:begin --> and "
                f"<!-- quickstart:{name}:end --> (the markers must stay around the quick start)"
            )
        return m.group(1)

    python = fenced("python", "python")
    commands = [
        line.split("#", 1)[0].strip()
        for line in fenced("cli", "bash").splitlines()
        if line.strip().startswith("ckptlib ")
    ]
    if not commands:
        raise CheckFailed("README.md: the quickstart:cli block has no `ckptlib ...` line")
    return python, commands


def sh(argv: list[str | Path], cwd: Path, what: str) -> str:
    """Run argv (without PYTHONPATH, so nothing but the fresh venv supplies ckptlib); return
    its stdout; raise CheckFailed with its output if it fails or outlasts STEP_TIMEOUT."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    t0 = time.perf_counter()
    try:
        p = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=STEP_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise CheckFailed(f"{what} did not finish within {STEP_TIMEOUT} s") from e
    print(f"  {what}: {time.perf_counter() - t0:.1f} s", flush=True)
    if p.returncode != 0:
        raise CheckFailed(
            f"{what} failed (exit {p.returncode}): {' '.join(map(str, argv))}\n"
            f"--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
        )
    return p.stdout


def copy_source(dst: Path) -> None:
    """Copy the files git sees (tracked + untracked-not-ignored) from REPO into dst; outside a
    git checkout (a source tarball), the tree without build outputs, venvs and caches."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO, capture_output=True, check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__", ".*_cache"))
        return
    for rel in filter(None, out.decode().split("\0")):
        src = REPO / rel
        if src.is_file():  # skips files deleted in the work tree but still in the index
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def check_wheel_contents(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    if "ckptlib/py.typed" not in names:
        raise CheckFailed(f"{wheel.name}: ckptlib/py.typed is missing (type checkers need it)")
    tops = {n.split("/", 1)[0] for n in names}
    stray = sorted(t for t in tops if t != "ckptlib" and not t.endswith(".dist-info"))
    if stray:
        raise CheckFailed(f"{wheel.name}: unexpected top-level entries {stray} (tests? bench?)")
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = zipfile.ZipFile(wheel).read(meta_name).decode()
    declared = set(re.findall(r"^Provides-Extra: (\S+)$", meta, re.M))
    missing = [e for e in EXTRAS if e not in declared]
    if missing:
        raise CheckFailed(f"{wheel.name}: README installs extras {missing} the wheel lacks")
    print(f"  contents: {len(names)} files, py.typed present, no tests, extras {sorted(declared)}")


def run(work: Path) -> None:
    t_start = time.perf_counter()
    python, commands = readme_blocks(README.read_text())

    print("[1/4] build the wheel", flush=True)
    src, dist = work / "src", work / "dist"
    copy_source(src)
    # -x: setuptools >= 70.1 builds wheels itself; the `wheel` distribution that pyproject's
    # build-system lists need not be installed (offline, no isolated build env to fetch it).
    sh([sys.executable, "-m", "build", "--wheel", "--no-isolation", "-x", "--outdir", dist, src],
       work, "python -m build --wheel")
    (wheel,) = dist.glob("ckptlib-*.whl")
    version = wheel.name.split("-")[1]

    print(f"[2/4] check {wheel.name}", flush=True)
    check_wheel_contents(wheel)

    print("[3/4] fresh venv, core install", flush=True)
    venv = work / "venv"
    sh([sys.executable, "-m", "venv", venv], work, "python -m venv")
    vpy, vbin = venv / "bin" / "python", venv / "bin"
    # --no-compile: byte-compiling all of torch takes longer than the rest of the check; the
    # modules the quick start imports are compiled on first import instead.
    sh([vpy, "-m", "pip", "install", "-q", "--no-compile", "-c", CONSTRAINTS, wheel], work,
       "pip install wheel")
    probe = (
        "import importlib.util, ckptlib, json, sys; "
        f"print(json.dumps([ckptlib.__file__, [m for m in {list(EXTRA_ONLY_MODULES)!r} "
        "if importlib.util.find_spec(m) is not None]]))"
    )
    location, extras_present = json.loads(sh([vpy, "-c", probe], work, "probe"))
    if not location.startswith(str(venv)):
        raise CheckFailed(f"ckptlib imported from {location}, not from the fresh venv {venv}")
    if extras_present:
        raise CheckFailed(f"a core install brought extra-only packages: {extras_present}")

    print("[4/4] README quick start against the installed wheel", flush=True)
    run_dir = work / "quickstart"
    run_dir.mkdir()
    (run_dir / "quickstart.py").write_text(python)
    first = sh([vpy, "-c", PROBE], run_dir, "quickstart.py (first run: trains, saves)")
    second = sh([vpy, "-c", PROBE], run_dir, "quickstart.py (second run: resumes)")
    check_runs(first, second)
    for line in commands:
        argv = line.split()
        sh([vbin / "ckptlib", *argv[1:]], run_dir, line)
    shown = sh([vbin / "ckptlib", "--version"], run_dir, "ckptlib --version").strip()
    if shown != f"ckptlib {version}":
        raise CheckFailed(f"`ckptlib --version` printed {shown!r}; the wheel is {version}")
    print(f"wheel check passed in {time.perf_counter() - t_start:.0f} s ({wheel.name})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (printed)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ckptlib-wheel-check-"))
    try:
        run(work)
    except CheckFailed as e:
        print(f"WHEEL CHECK FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
