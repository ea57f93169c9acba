"""Every ```python block in README.md, docs/*.md and docs/integrations/*.md runs as written.

One fresh Python process per doc file (forked by ``tests/docs_runner.py`` once torch and
ckptlib are imported; each block in its own globals and its own empty folder under the test's
tmp folder, ``PYTHONPATH`` the repository, ``TMPDIR`` inside that folder); a block marked
``ranks=N`` runs on N gloo ranks through tests/launcher.py. The pages that use S3 run in one
runner, the others in a second, the multi-rank blocks after them; two jobs at a time. A block
that raises fails the test with its traceback. S3 URLs reach this module's moto server (emptied before each page that
uses S3) through ``AWS_ENDPOINT_URL`` and its test keys, so ``s3://bucket/...`` runs as
printed; an absolute example path (``/ckpt/run1``, ``/nvme/...``, ``/tmp/...``) is read
relative to the block's folder.

A block may be preceded by a marker (blank lines and other HTML comments may sit between):

- ``<!-- example: setup=NAME -->``: :data:`SETUPS` [NAME] gives what the page defines
  elsewhere (a prelude run before the block: a tiny model, a checkpoint to read), the
  ``ranks`` it runs on, placeholders to fill (``replace``: each must occur in the block), and
  the result the page states (``after``: asserts run after the block; ``on_exit``: asserts
  run when it exits by ``SystemExit``, code 0 being a pass; ``expect``: text its output must
  hold; ``runs=2``: run again in the same folder, as a restarted job, checked after the last).
- ``<!-- example: fragment, REASON -->``: not run (for a block that truly cannot: none today);
  checked to be valid Python and reported as a skipped test with its reason (pytest's ``-ra``
  summary lists it). README.md and the pages in :data:`MUST_RUN` may hold no fragment.

Called by pytest only.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import launcher
import pytest
from backends.servers import MotoServer

REPO = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).resolve().parent / "docs_runner.py"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "docs" / "integrations").glob("*.md"))]
MUST_RUN = {"README.md", "training.md", "saving.md", "read.md", "async.md", "tiers.md", "storage.md"}
BUCKETS = ("bucket", "my-bucket")
TIMEOUT = 240  # seconds for one doc file's blocks, or one multi-rank block

MARKER = re.compile(r"<!--\s*example:\s*(.*?)\s*-->")
ABS_PATH = re.compile(r"""(["'])/(?=(?:ckpt|nvme|tmp|shared|models|data|dev/shm)/)""")
FILE_URL = re.compile(r"file:///(?=data/)")


@dataclass(frozen=True)
class Setup:
    """What a marked block needs and what it must produce (see the module docstring)."""

    prelude: str = ""
    after: str = ""
    expect: tuple[str, ...] = ()
    replace: tuple[tuple[str, str], ...] = ()
    ranks: int = 1
    runs: int = 1  # >1: run again in the same folder (a restart), the checks after the last run
    on_exit: str = ""  # asserts run when the block raises SystemExit (which then goes on)


# A small checkpoint with the names read.md, README and format.md read.
RUN1 = """
import torch, ckptlib
torch.manual_seed(0)
ckpt_state = {"model": {"0.weight": torch.randn(32, 16), "0.bias": torch.randn(32).bfloat16(),
                        "embed.weight": torch.randn(1024, 64), "norm.weight": torch.ones(64),
                        "layers": [{"attn.qkv.weight": torch.randn(192, 64)}]}, "step": 1200}
with ckptlib.CheckpointManager("ckpt/run1", async_save=False) as _m:
    _m.save(1200, ckpt_state)
"""

TINY_LOOP = """
import torch, ckptlib
model = torch.nn.Linear(4, 2)
opt = optimizer = torch.optim.AdamW(model.parameters())
batch = torch.randn(8, 4)
state = {"model": model, "optim": opt, "step": 0}
start, steps, total_steps = 0, 21, 40
def train_step(*_):
    model(batch).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""

DCP = TINY_LOOP + """
step, root = 100, "ckpt"
state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
"""

# docs/format.md section 6: the manifest the page shows is the one this state saves as (but for
# what differs per save: ids, times, checksums and sizes of random data).
FORMAT_EXAMPLE = """
import json, re
with ckptlib.CheckpointManager("root", compression="zstd", async_save=False) as _m:
    _m.save(1200, state, metadata={"run": "gpt-small"})
_page = open(os.path.join(os.environ["PYTHONPATH"], "docs", "format.md")).read()
_shown = re.search(r"this manifest.*?```jsonc\\n(.*?)```", _page, re.S).group(1)
_doc = json.loads(re.sub(r"\\s*//[^\\n]*", "", _shown))
_got = json.load(open("root/step-000000001200/manifest.json"))
assert sorted(_got) == sorted(_doc) and _got["format_version"] == _doc["format_version"]
_d, _g = _doc["body"], _got["body"]
assert list(_g) == list(_d), (list(_g), list(_d))
for _k in ("step", "world_size", "commit", "checksum_algorithm", "tree", "packed_tensors", "metadata", "extra", "metrics"):
    assert _g[_k] == _d[_k], (_k, _g[_k], _d[_k])
assert [p[3:] for p in _g["packs"]] == [p[3:] for p in _d["packs"]]   # checksum, codec, raw length
for _name, _t in _d["tensors"].items():
    assert (_g["tensors"][_name]["dtype"], _g["tensors"][_name]["shape"]) == (_t["dtype"], _t["shape"])
    assert [c[4:] for c in _g["tensors"][_name]["chunks"]] == [c[4:] for c in _t["chunks"]], _name
assert sorted(_g["tensors"]) == sorted(_d["tensors"])
"""

S3_OPTIONS = (
    ('"endpoint_url": "https://s3.example.com"', '"endpoint_url": os.environ["AWS_ENDPOINT_URL"]'),
    ('"key": "...", "secret": "..."', '"key": "testing", "secret": "testing"'),
)

SETUPS: dict[str, Setup] = {
    "short-loop": Setup(replace=(("10_001", "301"),), runs=2, after="""
assert start == 300
assert [i.step for i in ckptlib.CheckpointManager("./nvme/run1/ckpt").steps()] == [100, 200, 300]
"""),
    "run1": Setup(prelude=RUN1 + """
import shutil, s3fs
s3fs.S3FileSystem(anon=False).put("ckpt/run1", "bucket/run1", recursive=True)
"""),
    "run1-view": Setup(prelude=RUN1, after="""
assert torch.equal(w, ckpt_state["model"]["0.weight"][:10])
assert torch.equal(model_state["embed.weight"], ckpt_state["model"]["embed.weight"])
assert arr.shape == (32, 16)
"""),
    "run1-slices": Setup(prelude=RUN1, after="""
_m = ckpt_state["model"]
assert torch.equal(w, _m["layers"][0]["attn.qkv.weight"][:128]) and torch.equal(row, _m["embed.weight"][42])
assert torch.equal(tail, _m["embed.weight"][-10:]) and torch.equal(full, _m["norm.weight"])
"""),
    "run1-array": Setup(prelude=RUN1, after="""
assert (part == ckpt_state["model"]["embed.weight"][1000:1010, :64].numpy()).all()
"""),
    "save-refusals": Setup(expect=(
        "holds files that are not a ckptlib checkpoint (notes.txt); nothing in it was moved",)),
    "strict-false": Setup(expect=(
        "keys differ; in the target but not in the checkpoint: /model/new_head", "['/model/new_head'] []")),
    "commit-on-every-rank": Setup(ranks=2, prelude="""
import torch.distributed
torch.distributed.init_process_group("gloo")
""", expect=("[(100, 'committed')]",)),
    "accelerate-loop": Setup(runs=2, after="""
assert start == 3   # the restart resumed after the last epoch: nothing left to train
assert [i.step for i in ckptlib.CheckpointManager("./tmp/ckptlib-accelerate-demo").steps()] == [2, 3]
"""),
    "lightning-fit": Setup(runs=2, after="""
assert trainer.ckpt_path is not None and trainer.ckpt_path.endswith("epoch=2-step=18.ckpt")
assert trainer.current_epoch == 3 and newest_checkpoint(ckpt_dir).endswith("epoch=2-step=18.ckpt")
"""),
    "step-check": Setup(prelude=RUN1, expect=("committed",)),
    "state-literal": Setup(prelude="import torch, ckptlib\n", replace=(('{"model"', 'state = {"model"'),),
                           after=FORMAT_EXAMPLE),
    "hf-folders": Setup(prelude="""
import os, torch, ckptlib, s3fs
from safetensors.torch import save_file
class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(32, 8)
        self.norm = torch.nn.LayerNorm(8)
class CausalLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Inner()
        self.lm_head = torch.nn.Linear(8, 32, bias=False)
source = CausalLM()
sd = {k: v.detach().clone() for k, v in source.state_dict().items()}
os.makedirs("models/llama-8b")
save_file({k: sd[k] for k in ("model.embed_tokens.weight",)}, "models/llama-8b/model-00001-of-00002.safetensors")
rest = {k: v for k, v in sd.items() if k != "model.embed_tokens.weight"}
save_file(rest, "models/llama-8b/model-00002-of-00002.safetensors")
import json
json.dump({"metadata": {}, "weight_map": {k: ("model-00001-of-00002.safetensors" if k in ("model.embed_tokens.weight",)
           else "model-00002-of-00002.safetensors") for k in sd}}, open("models/llama-8b/model.safetensors.index.json", "w"))
s3fs.S3FileSystem(anon=False).put("models/llama-8b", "bucket/llama-8b", recursive=True)
folder = "models/llama-8b"
model = CausalLM()
opt = torch.optim.AdamW(model.parameters())
""", after="""
assert torch.equal(model.model.embed_tokens.weight, source.model.embed_tokens.weight)
assert sorted(fresh["model"]) == sorted(sd) and torch.equal(rows, sd["model.embed_tokens.weight"][:16])
"""),
    "zarr-export": Setup(prelude=RUN1 + """
from ckptlib.cli.main import main as ckptlib_cli
assert ckptlib_cli(["export", "ckpt/run1", "--to", "zarr3", "data/run1.zarr"]) == 0
""", after="""
import numpy as np
assert np.array_equal(w, ckpt_state["model"]["0.weight"].numpy())
assert np.array_equal(values.astype("float32"), ckpt_state["model"]["0.bias"].float().numpy())
"""),
    "safetensors-export": Setup(prelude="""
import torch, ckptlib
from ckptlib.cli.main import main as ckptlib_cli
trained = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
with ckptlib.CheckpointManager("ckpt/final", async_save=False) as _m:
    _m.save(1, {"model": trained})
assert ckptlib_cli(["export", "ckpt/final", "--to", "safetensors", "models/final", "--select", "model"]) == 0
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
""", after="""
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), trained.state_dict().values()))
"""),
    "keep-best": Setup(expect=(
        "[(2, {'val_loss': 0.3}), (4, {'val_loss': 0.1}), (5, {'val_loss': 0.8}), (6, {'val_loss': 0.7})]",
    )),
    "loop": Setup(prelude=TINY_LOOP, after="""
