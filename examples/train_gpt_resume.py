#!/usr/bin/env python
"""Crash a training job with SIGKILL, resume it with ckptlib, and get bit-identical weights.

What this demo shows
--------------------
A small GPT-style language model is trained on CPU three times, each time in a fresh process
started from this same script:

1. **Reference run** - N steps straight through, no checkpoints at all.
2. **Interrupted run** - the same training, saving an asynchronous checkpoint every K steps
   with ``ckptlib.CheckpointManager``. The parent process kills it with ``SIGKILL`` right
   after step ``--kill-at``: no exception handler, no ``atexit``, no flushing - a checkpoint
   being written at that moment is simply cut off.
3. **Resumed run** - the same script again. It calls ``mgr.restore(state)``, which loads the
   newest *committed* checkpoint in place (model, AdamW moments, LR scheduler, step counter
   and the CPU RNG that drives dropout), and trains on to step N.

The parent then compares the final model and optimizer state of runs 3 and 1 tensor by tensor:
they must be bitwise identical (max abs diff 0, identical SHA-256 digests). Finally it prints
``ckptlib ls`` of the checkpoint folder, which shows what retention kept.

Run it::

    python examples/train_gpt_resume.py --out runs/demo
    python examples/train_gpt_resume.py --out runs/demo --kill-at 35   # kill mid-save

Everything is written under ``--out``; a machine-readable result is in ``OUT/summary.json``.
The exit status is 0 only if the resumed run matched the reference run exactly.

Why the result is exact: the model, data and dropout are all seeded; each batch is chosen
from the step number alone (so there is no data-loader position to lose); the computation runs
on one thread with ``torch.use_deterministic_algorithms(True)``; and the checkpoint holds
everything else that changes during training.

To make the kill land at exactly the requested step, the parent paces the interrupted run one
step at a time (the child waits for a newline on stdin after reporting each step). Only the
training loop waits: ckptlib's background writer keeps going, so a checkpoint handed off at
the kill step is still being written when the kill arrives.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ckptlib

# ----------------------------------------------------------------------------------------------
# Settings shared by all phases
# ----------------------------------------------------------------------------------------------

VOCAB = 128  # tokens
BLOCK = 32  # context length
D_MODEL = 96
N_HEAD = 4
N_LAYER = 2
DROPOUT = 0.1  # dropout consumes the global CPU RNG, so the RNG state must be checkpointed
BATCH = 8
STREAM_LEN = 50_000  # length of the synthetic token stream
KEEP_LAST = 3  # retention: the newest 3 committed steps ...
KEEP_EVERY = 20  # ... plus every step divisible by 20

MARKER = ".ckptlib-demo"  # marks an --out folder this demo created (and may therefore clear)
EVENT_PREFIX = "@@ckptlib-demo "  # child -> parent protocol lines on stdout


# ----------------------------------------------------------------------------------------------
# Model: a tiny GPT (token + position embedding, pre-LN blocks, causal attention, MLP)
# ----------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.attn_drop = nn.Dropout(DROPOUT)
        self.resid_drop = nn.Dropout(DROPOUT)
        causal = torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool))
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        head_dim = c // N_HEAD
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, N_HEAD, head_dim).transpose(1, 2)
        k = k.view(b, t, N_HEAD, head_dim).transpose(1, 2)
        v = v.view(b, t, N_HEAD, head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        weights = self.attn_drop(F.softmax(scores, dim=-1))
        y = (weights @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = CausalSelfAttention()
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(
            nn.Linear(D_MODEL, 4 * D_MODEL),
            nn.GELU(),
            nn.Linear(4 * D_MODEL, D_MODEL),
            nn.Dropout(DROPOUT),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(BLOCK, D_MODEL)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)  # untied LM head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1])
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# Deterministic synthetic data: batches are a pure function of (seed, step)
# ----------------------------------------------------------------------------------------------


def make_token_stream(seed: int) -> torch.Tensor:
    """A token stream with learnable structure: each token usually has one favourite successor."""
    rng = random.Random(seed)
    favourite = [rng.randrange(VOCAB) for _ in range(VOCAB)]
    tokens: list[int] = []
    tok = 0
    for _ in range(STREAM_LEN):
        tokens.append(tok)
        tok = favourite[tok] if rng.random() < 0.75 else rng.randrange(VOCAB)
    return torch.tensor(tokens, dtype=torch.long)


def get_batch(stream: torch.Tensor, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch for training step `step` (1-based). No loader state, so resume is exact."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - BLOCK - 1, (BATCH,), generator=gen).tolist()
    x = torch.stack([stream[s : s + BLOCK] for s in starts])
    y = torch.stack([stream[s + 1 : s + 1 + BLOCK] for s in starts])
    return x, y


# ----------------------------------------------------------------------------------------------
# Optimizer and LR schedule
# ----------------------------------------------------------------------------------------------


def make_optimizer(model: nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))


def make_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = max(1, total_steps // 10)

    def lr_factor(done: int) -> float:  # linear warmup, then cosine decay to 10%
        if done < warmup:
            return (done + 1) / warmup
        progress = (done - warmup) / max(1, total_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


# ----------------------------------------------------------------------------------------------
# Helpers: flattening nested state and fingerprinting tensors (independently of ckptlib)
# ----------------------------------------------------------------------------------------------


def flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield (dotted name, leaf) for a nested structure of dicts, lists and tuples."""
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from flatten(tree[key], f"{prefix}{key}.")
    elif isinstance(tree, (list, tuple)):
        for i, item in enumerate(tree):
            yield from flatten(item, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), tree


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a CPU tensor (without needing numpy)."""
    t = t.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def tensor_digest(t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(tensor_bytes(t))
    return h.hexdigest()


def fingerprint(tree: Any) -> dict[str, str]:
    """SHA-256 of every tensor in `tree`, plus one digest over all non-tensor values."""
    digests: dict[str, str] = {}
    others: list[tuple[str, str]] = []
    for name, leaf in flatten(tree):
        if isinstance(leaf, torch.Tensor):
            digests[name] = tensor_digest(leaf)
        else:
            others.append((name, repr(leaf)))
    digests["<non-tensor values>"] = hashlib.sha256(repr(others).encode()).hexdigest()
    return digests


# ----------------------------------------------------------------------------------------------
# Worker: one training process (reference run, interrupted run or resumed run)
# ----------------------------------------------------------------------------------------------


def emit(event: str, **fields: Any) -> None:
    """Report progress to the parent as one JSON line on stdout."""
    print(EVENT_PREFIX + json.dumps({"event": event, **fields}), flush=True)


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
) -> dict[str, Any]:
    """Everything a resumed run needs. Modules/optimizers/schedulers are restored in place."""
    return {
        "model": model,
        "optim": optimizer,
        "sched": scheduler,
        "step": step,
        "rng": torch.get_rng_state(),
    }


def run_worker(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = Path(args.out)
    use_checkpoints = args.worker == "train"

    stream = make_token_stream(args.seed)
    torch.manual_seed(args.seed)
    model = TinyGPT()
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, args.steps)

    mgr: ckptlib.CheckpointManager | None = None
    restored: int | None = None
    if use_checkpoints:
        mgr = ckptlib.CheckpointManager(
            str(out / "ckpt"), keep_last=KEEP_LAST, keep_every=KEEP_EVERY
        )
        # What every training script does at start: resume if there is anything to resume.
        state = training_state(model, optimizer, scheduler, 0)
        restored = mgr.restore(state)
        if restored is not None:
            torch.set_rng_state(state["rng"])
            if state["step"] != restored:
                said = f"state['step'] is {state['step']!r}, restore() returned {restored}"
                emit("warning", text=said)
    emit(
        "start",
        resumed_from=restored,
        checkpointing=use_checkpoints,
        params=count_params(model),
        pid=os.getpid(),
    )

    go = sys.stdin if args.lockstep else None
    model.train()
    for step in range(1 if restored is None else restored + 1, args.steps + 1):
        x, y = get_batch(stream, args.seed, step)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()

        saved = mgr is not None and step % args.save_every == 0
        if mgr is not None and saved:
            # Returns as soon as the state is snapshotted; the write continues in the background.
            mgr.save(step, training_state(model, optimizer, scheduler, step))
        emit("step", step=step, loss=loss.item(), lr=scheduler.get_last_lr()[0], saved=saved)
        if go is not None and not go.readline():  # lockstep: wait for the parent's go-ahead
            go = None

    if mgr is not None:
        mgr.close()  # waits for the last background save and raises if any save failed

    final = {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "sched": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        "step": args.steps,
    }
    final_url = out / f"final-{args.tag}"
    ckptlib.save(final, str(final_url))
    digests_path = out / f"final-{args.tag}.sha256.json"
    digests_path.write_text(json.dumps(fingerprint(final), indent=1, sort_keys=True))
    emit("done", final=str(final_url), digests=str(digests_path))
    return 0


# ----------------------------------------------------------------------------------------------
# Parent: orchestrate the three phases and compare
# ----------------------------------------------------------------------------------------------


@dataclass
class PhaseResult:
    returncode: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    killed_after: int | None = None  # last step reported before SIGKILL
    pid: int | None = None
    timed_out: bool = False
    seconds: float = 0.0

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "step"]

    def first(self, event: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["event"] == event), None)


def say(text: str = "") -> None:
    print(text, flush=True)


def worker_command(args: argparse.Namespace, worker: str, tag: str, lockstep: bool) -> list[str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker", worker,
        "--tag", tag,
        "--out", str(args.out),
        "--steps", str(args.steps),
        "--save-every", str(args.save_every),
        "--seed", str(args.seed),
    ]  # fmt: skip
    if lockstep:
        cmd.append("--lockstep")
    return cmd


def run_phase(
    args: argparse.Namespace, worker: str, tag: str, kill_at: int | None = None
) -> PhaseResult:
    """Start a worker process, relay its progress, and optionally SIGKILL it after `kill_at`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    result = PhaseResult()
    started = time.monotonic()
    proc = subprocess.Popen(
        worker_command(args, worker, tag, lockstep=kill_at is not None),
        stdin=subprocess.PIPE if kill_at is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=env,
    )
    result.pid = proc.pid

    def relay_stderr() -> None:  # the child's log messages and tracebacks, indented
        assert proc.stderr is not None
        for line in proc.stderr:
            print("      | " + line, end="", file=sys.stderr, flush=True)

    relay = threading.Thread(target=relay_stderr, daemon=True)
    relay.start()

    def on_timeout() -> None:
        result.timed_out = True
        proc.kill()

    watchdog = threading.Timer(args.phase_timeout, on_timeout)
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith(EVENT_PREFIX):
                print("      | " + line, end="", flush=True)  # anything else the child printed
                continue
            event = json.loads(line[len(EVENT_PREFIX) :])
            result.events.append(event)
            show_event(event, args, kill_at)
            if event["event"] != "step" or kill_at is None:
                continue
            if event["step"] >= kill_at:
                os.kill(proc.pid, signal.SIGKILL)  # no warning, no cleanup, no flush
                result.killed_after = event["step"]
                break
            assert proc.stdin is not None
            proc.stdin.write("\n")  # lockstep: let the child run the next step
            proc.stdin.flush()
        result.returncode = proc.wait()
        relay.join(timeout=10)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
    result.seconds = time.monotonic() - started
    return result


