# ziplog: `make run` and `make test` are all a fresh machine needs.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO  := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup run test bench clean

setup: $(STAMP)

# System packages (ZooKeeper from Debian, a JRE for it), then a venv with the
# package and its extras. Re-runs only when pyproject.toml changes.
$(STAMP): pyproject.toml
	@if [ ! -f /usr/share/java/zookeeper.jar ] || ! command -v java >/dev/null; then \
		echo "installing ZooKeeper (Debian package)"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq zookeeper default-jre-headless >/dev/null; \
	fi
	@test -d $(VENV) || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,fast]'
	@touch $(STAMP)

run: setup
	$(PY) -m ziplog.demo

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m bench latency

clean:
	rm -rf $(VENV) results .pytest_cache
