"""The committed charts in docs/img/ are what bench/plots.py draws from the committed data.

Renders from ``bench/results/plots/`` (no benchmark runs) into a temporary folder and compares
bytes with ``docs/img/``: a chart edited by hand, or data re-collected without re-rendering,
fails here. matplotlib is pinned and ships its own fonts, so rendering is reproducible.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_charts_match_the_stored_data(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_plots", REPO / "bench" / "plots.py")
    assert spec is not None and spec.loader is not None
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)

    paths = plots.render(tmp_path)
    assert [p.name for p in paths] == [
        "stall_vs_size.png", "save_load_vs_raw.png", "throughput_vs_ranks.png"
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        committed = REPO / "docs" / "img" / p.name
        assert committed.exists(), f"{committed} missing: run `make bench-plots` and commit it"
        assert p.read_bytes() == committed.read_bytes(), (
            f"docs/img/{p.name} differs from what bench/plots.py draws from "
            "bench/results/plots/: run `make bench-plots` and commit the PNGs"
        )