assert [i.step for i in ckptlib.CheckpointManager("./nvme/run1").steps()] == [0, 500, 1000]
""", replace=(("range(start, steps)", "range(start, 1001)"),)),
    "preemption": Setup(prelude=TINY_LOOP + """
import os, signal
mgr = ckptlib.CheckpointManager("ckpt", async_save=True)
_train = train_step
def train_step():
    _train()
    if step == 7:
        os.kill(os.getpid(), signal.SIGTERM)   # the scheduler's notice, mid-step
""", after="""
raise AssertionError("maybe_save_on_preemption did not exit after SIGTERM")
""", on_exit="""
assert [(i.step, i.status) for i in ckptlib.CheckpointManager("ckpt").steps()] == [(7, "committed")]
""", expect=("[exit 0]",)),
    "preempted-all-ranks": Setup(ranks=2, prelude=TINY_LOOP + """
import os, signal, torch.distributed
torch.distributed.init_process_group("gloo")
mgr = ckptlib.CheckpointManager("ckpt")
mgr.save_on_signal()
step = 5
if torch.distributed.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGTERM)   # only rank 1 got the notice
""", after="""
raise AssertionError("no rank saw the signal")
""", on_exit="""
assert [(i.step, i.status) for i in ckptlib.CheckpointManager("ckpt").steps()] == [(5, "committed")]
""", expect=("[exit 0]",)),
    "scale-loop": Setup(prelude=TINY_LOOP + "total_steps = 150\n", after="""
