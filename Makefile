# Two commands do everything on a fresh machine:
#   make demo   - install into .venv and run the embedded end-to-end demo
#   make test   - install into .venv and run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: install demo test lint bench soak screenshots clean

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

soak: install  # the fault soak at full size (bench/soak.py; options after ARGS=, e.g. ARGS="--tasks 10000")
	$(PY) bench/soak.py $(ARGS)

screenshots: install  # the console's pictures in docs/ (needs Debian's chromium and chromium-driver)
	$(PY) -m tests.screenshots docs

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