def show_event(event: dict[str, Any], args: argparse.Namespace, kill_at: int | None) -> None:
    kind = event["event"]
    if kind == "start":
        if event["resumed_from"] is None:
            if not event["checkpointing"]:
                say(f"      pid {event['pid']}: training from scratch, checkpointing off")
            else:
                say(f"      pid {event['pid']}: mgr.restore() found nothing; starting at step 1")
        else:
            step = event["resumed_from"]
            say(
                f"      pid {event['pid']}: mgr.restore() returned step {step}; going on from there"
            )
    elif kind == "step":
        step = event["step"]
        if step % args.save_every == 0 or step == args.steps or step == kill_at:
            note = "  -> checkpoint saved (async)" if event["saved"] else ""
            say(
                f"      step {step:4d}/{args.steps}  loss {event['loss']:.4f}  "
                f"lr {event['lr']:.2e}{note}"
            )
    elif kind == "warning":
        say(f"      warning: {event['text']}")


def list_steps(url: str) -> list[dict[str, Any]]:
    """What ckptlib sees on disk: one row per step (committed, incomplete or corrupt)."""
    with ckptlib.CheckpointManager(url) as mgr:
        infos = mgr.steps()
    rows = [
        {
            "step": int(info.step),
            "status": str(info.status),
            "reason": getattr(info, "reason", None),
        }
        for info in infos
    ]
    return sorted(rows, key=lambda r: r["step"])