assert mgr.steps() and all(i.status == "committed" for i in mgr.steps())
"""),
    "s3-options": Setup(replace=S3_OPTIONS, after="""
mgr.save(1, {"w": [1.0]}).wait()
assert [(i.step, i.status) for i in mgr.steps()] == [(1, "committed")]
mgr.close()
"""),
    "tiers-loop": Setup(prelude=TINY_LOOP, after="""
got = [(i.step, i.tiers) for i in ckptlib.CheckpointManager("s3://bucket/run1").steps()]
assert [s for s, _ in got] == [9, 19, 21], got   # every 10th save, the forced one; keep_last=3
"""),
    "memory-tier-loop": Setup(prelude=TINY_LOOP, after="""
mgr.close()
_local = {"local": "committed", "persistent": None}   # persist_every=50: none of 21 saves drained
assert [(i.step, i.tiers) for i in mgr.steps()] == [(19, _local), (20, _local)]   # local_keep_last=2
"""),
    "dcp": Setup(prelude=DCP, after="""
assert start == 100
"""),
    "dcp-s3": Setup(prelude=DCP + """
import torch.distributed.checkpoint as dcp
from ckptlib.integrations.dcp import CkptlibWriter, load_latest
""", replace=S3_OPTIONS, after="""
assert start == 100
"""),
    "dcp-async": Setup(ranks=2, prelude=TINY_LOOP + """
import torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from ckptlib.integrations.dcp import CkptlibWriter
dist.init_process_group("gloo")
root, start, steps = "ckpt", 1, 4
""", after="""
pending.result()
assert [(i.step, i.status) for i in ckptlib.CheckpointManager(root).steps()] == [(s, "committed") for s in (1, 2, 3)]
"""),
    "deepspeed": Setup(ranks=2, prelude="""
import datetime, torch
os.environ.update(LOCAL_RANK=os.environ["RANK"], LOCAL_WORLD_SIZE=os.environ["WORLD_SIZE"], DS_ACCELERATOR="cpu")
torch.set_num_threads(1)
import deepspeed, deepspeed.ops
deepspeed.ops.__compatible_ops__ = {}  # CPU, no op builds (as tests/workers/ds_worker.py)
deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
model = torch.nn.Linear(8, 4)
batch = torch.randn(2, 8)
optimizer = torch.optim.Adam(model.parameters())
ds_config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
             "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
""", after="""
assert res.tag is None and data_pos == 3
assert ckds.resume(engine, "ckpt").client_state["data_pos"] == 3
"""),
    "megatron": Setup(ranks=2, prelude="""
import warnings; warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
full = torch.arange(8.0).reshape(4, 2)
sharded_sd = {"w": ShardedTensor.from_rank_offsets("w", full[2 * rank: 2 * rank + 2].clone(), (0, rank, world), replica_id=0)}
save_dir, iteration = "ckpt", 100
""", after="""
assert iteration == 200 and torch.equal(state["w"], full[2 * rank: 2 * rank + 2])
"""),
    "lightning-io": Setup(prelude="from ckptlib.integrations.lightning import CkptlibCheckpointIO\n"),
}


@dataclass(frozen=True)
class Block:
    """One ```python block of a doc page and the marker before it (``""`` if none)."""

    doc: str
    line: int  # of the opening fence, 1-based
    code: str
    marker: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def fragment(self) -> str | None:
        """The reason a fragment is not run; None for a block that runs."""
        head, _, reason = self.marker.partition(",")
        return reason.strip() or "no reason given" if head.strip() == "fragment" else None

    @property
    def setup(self) -> Setup:
        if not self.marker:
            return Setup()
        m = re.fullmatch(r"setup=([\w-]+)", self.marker)
        assert m and m.group(1) in SETUPS, f"{self.id}: unknown marker <!-- example: {self.marker} -->"
        return SETUPS[m.group(1)]


def doc_blocks(path: Path) -> list[Block]:
    """Every ```python block of one page, with the ``example:`` marker that precedes it."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            marker, k = "", i - 1
            while k >= 0 and (not lines[k].strip() or lines[k].strip().startswith("<!--")):
                m = MARKER.search(lines[k])
                if m:
                    marker = m.group(1)
                    break
                k -= 1
            code = textwrap.dedent("\n".join(ln.removeprefix(indent) for ln in lines[i + 1 : end]))
            blocks.append(Block(path.relative_to(REPO).as_posix(), i + 1, code + "\n", marker))
            i = end
        i += 1
    return blocks


