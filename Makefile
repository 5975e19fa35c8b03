# Two commands on a fresh machine with Python 3.11:
#   make demo   runs the order-fulfilment saga demo on SQLite with the SQL transport (no servers)
#   make test   runs the whole test suite (PostgreSQL, MariaDB, Redis running; Kafka broker started by the tests)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck diagrams clean

$(VENV)/.installed: pyproject.toml
	python3.11 -m venv $(VENV) 2>/dev/null || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/saga-engine demo

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo 'no tests ran' >&2; exit 1; fi; exit $$rc

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy

diagrams: $(VENV)/.installed
	$(VENV)/bin/saga-engine diagram --app sagas.app:app --out diagrams/

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
