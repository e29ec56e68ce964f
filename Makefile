# Two entry points for a fresh machine: `make demo` and `make test` (`make docs` builds the
# documentation site into site/).
# Each creates the virtual environment it needs (torch pinned through constraints.txt).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint docs clean

$(STAMP): pyproject.toml setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m tests.parallel $(PYTEST_ARGS)

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict -d site

lint: $(STAMP)
	$(VENV)/bin/ruff check trainwarden agent supervisor tests examples benchmarks migrations
	$(VENV)/bin/mypy trainwarden

clean:
	rm -rf $(VENV) .pytest_cache site
