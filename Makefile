# Two commands do everything on a fresh machine:
#   make demo   - install into .venv and run the embedded end-to-end demo
#   make test   - install into .venv and run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: install demo test lint bench bench-e2e soak sim screenshots clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --config-settings editable_mode=compat -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/poolctl demo $(ARGS)

test: install
	$(PY) -m pytest $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .

bench: install
	$(PY) bench/store_bench.py
	$(PY) bench/storm.py
	$(PY) bench/api_bench.py
	$(PY) bench/lineage_bench.py
	$(PY) bench/scale.py

$(VENV)/.bench-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet --config-settings editable_mode=compat -e '.[dev,bench]'
	touch $@

bench-e2e: $(VENV)/.bench-installed  # poolkeeper at defaults beside Celery and procrastinate (bench/e2e.py)
	$(PY) bench/e2e.py $(ARGS)

soak: install  # the fault soak at full size (bench/soak.py; options after ARGS=, e.g. ARGS="--tasks 10000")
	$(PY) bench/soak.py $(ARGS)

HOURS ?=
sim: install  # the deterministic simulation (bench/sim.py): one seed; HOURS=8 runs seed after seed for 8 hours
	$(PY) bench/sim.py $(if $(HOURS),--hours $(HOURS)) $(ARGS)

screenshots: install  # the console's pictures in docs/ (needs Debian's chromium and chromium-driver)
	$(PY) -m tests.screenshots docs

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
