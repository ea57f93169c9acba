"""``ckptlib plan --params P --gpus G --mtbf-hours H ...``: how often to checkpoint, and what it costs.

Registered by :mod:`ckptlib.cli.main` (:func:`add_parser`), which calls :func:`cmd_plan` on the
main thread. No checkpoint is read: the inputs describe a cluster (:class:`ckptlib.simulate.Cluster`),
:func:`ckptlib.simulate.advise` recommends the interval(s) (Young/Daly, :mod:`ckptlib.schedule`)
and simulates a run with failures to predict overhead, lost work and goodput. Imports neither
torch nor numpy. Exit status: 0, or 2 for a bad input (one line naming the option).
The model and every default: docs/scale.md.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from .argtypes import int_at_least
from .output import CliError, Output

_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def _number(low: float, *, inclusive: bool = False, suffixes: bool = False, high: float = math.inf) -> Any:
    """An argparse type: a finite float > low (>= low when ``inclusive``), at most ``high``; with
    ``suffixes``, ``100B`` = 1e11, ``7K``, ``1.5T``."""

    def parse(text: str) -> float:
        raw, scale = text.strip(), 1.0
        if suffixes and raw[-1:].upper() in _SUFFIX:
            raw, scale = raw[:-1], _SUFFIX[raw[-1].upper()]
        try:
            value = float(raw) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low:g}, got {text!r}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "plan", parents=[common], help="recommend checkpoint intervals for a cluster (simulated)",
        description="Recommend how often to checkpoint a training job and predict the overhead, "
        "the work lost per failure and the goodput, from Young/Daly and a simulation of the run "
        "with random failures. Times default to estimates from sizes and bandwidths; pass "
        "measured values (--stall-seconds, --save-seconds) when you have them. Model: docs/scale.md.",
    )
    p.add_argument("--params", type=_number(0, suffixes=True), required=True, metavar="P",
                   help="model parameters, e.g. 100B, 7e9")
    p.add_argument("--gpus", type=int_at_least(1), required=True, metavar="G", help="GPUs in the job")
    rate = p.add_mutually_exclusive_group(required=True)
    rate.add_argument("--mtbf-hours", type=_number(0, high=1e9), metavar="H",
                      help="mean time between failures of the whole job, hours")
    rate.add_argument("--per-gpu-failure-rate", type=_number(0), metavar="R",
                      help="failures per GPU-hour (job MTBF = 1 / (R x G)); e.g. 2e-5")
    p.add_argument("--bytes-per-param", type=_number(0), default=16.0, metavar="B",
                   help="checkpoint bytes per parameter (default 16: weights + fp32 master + Adam)")
    p.add_argument("--gpus-per-node", type=int_at_least(1), default=8, metavar="N", help="default 8")
    p.add_argument("--snapshot-gbps", type=_number(0), default=10.0, metavar="GBPS",
                   help="per-GPU device-to-host copy rate, GB/s: estimates the stall (default 10)")
    p.add_argument("--persistent-gbps", type=_number(0), default=20.0, metavar="GBPS",
                   help="aggregate write/read bandwidth of the persistent tier, GB/s (default 20)")
    p.add_argument("--local-gbps", type=_number(0), metavar="GBPS",
                   help="per-node bandwidth of a node-local tier, GB/s (enables the tiered plan)")
    p.add_argument("--replicas", type=int_at_least(0), default=1, metavar="K",
                   help="local tier: copies of each node's bytes on other nodes (default 1)")
    p.add_argument("--local-loss-fraction", type=_number(0, inclusive=True), default=0.1, metavar="F",
                   help="local tier: fraction of failures that also lose the local copies (default 0.1)")
    p.add_argument("--restart-seconds", type=_number(0, inclusive=True), default=300.0, metavar="S",
                   help="fixed cost of a restart before loading: detect, reschedule, init (default 300)")
    p.add_argument("--stall-seconds", type=_number(0, inclusive=True), metavar="S",
                   help="measured training-loop stall per save (default: from --snapshot-gbps)")
    p.add_argument("--save-seconds", type=_number(0, inclusive=True), metavar="S",
                   help="measured time from save start to durable on the first tier "
                   "(default: from the bandwidths)")
    p.add_argument("--step-seconds", type=_number(0), metavar="S",
                   help="time of one training step: also print intervals in steps")
    p.add_argument("--failures", type=int_at_least(100, most=1_000_000), default=5000, metavar="N",
                   help="simulated failures per plan (default 5000, at most 1,000,000)")
    p.add_argument("--seed", type=int_at_least(0), default=0, metavar="N", help="simulation seed (default 0)")
    p.set_defaults(url="")


def cmd_plan(args: argparse.Namespace, out: Output) -> int:
    from ckptlib.simulate import Cluster, advise

    if args.local_loss_fraction > 1:
        raise CliError(f"--local-loss-fraction must be within [0, 1], got {args.local_loss_fraction:g}")
    mtbf_h = args.mtbf_hours if args.mtbf_hours is not None else 1.0 / (args.per_gpu_failure_rate * args.gpus)
    try:
        cluster = Cluster(
            params=args.params, gpus=args.gpus, mtbf_s=mtbf_h * 3600.0, bytes_per_param=args.bytes_per_param,
            gpus_per_node=args.gpus_per_node, snapshot_gbps=args.snapshot_gbps,
            persistent_gbps=args.persistent_gbps, local_gbps=args.local_gbps, replicas=args.replicas,
            local_loss=args.local_loss_fraction, restart_s=args.restart_seconds,
            stall_s=args.stall_seconds, save_s=args.save_seconds,
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    result = advise(cluster, failures=args.failures, seed=args.seed)
    if args.step_seconds is not None:
        for plan in result["plans"]:
            plan["interval_steps"] = max(1, round(plan["interval_s"] / args.step_seconds))
    inputs = {k: v for k, v in vars(args).items()
              if k not in ("json", "global_json", "storage_option", "global_storage_option",
                           "storage_options", "command", "url")}
    out.emit({"inputs": inputs, **result})
    _print(out, result, args.step_seconds)
    for warning in result["warnings"]:
        out.note(f"ckptlib: warning: {warning}")
    return 0


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _print(out: Output, result: dict[str, Any], step_s: float | None) -> None:
    d = result["derived"]
    out.print(f"checkpoint {d['checkpoint_bytes'] / 1e12:.3g} TB ({d['per_gpu_bytes'] / 1e9:.3g} GB per GPU, "
              f"{int(d['nodes'])} nodes); job MTBF {d['mtbf_hours']:.3g} h; stall {_duration(d['stall_s'])} "
              f"per save; durable after {_duration(d['durable_s'])}")
    for plan in result["plans"]:
        every = f" (steps: {plan['interval_steps']})" if step_s is not None else ""
        mark = "  <- recommended" if plan["name"] == result["recommended"] else ""
        out.print(f"\n{plan['name']}{mark}")
        out.print(f"  save every        {_duration(plan['interval_s'])} of compute{every}")
        if plan["name"] == "tiered":
            out.print(f"  persist every     {plan['persist_every']} saves "
                      f"({_duration(plan['persist_interval_s'])})")
        out.print(f"  stall overhead    {100 * plan['stall_fraction']:.3f} %")
        out.print(f"  lost per failure  {_duration(plan['lost_per_failure_s'])} of compute")
        out.print(f"  restarts          {100 * plan['restart_fraction']:.3f} % of wall time")
        out.print(f"  goodput           {100 * plan['goodput']:.2f} %  (simulated, "
                  f"{plan['failures']} failures)")
