# Set-up is part of every target: a fresh clone needs only `make serve` or `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MODEL  ?= smollm2-135m-instruct
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install serve test bench chromium clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(PY) -m tokenmill.cli fetch $(MODEL)
	$(PY) -m tokenmill.cli serve $(MODEL) --host $(HOST) --port $(PORT)

test: install
	$(PY) -m tokenmill.cli fetch $(MODEL)
	$(PY) -m pytest -q

# Debian's chromium, for the /dashboard browser test (skipped without it); CI installs it first.
chromium:
	command -v chromium >/dev/null || apt-get install -y -q chromium || \
		(apt-get update -q && apt-get install -y -q chromium)

bench: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m tokenmill.cli bench throughput

clean:
	rm -rf $(VENV) *.egg-info
