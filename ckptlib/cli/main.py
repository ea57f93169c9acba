"""``ckptlib``: look at, check and prune checkpoints from the shell: ``ls``, ``inspect``,
``verify``, ``prune`` here, ``export`` (cli/export.py) and ``diff`` (cli/diff.py). Arguments,
the ``--json`` / ``--storage-option`` / ``--timeout`` options every command takes, and exit
statuses (1 only from ``verify`` and ``diff``, 2 for usage or access errors, a stalled storage
included): docs/cli.md and docs/read.md. Only the chosen command's module is imported, and it
runs on a worker thread under the storage deadline of :mod:`ckptlib.cli.deadline`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .argtypes import int_at_least, seconds

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def parse_storage_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(KEY, VALUE)``; VALUE is parsed as JSON when it parses
    (``anon=true`` -> ``True``, ``retries=3`` -> ``3``), else kept as a string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def _common_options(prefix: str, default: Any) -> argparse.ArgumentParser:
    """``--json`` and ``--storage-option``, for the top-level parser and every subcommand."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--json", dest=f"{prefix}json", action="store_true", default=default,
                   help="print one machine-readable JSON document on stdout (no colours)")
    p.add_argument("--storage-option", dest=f"{prefix}storage_option", action="append",
                   type=parse_storage_option, default=default, metavar="KEY=VALUE",
                   help="fsspec storage option (repeatable); VALUE is parsed as JSON if it can "
                   "be, e.g. anon=true, else taken as a string")
    p.add_argument("--timeout", dest=f"{prefix}timeout", type=seconds, default=default,
                   metavar="SECONDS", help="give up when storage does not answer one request "
                   "within SECONDS (default: $CKPTLIB_CLI_TIMEOUT, else 60; 0: wait forever)")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ckptlib`` command."""
    from ckptlib._version import __version__

    parser = argparse.ArgumentParser(
        prog="ckptlib",
        description="Inspect, verify and prune ckptlib checkpoints (local paths or fsspec URLs).",
        epilog="exit status: 0 ok; 1 verify found a corrupt or incomplete step or nothing to "
        "verify, or diff found differences; 2 usage or access error",
        parents=[_common_options("global_", None)],
    )
    parser.add_argument("--version", action="version", version=f"ckptlib {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = _common_options("", None)
    url_help = ("a CheckpointManager root (the folder holding step-* folders), "
                "or a folder written by ckptlib.save()")

    p = sub.add_parser("ls", parents=[common], help="list steps with status, size, ranks, age",
                       description="One row per step under a CheckpointManager root: step, "
                       "status (committed/incomplete/corrupt), size, ranks, age, and why a step "
                       "is not usable.")
    p.add_argument("url", metavar="URL", help="checkpoint root (local path or fsspec URL)")
    p.add_argument("--local", metavar="TEMPLATE", default=None,
                   help="the run's node-local tier (CheckpointManager local=, '{node}' matches every node): "
                   "adds a tiers column")

    p = sub.add_parser("inspect", parents=[common], help="show a checkpoint's header and tensors",
                       description="Header (step, save id, world size, commit mode, metadata, ...) "
                       "and tensors (name, dtype, shape, sharding, bytes) of the newest committed "
                       "step, step N, or a single checkpoint folder.")
    p.add_argument("url", metavar="URL", help=url_help)
    p.add_argument("--step", type=int_at_least(0), metavar="N", help="inspect step N")

    p = sub.add_parser("verify", parents=[common], help="deep-check checksums (exit 1 if bad)",
                       description="Read every chunk and check its checksum and compressed size "
                       "against the manifest: the newest committed step by default. Exit 0 only "
                       "if everything checked is good, 1 if a step is corrupt or incomplete or "
                       "there is no step to verify.")
    p.add_argument("url", metavar="URL", help=url_help)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int_at_least(0), metavar="N", help="verify step N")
    which.add_argument("--all", action="store_true",
                       help="verify every step (any step that is not committed fails, except a save's "
                       "staging folder: in progress, or debris)")
    p.add_argument("--debris-min-age", type=seconds, default=3600.0, metavar="SECONDS",
                   help="a save's .tmp- folder started less than this long ago is 'in progress', an "
                   "older one 'debris' (as prune judges it); neither fails verify (default 3600)")
    _tier_options(p, "check")

    p = sub.add_parser("prune", parents=[common], help="delete old steps by retention policy",
                       description="Delete committed steps that the retention policy does not "
                       "keep (never the newest committed one), and remove debris that is provably "
                       "not in use: crashed saves, interrupted deletions, damaged and quarantined "
                       "(.corrupt-) step folders once a newer committed step supersedes them. "
                       "With --verify, kept steps are deep-checked first and a corrupt one never "
                       "counts as kept.")
    p.add_argument("url", metavar="URL", help="checkpoint root (local path or fsspec URL)")
    p.add_argument("--keep-last", type=int_at_least(1), metavar="N",
                   help="keep the newest N committed steps (required unless --tier local)")
    p.add_argument("--keep-every", type=int_at_least(1), metavar="K",
                   help="also keep steps divisible by K")
    p.add_argument("--verify", action="store_true",
                   help="deep-check (checksums) every step it would keep, newest first; a step "
                   "that fails is not kept and the next good one is kept instead")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    p.add_argument("--debris-min-age", type=seconds, default=3600.0, metavar="SECONDS",
                   help="remove a crashed save's .tmp- folder only once its save started this "
                   "long ago; a younger one may be a save still running (default 3600; 0 removes "
                   "all debris)")
    _tier_options(p, "prune")
    p.add_argument("--local-keep-last", type=int_at_least(1), default=2, metavar="N",
                   help="local tier: keep the newest N locally committed steps on each node, as "
                   "CheckpointManager(local_keep_last=N) does (default 2)")
    from . import diff, export, plan

    export.add_parser(sub, common)
    diff.add_parser(sub, common)
    plan.add_parser(sub, common)
    return parser


def _tier_options(p: argparse.ArgumentParser, verb: str) -> None:
    """``--local``, ``--node`` and ``--tier`` of ``verify`` and ``prune`` (docs/tiers.md)."""
    p.add_argument("--local", metavar="TEMPLATE", default=None,
                   help=f"the run's node-local tier (CheckpointManager local=; '{{node}}' matches every "
                   f"node's folder): {verb} each node's folder too")
    p.add_argument("--node", type=int_at_least(0), action="append", metavar="N",
                   help="only node N's folder (repeatable; a missing folder counts as an empty node)")
    p.add_argument("--tier", choices=("local", "persistent", "all"), default=None,
                   help="which tier to " + verb + " (default: all with --local, else persistent)")


def _merge_common(args: argparse.Namespace) -> None:
    args.json = bool(args.json or args.global_json)
    options: dict[str, Any] = {}
    for key, value in (args.global_storage_option or []) + (args.storage_option or []):
        options[key] = value
    args.storage_options = options or None
    args.timeout = args.timeout if args.timeout is not None else args.global_timeout


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckptlib`` command with ``argv`` (default ``sys.argv[1:]``); return the exit
    status instead of exiting, so it can be called in-process."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    if args.command is None:
        parser.print_help(sys.stderr)
        print("ckptlib: error: no command given: pick one of the commands above "
              "(`ckptlib COMMAND --help` for its options)", file=sys.stderr)
        return EXIT_USAGE
    _merge_common(args)

    from ckptlib.errors import CheckpointError

    from . import deadline
    from .output import CliError, Output

    out = Output(args.json)

    def fail(message: str, code: int = EXIT_USAGE, force: bool = False) -> int:
        out.note(f"ckptlib: {message}", style="red", force=force)
        out.emit({"error": message, "exit_code": code}, force=force)
        return code

    try:
        watch = deadline.Watch(deadline.resolve_timeout(args.timeout))
        return deadline.run(lambda: _command(args.command)(args, out), watch,
                            status=not out.json_mode and out.err.is_terminal)
    except deadline.StalledError as e:
        out.muted = True  # the blocked command may wake up later: it prints nothing more
        return fail(str(e), e.code, force=True)
    except BrokenPipeError as e:
        if not out.broken_pipe:  # from storage, not from our output
            return fail(f"{args.url}: {e}")
        # e.g. `ckptlib ls ROOT | head`: the reader left; stop quietly with the real status.
        _silence_stdout()
        return out.exit_code if out.exit_code is not None else 0
    except CliError as e:
        return fail(str(e), e.code)
    except (CheckpointError, OSError, ValueError, ImportError) as e:
        text = str(e) or type(e).__name__
        if isinstance(e, ImportError) and not isinstance(e, CheckpointError):
            text = f"{text} (a storage backend package is missing?)"
        return fail(f"{args.url}: {text}" if args.url not in text else text)
    except Exception as e:
        # Backends can leak their own exception types (e.g. botocore's NoCredentialsError from
        # s3fs): still one line and exit 2, never a traceback, unless asked for one.
        if os.environ.get("CKPTLIB_TRACEBACK"):
            raise
        return fail(f"{args.url}: {type(e).__name__}: {e} (set CKPTLIB_TRACEBACK=1 for details)")
    except KeyboardInterrupt:  # the command's worker was stopped too (deadline.run)
        return fail("interrupted", EXIT_INTERRUPTED)


def _command(name: str) -> Callable[[argparse.Namespace, Any], int]:
    """``cmd_<name>`` of the module ``ckptlib.cli.<name>`` (every subcommand lives in its own
    module). Only the chosen one is imported: ``ls``/``verify``/``prune`` never import torch
    (tests/test_cli_imports.py)."""
    module = importlib.import_module(f"ckptlib.cli.{name}")
    fn: Callable[[argparse.Namespace, Any], int] = getattr(module, f"cmd_{name}")
    return fn


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