def runnable(block: Block, folder: Path, checks: bool = True) -> str:
    """The source the runner executes for ``block``: prelude, block (placeholders filled,
    absolute example paths under ``folder``), then (``checks``) the stated result's checks."""
    setup, code = block.setup, block.code
    for old, new in setup.replace:
        assert old in code, f"{block.id}: the test fills {old!r}, which the block no longer holds"
        code = code.replace(old, new)
    code = FILE_URL.sub(f"file://{folder}/", ABS_PATH.sub(r"\1./", code))
    if setup.on_exit and checks:
        on_exit = textwrap.indent(setup.on_exit.strip(), "    ")
        code = f"try:\n{textwrap.indent(code, '    ')}\nexcept SystemExit:\n{on_exit}\n    raise\n"
    return f"import os\n{setup.prelude}\n{code}\n{setup.after if checks else ''}"


ALL = [b for doc in DOCS for b in doc_blocks(doc)]
RUN = [b for b in ALL if b.fragment is None]


def test_every_page_block_is_found_and_every_setup_used() -> None:
    assert len(ALL) >= 30, [b.id for b in ALL]
    for b in ALL:
        ast.parse(b.code, b.id)  # fragments too: valid Python
        assert b.fragment is None or Path(b.doc).name not in MUST_RUN, f"{b.id} must run"
    used = {b.marker.removeprefix("setup=") for b in RUN if b.marker}
    assert used == set(SETUPS), f"setups no block names: {set(SETUPS) - used}"


FRAGMENTS = [b for b in ALL if b.fragment]
if FRAGMENTS:  # none today: every block runs

    @pytest.mark.parametrize("block", FRAGMENTS, ids=lambda b: b.id)
    def test_fragment_is_listed_with_its_reason(block: Block) -> None:
        pytest.skip(f"{block.id} is a fragment, not run: {block.fragment}")  # -ra lists it in the summary


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1", "CKPTLIB_DOCS_BUCKETS": ",".join(BUCKETS)}


def uses_s3(block: Block) -> bool:
    return "s3" in runnable(block, Path("/"))


def _env(tmp_path: Path, endpoint: str) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": endpoint, "PYTHONPATH": str(REPO),
           "TMPDIR": str(tmp_path / "tmp")}
    env.pop("CKPTLIB_NODE", None)
    return env


def _items(blocks: list[Block], tmp_path: Path) -> list[dict]:
    """The runner's list for ``blocks``: a block run ``runs`` times in one folder, checked last."""
    items = []
    for n, b in enumerate(blocks):
        folder = tmp_path / f"b{n}"
        for run in range(1, b.setup.runs + 1):
            items.append({"id": b.id, "code": runnable(b, folder, run == b.setup.runs), "dir": str(folder)})
    return items


@dataclass
class Ran:
    """How one process ran a list of blocks: the runner's results (None if it wrote none)."""

    returncode: int | str
    results: list[dict] | None
    log: str


def _run_pages(pages: list[str], tmp_path: Path, endpoint: str) -> dict[str, list[Ran]]:
    """One runner runs ``pages`` one after the other, each in a process of its own (forked)."""
    jobs = []
    for n, doc in enumerate(pages):
        folder = tmp_path / f"page{n}"
        blocks = [b for b in RUN if b.doc == doc and b.setup.ranks == 1]
        jobs.append({"blocks": _items(blocks, folder), "results": str(folder / "results.json"),
                     "s3": any(uses_s3(b) for b in blocks), "timeout": TIMEOUT})
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, str(RUNNER), str(path)], cwd=tmp_path, env=_env(tmp_path, endpoint),
                          capture_output=True, text=True, timeout=TIMEOUT * len(pages) + 60)
    exits_path = Path(f"{path}.exits")
    exits = json.loads(exits_path.read_text()) if exits_path.exists() else {}
    log = f"{proc.stdout}\n[runner exit {proc.returncode}]\n{proc.stderr[-4000:]}"
    ran = {}
    for doc, job in zip(pages, jobs, strict=True):
        out = Path(job["results"])
        results = json.loads(out.read_text()) if out.exists() else None
        ran[doc] = [Ran(exits.get(job["results"], "not run"), results, log)]
    return ran


