# Two commands from a fresh clone: `make demo` and `make test`. Each sets up .venv by itself.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# `make demo` installs what the demo needs (torch, the package, its `demo` extra: transformers and matplotlib);
# `make test` the test and docs toolchain on top (its `test` extra). Each stamp says which was installed.
STAMP := $(VENV)/.oomguard-installed
DEMO_STAMP := $(VENV)/.oomguard-demo-installed

.PHONY: demo test lint docs pytest wheel-check bench clean

$(STAMP): setup.cfg pyproject.toml scripts/bootstrap.sh
	PYTHON=$(PYTHON) sh scripts/bootstrap.sh $(VENV) test
	touch $(STAMP)

$(DEMO_STAMP): setup.cfg pyproject.toml scripts/bootstrap.sh
	PYTHON=$(PYTHON) sh scripts/bootstrap.sh $(VENV) demo
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m oomguard demo

test: lint docs pytest wheel-check

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The reference in docs/, strict: a broken link or anchor, a page out of the nav or a renamed public name fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Two workers: the suite is single-threaded Python most of the time (the simulator, fake tensors, subprocesses).
# loadgroup: the jobs of several ranks (tests/helpers/launch.py's RANKS) share one worker and run one at a time.
pytest: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup

# The built wheel in a fresh venv that sees torch (and what torch requires) alone: every module imports or names
# its extra, a guarded step recovers, `oomguard --help` runs. The test venv has numpy and the extras; users may not.
wheel-check: $(STAMP)
	$(BIN)/python scripts/wheel_check.py

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) site .mypy_cache .ruff_cache .pytest_cache oomguard.egg-info
