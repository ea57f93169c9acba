# Every target sets up what it needs; `make test` on a fresh machine installs and runs the suite.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python

.PHONY: venv demo check test chaos lint bench clean

$(VENV)/.installed: pyproject.toml requirements/constraints.txt
	$(PY) -m venv $(VENV)
	# One pip command for everything (a second one breaks aiobotocore's botocore pin).
	# DS_BUILD_OPS=0: DeepSpeed installs without compiling its C++/CUDA ops (CPU machine).
	DS_BUILD_OPS=0 $(VPY) -m pip install -q -c requirements/constraints.txt -e '.[test,s3]' torch==2.13.0
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VPY) examples/train_gpt_resume.py --out runs/demo

# Static checks first (style, layering, types): CI fails on any of them. Needs Python 3.11+
# (import-linter 2.17 does); config in pyproject.toml ([tool.importlinter], [tool.mypy]).
check: venv
	$(VPY) -m ruff check ckptlib tests bench examples
	$(VENV)/bin/lint-imports
	$(VPY) -m mypy ckptlib

test: check
	$(VPY) -m pytest -q

# The full chaos matrix (seeded: CKPTLIB_TEST_SEED, default 1234), the long variants CI leaves
# out (tests/conftest.py LONG_VARIANTS), the 10,000 simulated
# coordination schedules, and the scale jobs (16/24 ranks) again beside a CPU hog on both cores
# (CKPTLIB_TEST_HOG). Every case appends a record
# (stamped with the commit it runs on) to runs/chaos/results.jsonl; every generated section of
# docs/reliability.md is re-rendered from that one file, even when a case failed, and the target
# fails if pytest failed, a must-be-zero count is not zero, or the report refused the records.
# It refuses to start on uncommitted changes to ckptlib/ or tests/: the page names the commit.
chaos: venv
	@git diff --quiet HEAD -- ckptlib tests && test -z "$$(git ls-files --others --exclude-standard -- ckptlib tests)" \
		|| { echo "make chaos: ckptlib/ or tests/ differ from HEAD; commit first (the report is stamped with the commit)"; exit 2; }
	rm -f runs/chaos/results.jsonl
	CKPTLIB_CHAOS_FULL=1 CKPTLIB_CHAOS_RECORD=runs/chaos/results.jsonl $(VPY) -m pytest -q -m 'chaos or long' tests; \
	status=$$?; \
	CKPTLIB_CHAOS_FULL=1 CKPTLIB_TEST_HOG=1 $(VPY) -m pytest -q tests/distributed/test_scale.py || status=1; \
	$(VPY) -m tests.chaos.report runs/chaos/results.jsonl docs/reliability.md || status=1; \
	exit $$status

lint: check
	$(VPY) -m ruff format --check ckptlib tests bench examples

bench: venv
	$(VPY) bench/bench_save_load.py

# Build the wheel, install it with core dependencies only into a fresh venv, run the README's
# quick start and CLI lines against it (tests/packaging/check_wheel.py; .ci/run calls it).
.PHONY: wheel-check bench-plots
wheel-check: venv
	$(VPY) tests/packaging/check_wheel.py

# Redraw docs/img/*.png from the stored results in bench/results/plots/ (no benchmark runs);
# `$(VPY) bench/plots.py collect` re-runs the benchmarks first (minutes).
bench-plots: venv
	$(VPY) bench/plots.py render

clean:
	rm -rf $(VENV) runs .pytest_cache