def _run_ranks(block: Block, tmp_path: Path) -> list[Ran]:
    """``block.setup.ranks`` gloo ranks run ``block`` (tests/launcher.py); one Ran per rank."""
    assert not uses_s3(block), f"{block.id}: S3 is for single-rank pages (one runner empties it)"
    out, payload = tmp_path / "results.json", tmp_path / "blocks.json"
    payload.write_text(json.dumps(_items([block], tmp_path)))
    procs = launcher.start(lambda rank, port: [str(RUNNER), str(payload), str(out)],
                           block.setup.ranks, env=_env(tmp_path, "http://127.0.0.1:9"))
    outcomes = launcher.finish(block.id, procs, lambda rank: Path(f"{out}.{rank}"), TIMEOUT)
    return [Ran(o.returncode, o.result, o.log) for o in outcomes]


PAGES = sorted({b.doc for b in RUN if b.setup.ranks == 1})
RANKED = [b for b in RUN if b.setup.ranks > 1]


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """The selected pages and multi-rank blocks, from the first test that asks: the pages that
    use S3 in one runner (one moto server, emptied before each), the others in a second, the
    multi-rank blocks after them; two jobs at a time (this machine's cores)."""
    wanted = {item.callspec.id for item in request.session.items
              if getattr(item, "callspec", None) and item.module is request.module}
    pages = [doc for doc in PAGES if doc in wanted]
    s3 = [doc for doc in pages if any(uses_s3(b) for b in RUN if b.doc == doc and b.setup.ranks == 1)]
    lanes = [lane for lane in (s3, [doc for doc in pages if doc not in s3]) if lane]
    server = MotoServer()
    with contextlib.ExitStack() as stack:
        stack.callback(server.stop)  # after the pool below has waited for every job
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=2))
        futures: dict[str, Future] = {}
        for n, lane in enumerate(lanes):
            ran = pool.submit(_run_pages, lane, tmp_path_factory.mktemp(f"lane{n}"), server.endpoint)
            futures.update(dict.fromkeys(lane, ran))
        for b in RANKED:
            if b.id in wanted:
                futures[b.id] = pool.submit(_run_ranks, b, tmp_path_factory.mktemp("ranks"))
        yield futures  # leaving the pool waits for every job (each under its deadline)


def _judge(blocks: list[Block], ran: list[Ran]) -> None:
    """Every process exited 0 and says every block ran without raising and printed what its
    setup expects."""
    for r in ran:
        assert r.returncode == 0 and r.results is not None, r.log[-8000:]
        assert [x["id"] for x in r.results] == [b.id for b in blocks for _ in range(b.setup.runs)], r.log[-4000:]
        failed = [f"{x['id']}:\n{x['error']}" for x in r.results if not x["ok"]]
        assert not failed, "\n".join(failed) + "\n--- output:\n" + r.log[-4000:]
        parts = re.split(r"^--- (\S+:\d+)\n", r.log, flags=re.M)  # [before, id, its output, id, ...]
        outputs = dict(zip(parts[1::2], parts[2::2], strict=True))  # a block run twice: its last run
        for b in blocks:
            for text in b.setup.expect:
                assert text in outputs.get(b.id, ""), f"{b.id}: expected {text!r} in its output:\n{r.log[-4000:]}"


@pytest.mark.parametrize("doc", PAGES)
def test_doc_blocks_run(doc: str, jobs: dict[str, Future]) -> None:
    blocks = [b for b in RUN if b.doc == doc and b.setup.ranks == 1]
    _judge(blocks, jobs[doc].result(timeout=TIMEOUT * (len(jobs) + 1))[doc])


@pytest.mark.parametrize("block", RANKED, ids=lambda b: b.id)
def test_multi_rank_blocks_run(block: Block, jobs: dict[str, Future]) -> None:
    _judge([block], jobs[block.id].result(timeout=TIMEOUT * (len(jobs) + 1)))