def compare_final(out: Path) -> dict[str, Any]:
    """Compare the reference and resumed final states bitwise.

    `max_abs_diff` is over the floating-point tensors (weights, AdamW moments); every tensor,
    the uint8 RNG state included, must also match byte for byte.
    """
    ref = dict(flatten(ckptlib.load(str(out / "final-reference"))))
    res = dict(flatten(ckptlib.load(str(out / "final-resumed"))))
    mismatches: list[str] = []
    max_abs_diff = 0.0
    tensors = 0
    for name in sorted(set(ref) | set(res)):
        if name not in ref or name not in res:
            mismatches.append(f"{name}: only in {'reference' if name in ref else 'resumed'} run")
            continue
        a, b = ref[name], res[name]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            tensors += 1
            if a.dtype != b.dtype or a.shape != b.shape:
                mismatches.append(f"{name}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
                continue
            if a.numel() and a.is_floating_point():
                diff = (a.double() - b.double()).abs().max().item()
                max_abs_diff = max(max_abs_diff, diff)
            if tensor_bytes(a) != tensor_bytes(b):
                mismatches.append(f"{name}: tensor bytes differ")
        elif type(a) is not type(b) or a != b:
            mismatches.append(f"{name}: {a!r} vs {b!r}")

    # Second, independent check: digests the workers computed from their live objects.
    ref_digests = json.loads((out / "final-reference.sha256.json").read_text())
    res_digests = json.loads((out / "final-resumed.sha256.json").read_text())
    digest_mismatches = sorted(
        k for k in set(ref_digests) | set(res_digests) if ref_digests.get(k) != res_digests.get(k)
    )
    return {
        "tensors_compared": tensors,
        "values_compared": len(ref),
        "max_abs_diff": max_abs_diff,
        "mismatches": mismatches,
        "sha256_digests": len(ref_digests),
        "sha256_mismatches": digest_mismatches,
    }


def run_cli_ls(url: str) -> tuple[int, str]:
    script = Path(sys.executable).with_name("ckptlib")
    if script.exists():
        cmd = [str(script), "ls", url]
    else:  # not installed as a console script: call the same entry point directly
        entry = "import sys; from ckptlib.cli.main import main; sys.exit(main())"
        cmd = [sys.executable, "-c", entry, "ls", url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def prepare_out(out: Path) -> None:
    """Create --out, or clear it if (and only if) an earlier run of this demo created it."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not (out / MARKER).is_file():
            raise SystemExit(
                f"error: --out {out} is not empty and was not created by this demo; "
                "choose another folder (nothing was deleted)"
            )
        for entry in out.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("created by examples/train_gpt_resume.py; safe to delete\n")


def fail(summary: dict[str, Any], out: Path, *problems: str) -> int:
    summary["result"] = "FAIL"
    summary.setdefault("errors", []).extend(problems)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    say()
    say(f"FAIL: {problems[0]}")
    for problem in problems[1:]:
        say(f"      {problem}")
    say(f"      details: {out / 'summary.json'}")
    return 1


def run_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    prepare_out(out)
    ckpt_url = str(out / "ckpt")
    torch.manual_seed(args.seed)
    n_params = count_params(TinyGPT())
    summary: dict[str, Any] = {
        "result": None,
        "steps": args.steps,
        "save_every": args.save_every,
        "kill_at": args.kill_at,
        "seed": args.seed,
        "params": n_params,
        "checkpoint_dir": ckpt_url,
    }
    t0 = time.monotonic()

    say("ckptlib demo: kill a training run with SIGKILL, resume it, get bit-identical weights")
    say(
        f"  model: tiny GPT, {N_LAYER} blocks, d_model {D_MODEL}, {n_params:,} parameters, "
        f"AdamW + warmup/cosine LR, dropout {DROPOUT}"
    )
    say(
        f"  plan : {args.steps} steps, checkpoint every {args.save_every} steps "
        f"(keep_last={KEEP_LAST}, keep_every={KEEP_EVERY}), SIGKILL after step {args.kill_at}"
    )
    say(f"  out  : {out}")

    # -- 1. reference --------------------------------------------------------------------------
    say()
    say(f"[1/3] Reference run: {args.steps} steps in one go, no checkpoints")
    ref = run_phase(args, "reference", "reference")
    if ref.returncode != 0 or ref.first("done") is None:
        return fail(summary, out, f"reference run failed (exit status {ref.returncode})")
    say(f"      finished in {ref.seconds:.1f}s, final loss {ref.steps()[-1]['loss']:.4f}")

    # -- 2. interrupted ------------------------------------------------------------------------
    say()
    say(f"[2/3] Interrupted run: checkpoints to {ckpt_url}, SIGKILL after step {args.kill_at}")
    crash = run_phase(args, "train", "interrupted", kill_at=args.kill_at)
    if crash.timed_out or crash.killed_after is None:
        return fail(
            summary, out, f"interrupted run ended before the kill (exit status {crash.returncode})"
        )
    say(
        f"      SIGKILL sent to pid {crash.pid} after step {crash.killed_after} "
        f"(exit status {crash.returncode})"
    )
    summary["killed_after_step"] = crash.killed_after
    summary["saves_started"] = [e["step"] for e in crash.steps() if e["saved"]]
    try:
        on_disk = list_steps(ckpt_url)
    except Exception as exc:
        return fail(summary, out, f"listing {ckpt_url} after the crash failed: {exc!r}")
    committed = [r["step"] for r in on_disk if r["status"] == "committed"]
    summary["on_disk_after_kill"] = on_disk
    summary["committed_after_kill"] = committed
    say("      what ckptlib finds on disk after the crash:")
    for row in on_disk:
        reason = f"  ({row['reason']})" if row["status"] != "committed" and row["reason"] else ""
        say(f"        step {row['step']:4d}  {row['status']}{reason}")
    if not on_disk:
        say("        (nothing yet - the resumed run will start from scratch)")

    # -- 3. resumed ----------------------------------------------------------------------------
    say()
    say("[3/3] Resumed run: the same script in a fresh process")
    res = run_phase(args, "train", "resumed")
    start = res.first("start")
    resumed_from = start["resumed_from"] if start else None
    summary["resumed_from"] = resumed_from
    summary["steps_redone"] = crash.killed_after - (resumed_from or 0)
    if res.returncode != 0 or res.first("done") is None:
        return fail(summary, out, f"resumed run failed (exit status {res.returncode})")
    say(f"      finished in {res.seconds:.1f}s, final loss {res.steps()[-1]['loss']:.4f}")

    # -- compare -------------------------------------------------------------------------------
    say()
    say("Comparing the resumed run with the reference run ...")
    try:
        cmp = compare_final(out)
    except Exception as exc:
        return fail(summary, out, f"could not compare final states: {exc!r}")
    summary.update(cmp)
    ref_losses = {e["step"]: e["loss"] for e in ref.steps()}
    res_losses = {e["step"]: e["loss"] for e in res.steps()}
    summary["loss_curve_matches"] = all(ref_losses.get(s) == v for s, v in res_losses.items())
    newest = max(committed) if committed else None
    summary["resumed_from_newest_committed"] = resumed_from == newest

    problems: list[str] = []
    if cmp["mismatches"] or cmp["max_abs_diff"] != 0:
        first = "; ".join(cmp["mismatches"][:3])
        problems.append(f"{len(cmp['mismatches'])}/{cmp['values_compared']} values differ: {first}")
    if cmp["sha256_mismatches"]:
        first = ", ".join(cmp["sha256_mismatches"][:3])
        problems.append(f"{len(cmp['sha256_mismatches'])} SHA-256 digests differ: {first}, ...")
    if not summary["loss_curve_matches"]:
        problems.append("per-step losses after the resume differ from the reference run")
    if resumed_from != newest:
        problems.append(f"resumed from step {resumed_from}, newest committed was {newest}")

    say(
        f"  {cmp['tensors_compared']} tensors (model, AdamW moments, RNG) and "
        f"{cmp['values_compared'] - cmp['tensors_compared']} other values compared: "
        f"max abs diff {cmp['max_abs_diff']:g}, "
        f"{cmp['sha256_digests'] - len(cmp['sha256_mismatches'])}/{cmp['sha256_digests']} "
        "SHA-256 digests identical"
    )
    same = "yes" if summary["loss_curve_matches"] else "NO"
    say(f"  per-step losses after the resume identical to the reference run: {same}")
    if problems:
        return fail(summary, out, *problems)
    summary["resume_exact"] = True
    redone = summary["steps_redone"]
    story = (
        f"killed after step {crash.killed_after}, "
        + (
            f"resumed from committed step {resumed_from}"
            if resumed_from is not None
            else "no checkpoint had been committed yet, so it started over"
        )
        + f" ({redone} step{'s' if redone != 1 else ''} redone)"
    )
    say(f"  resume is exact: {story}")

    # -- ckptlib ls ----------------------------------------------------------------------------
    say()
    say(f"$ ckptlib ls {ckpt_url}")
    try:
        cli_rc, cli_out = run_cli_ls(ckpt_url)
    except Exception as exc:
        cli_rc, cli_out = -1, repr(exc)
    say("  " + cli_out.rstrip().replace("\n", "\n  "))
    summary["cli_ls_exit_status"] = cli_rc
    if cli_rc != 0:
        why = f"`ckptlib ls` exited with status {cli_rc} (the resume itself was exact)"
        return fail(summary, out, why)

    summary["result"] = "PASS"
    summary["seconds"] = round(time.monotonic() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    say()
    say(
        f"PASS: {story}; final weights and optimizer state are bitwise identical to the "
        "uninterrupted run (max abs diff 0)."
    )
    say(f"      summary: {out / 'summary.json'}  ({summary['seconds']}s)")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Kill a training run with SIGKILL, resume it with ckptlib, "
        "and check the result is bitwise identical to an uninterrupted run.",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder")
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument("--save-every", type=int, default=5, help="checkpoint interval (default 5)")
    parser.add_argument(
        "--kill-at",
        type=int,
        default=37,
        help="SIGKILL the interrupted run right after this step (default 37); "
        "a multiple of --save-every kills it while that checkpoint is being written",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for model, data, dropout")
    parser.add_argument(
        "--phase-timeout", type=float, default=300.0, help="seconds allowed per phase"
    )
    # Internal: how the parent starts the training processes.
    parser.add_argument("--worker", choices=["reference", "train"], help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="run", help=argparse.SUPPRESS)
    parser.add_argument("--lockstep", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    if args.save_every < 1:
        parser.error("--save-every must be at least 1")
    if args.worker is None and not 1 <= args.kill_at < args.steps:
        parser.error("--kill-at must be between 1 and --steps - 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_worker(args)
    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
