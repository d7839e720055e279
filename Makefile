# ziplog: `make run` and `make test` are all a fresh machine needs.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO  := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup run test bench clean

# The hot path compiled with mypyc (ziplog/native.py), again whenever a source changed;
# ZIPLOG_PURE=1 runs the sources. Then the rest compiled to bytecode ahead: where
# PYTHONDONTWRITEBYTECODE is set, every process would compile every module it imports
# again (a server process starts on 15 % less CPU with them).
setup: $(STAMP)
	@$(PY) -m ziplog.tools.build_native
	@$(PY) -m compileall -q -j 0 ziplog mms failure_handler bench tests

# System packages from Debian (ZooKeeper and a JRE for it; nats-server and
# redis-server, the benchmark's real rivals; nftables, for the partition tests' firewall
# rules; iproute2, for the network namespaces of the multi-host tests and
# `ziplog cluster up --netns`; prometheus and its promtool, which check the monitoring
# files against a live cluster; systemd-analyze, which checks the units), installed in the
# background while a venv gets the package and its extras: first what the native build
# reads (the package, dev, fast), then the bench and spark extras while the native
# library builds (they only add packages the build never imports, and none the first
# step installed: 20 s saved on a fresh machine). Nothing pip or the build does needs a
# Debian package. The first step goes through uv (8 s where pip takes 45 s; pip if uv
# cannot be had); the extras stay with pip, hidden behind the native build. Re-runs only
# when pyproject.toml or this file changes.
$(STAMP): pyproject.toml Makefile
	@if [ ! -f /usr/share/java/zookeeper.jar ] || ! command -v java >/dev/null \
	    || ! command -v nats-server >/dev/null || ! command -v redis-server >/dev/null \
	    || ! command -v nft >/dev/null || ! command -v ip >/dev/null || ! command -v tcpdump >/dev/null \
	    || ! command -v promtool >/dev/null || ! command -v systemd-analyze >/dev/null; then \
		echo "installing ZooKeeper, nats-server, redis-server, nftables, iproute2, tcpdump, prometheus (Debian packages)"; \
		( $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
			zookeeper default-jre-headless nats-server redis-server nftables iproute2 tcpdump systemd >/dev/null \
		  && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
		) & apt=$$!; \
	else apt=; fi; \
	test -d $(VENV) || python3 -m venv $(VENV); \
	{ $(PY) -m pip install -q --disable-pip-version-check uv \
	  && $(VENV)/bin/uv pip install -q --python $(PY) -e '.[dev,fast]'; } \
	|| $(PY) -m pip install -q --disable-pip-version-check -e '.[dev,fast]' || exit 1; \
	$(PY) -c "import tomllib; extras = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; \
	    print(*extras['bench'], *extras['spark'], sep='\n')" > $(VENV)/extras.txt; \
	$(PY) -m pip install -q --disable-pip-version-check -r $(VENV)/extras.txt & extras=$$!; \
	$(PY) -m ziplog.tools.build_native; built=$$?; \
	wait $$extras || exit 1; \
	if [ -n "$$apt" ]; then wait $$apt || { echo "installing the Debian packages failed"; exit 1; }; fi; \
	exit $$built
	@touch $(STAMP)

run: setup
	$(PY) -m ziplog.tools.demo
	$(PY) -m ziplog.tools.logdb_demo
	$(PY) -m ziplog.tools.logbook_demo
	$(PY) -m ziplog.tools.flow_demo
	$(PY) -m ziplog.tools.spark_demo

# two workers (a module stays in one): the suite's clusters wait on timers and disks as
# much as they compute. The modules go out in the order tests/conftest.py gives them
# (longest first), not by their count of tests.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# every experiment, full length (about an hour); `python -m bench latency --quick` for two minutes
bench: setup
	$(PY) -m bench all

clean:
	rm -rf $(VENV) results .pytest_cache
	find ziplog -name '*.so' -delete
