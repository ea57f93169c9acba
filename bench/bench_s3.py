"""Save/load to a local S3 server (SeaweedFS) vs raw s3fs put/get of the same bytes.

Starts ``weed mini`` on 127.0.0.1 (free ports), creates a bucket, then for each repeat:
- raw write: ``s3fs.S3FileSystem.pipe`` of the payload bytes as ``--files`` objects, in parallel;
- ckptlib save: ``ckptlib.save(state, s3://...)`` (multipart, parallel parts, manifest commit);
- raw read: ``s3fs.S3FileSystem.cat`` of those objects;
- ckptlib load: ``ckptlib.load(url, into=state)`` (ranged GETs, checksum verification on).
Both sides use the same endpoint, credentials and client settings (checksums computed only
where S3 requires them). Prints a markdown table of medians; ``--out`` also writes it.

    python bench/bench_s3.py --mib 256 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from backends.servers import SeaweedServer

import ckptlib

BUCKET = "ckptlib-bench"


def make_state(mib: int, tensors: int) -> dict:
    per = (mib << 20) // tensors // 4
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(per, generator=g) for i in range(tensors)}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--files", type=int, default=2, help="objects for the raw baseline (ckptlib writes 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=str, default="")
    args = ap.parse_args()

    import s3fs

    with tempfile.TemporaryDirectory(prefix="ckptlib-bench-s3-") as tmp:
        server = SeaweedServer(tmp).start()
        try:
            server.create_bucket(BUCKET)
            opts = server.storage_options()
            fs = s3fs.S3FileSystem(
                key=opts["key"], secret=opts["secret"], endpoint_url=opts["endpoint_url"],
                client_kwargs=opts["client_kwargs"], skip_instance_cache=True,
                config_kwargs={"request_checksum_calculation": "when_required",
                               "response_checksum_validation": "when_required"},
            )
            state = make_state(args.mib, args.tensors)
            target = {k: torch.empty_like(v) for k, v in state.items()}
            blob = b"".join(v.numpy().tobytes() for v in state.values())
            nbytes = len(blob)
            step = len(blob) // args.files
            pieces = [blob[i * step : (i + 1) * step if i < args.files - 1 else None] for i in range(args.files)]
            res: dict[str, list[float]] = {"raw put": [], "ckptlib save": [], "raw get": [], "ckptlib load": []}
            for r in range(args.repeats):
                run = uuid.uuid4().hex[:8]
                raw = {f"{BUCKET}/raw-{run}/{i}.bin": p for i, p in enumerate(pieces)}
                res["raw put"].append(timed(lambda raw=raw: fs.pipe(raw)))
                url = f"s3://{BUCKET}/ckpt-{run}/state"
                res["ckptlib save"].append(timed(lambda url=url: ckptlib.save(state, url, storage_options=opts)))
                res["raw get"].append(timed(lambda raw=raw: fs.cat(list(raw))))
                res["ckptlib load"].append(
                    timed(lambda url=url: ckptlib.load(url, into=target, storage_options=opts))
                )
                for k, v in state.items():
                    assert torch.equal(v, target[k]), f"load mismatch in {k} (repeat {r})"
                    target[k].zero_()
        finally:
            server.kill()

    med = {k: statistics.median(v) for k, v in res.items()}
    gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
    lines = [
        f"S3 (SeaweedFS `weed mini` on loopback), {nbytes / 2**20:.0f} MiB state in {args.tensors} tensors, "
        f"median of {args.repeats}; {os.cpu_count()} CPU cores",
        "",
        "| operation | seconds | GB/s | vs raw s3fs |",
        "|---|---:|---:|---:|",
    ]
    for k in res:
        base = "raw put" if k == "ckptlib save" else "raw get" if k == "ckptlib load" else k
        lines.append(f"| {k} | {med[k]:.2f} | {gbs[k]:.2f} | {med[base] / med[k]:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
