"""A stalled remote fails a CLI command within its deadline (``--timeout``, env
``CKPTLIB_CLI_TIMEOUT``, default 60 s), with a clear message, and a terminal sees a status line.

The stall is real: moto's S3 server behind ``ckptlib.testing.proxy.FaultProxy`` that keeps
accepting connections and stops forwarding bytes; the CLI runs as a real subprocess. Elapsed
times are only bounded loosely (far below the 60 s default and S3's 300 s operation deadline),
never measured.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from backends.servers import S3_BUCKET

from ckptlib.cli import deadline
from ckptlib.cli.main import main
from ckptlib.testing.proxy import FaultProxy

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 3.0
LOOSE = 45.0
"""Start-up (s3fs, botocore) on a busy machine plus the deadline: well under 60 s and 300 s."""


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "ckptlib.cli.main", *argv]


def env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def option_args(options: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in options.items():
        out += ["--storage-option", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return out


@pytest.fixture
def stalled(moto_s3: Any) -> Any:
    """``(url, storage option args)`` of an S3 root behind a proxy that black-holes."""
    with FaultProxy(int(moto_s3.endpoint.rsplit(":", 1)[1])) as proxy:
        proxy.stall()
        yield f"s3://{S3_BUCKET}/stalled-run", option_args(moto_s3.storage_options(proxy.endpoint))
        proxy.unstall()
    assert proxy.injected["stall"] == 1


def test_stalled_remote_fails_within_the_timeout(stalled: tuple[str, list[str]]) -> None:
    url, opts = stalled
    start = time.monotonic()
    proc = subprocess.run(cli("ls", url, *opts, "--timeout", str(TIMEOUT), "--json"), capture_output=True,
                          text=True, env=env(), timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["exit_code"] == 2
    assert f"no answer from storage within {TIMEOUT:g} s" in doc["error"] and "--timeout" in doc["error"]
    assert url in doc["error"]
    assert "waiting" not in proc.stderr  # not a terminal: no status line
    assert elapsed < LOOSE, elapsed


def test_terminal_gets_a_status_line_and_env_sets_the_deadline(stalled: tuple[str, list[str]]) -> None:
    url, opts = stalled
    master, slave = pty.openpty()
    try:
        start = time.monotonic()
        proc = subprocess.Popen(cli("ls", url, *opts), stdout=subprocess.PIPE, stderr=slave, text=True,
                                env=env(CKPTLIB_CLI_TIMEOUT=str(TIMEOUT)))
        os.close(slave)
        seen = b""
        while True:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
            assert time.monotonic() - start < 120, seen
        code = proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
    finally:
        os.close(master)
    text = seen.decode(errors="replace")
    assert code == 2, text
    assert "ckptlib: waiting" in text and f"giving up at {TIMEOUT:g} s" in text
    assert f"no answer from storage within {TIMEOUT:g} s" in text
    assert time.monotonic() - start < LOOSE


# --------------------------------------------------------------------------- in-process


def test_a_blocked_storage_call_is_abandoned_in_process(
    memory_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The deadline is the CLI's, not the backend's: any storage call that does not return."""
    from ckptlib.backends import open_storage

    release = threading.Event()
    storage = open_storage(memory_url)
    storage.makedirs("")
    real = type(storage).listdir

    def hang(self: Any, path: str = "") -> Any:
        release.wait(30)
        return real(self, path)

    monkeypatch.setattr(type(storage), "listdir", hang)
    try:
        code = main(["ls", memory_url, "--timeout", "0.5"])
    finally:
        release.set()
    captured = capsys.readouterr()
    assert code == 2
    assert "listdir" in captured.err and "no answer from storage within 0.5 s" in captured.err
    assert captured.out == ""  # the abandoned command printed nothing
    # Without a stall the same command finishes, under any deadline.
    assert main(["ls", memory_url, "--timeout", "0.5"]) == 0


def test_timeout_settings(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(deadline.ENV, raising=False)
    assert deadline.resolve_timeout(None) == deadline.DEFAULT_TIMEOUT == 60.0
    assert deadline.resolve_timeout(5) == 5
    monkeypatch.setenv(deadline.ENV, "7.5")
    assert deadline.resolve_timeout(None) == 7.5
    assert deadline.resolve_timeout(2) == 2  # the option wins
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv(deadline.ENV, bad)
        assert main(["ls", "/nonexistent-root"]) == 2
        assert f"{deadline.ENV}=" in capsys.readouterr().err
    monkeypatch.delenv(deadline.ENV)
    for bad in ("-1", "x", "inf"):
        assert main(["ls", "/nonexistent-root", "--timeout", bad]) == 2
        assert "--timeout" in capsys.readouterr().err
