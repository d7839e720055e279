"""``docs/DEPLOY.md`` followed as a new operator would, on machines made of network
namespaces (``ziplog/tools/netns.py``): every block that starts with ``# on: HOSTS`` is
run, in the document's order, on each of those hosts with the document's variables
(``ADDR``, ``ID``, ``SHARD``, ``REPLICA``, ``ZK``, ``ETC``, ``DATA``); a line ending in
``&`` is a server, started and left running; every other line must succeed. ZooKeeper,
which the document leaves to Debian's package, is started with the same settings by
``ZooKeeperEnsemble`` on the control hosts. At the end the client host's ``tail`` shows
the records inserted, in order. The systemd units' command lines are checked with
``--check-config``."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ziplog.tools import netns, procs
from ziplog.tools.placement import Host
from ziplog.tools.zk_ensemble import ZooKeeperEnsemble

#: why the walkthrough cannot run here (None: it can); the units' check needs no namespaces
NO_NETNS = netns.unavailable()

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "DEPLOY.md"
UNITS = ROOT / "docs" / "deploy" / "systemd"
BLOCK = re.compile(r"```sh\n# on: ([^\n]+)\n(.*?)```", re.S)


def walkthrough() -> list[tuple[list[str], str]]:
    """The document's runnable blocks: (hosts, body), in order."""
    return [(hosts.split(), body) for hosts, body in BLOCK.findall(DOC.read_text())]


def _env(host: str, index: int, addr: str, zk: str, etc: Path, data: Path) -> dict[str, str]:
    env = {**os.environ, "ADDR": addr, "ID": str(index), "ZK": zk, "ETC": str(etc), "DATA": str(data / host),
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT)}
    m = re.fullmatch(r"s(\d+)r(\d+)", host)
    if m:
        env["SHARD"], env["REPLICA"] = m.group(1), m.group(2)
    return env


def _segments(body: str) -> list[tuple[bool, str]]:
    """The body as (is_server, text): consecutive lines run as one script; each line that
    ends in ``&`` is a server of its own."""
    out: list[tuple[bool, str]] = []
    script: list[str] = []
    for line in body.splitlines():
        if line.rstrip().endswith("&"):
            if script:
                out.append((False, "\n".join(script)))
                script = []
            out.append((True, line.rstrip()[:-1].strip()))
        else:
            script.append(line)
    if any(s.strip() for s in script):
        out.append((False, "\n".join(script)))
    return out


@pytest.mark.skipif(NO_NETNS is not None, reason=f"no network namespaces here: {NO_NETNS}")
def test_the_walkthrough_runs_on_separate_hosts(tmp_path: Path) -> None:
    blocks = walkthrough()
    assert len(blocks) >= 5, "the document's runnable blocks were not found"
    names = netns.cluster_host_names(2, 2)
    etc, data, logs = tmp_path / "etc", tmp_path / "data", tmp_path / "logs"
    etc.mkdir()
    servers: list[subprocess.Popen[bytes]] = []
    outputs: list[str] = []
    with netns.NetnsBed(names) as bed:
        zk = ZooKeeperEnsemble(tmp_path / "zookeeper", size=3, hosts=[bed.hosts[f"ctl{i}"] for i in range(3)])
        zk.start()
        try:
            for hosts, body in blocks:
                for index, name in enumerate(hosts):
                    host: Host = bed.hosts[name]
                    env = _env(name, index, host.addr, zk.hosts, etc, data)
                    for is_server, text in _segments(body):
                        if is_server:
                            log = logs / f"{name}-{len(servers)}.log"
                            servers.append(procs.spawn(host.wrap(["bash", "-c", f"exec {text}"]), log, env=env,
                                                       cwd=ROOT))
                            continue
                        done = subprocess.run(host.wrap(["bash", "-e", "-c", text]), env=env, cwd=ROOT,
                                              capture_output=True, text=True, timeout=120)
                        assert done.returncode == 0, (
                            f"on {name}:\n{text}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}\n"
                            + "\n".join(f"{p.name}: {p.read_text(errors='replace')[-1500:]}" for p in logs.glob("*")))
                        outputs.append(done.stdout)
                for p in servers:
                    assert p.poll() is None, f"a server of the block on {hosts} exited: see {logs}"
            tail = [line.split(maxsplit=2)[2] for line in outputs[-1].splitlines() if len(line.split()) >= 3]
            assert tail[-2:] == ["hello", "deployed"], outputs[-1]
            status = next(o for o in outputs if "addr" in o and "primary" in o)
            for name in names:
                if name.startswith("s"):
                    assert f"tcp://{bed.hosts[name].addr}:" in status, status
        finally:
            procs.stop_many(servers)
            zk.stop()


def _exec_start(unit: Path) -> list[str]:
    line = next(x for x in unit.read_text().splitlines() if x.startswith("ExecStart="))
    return shlex.split(line[len("ExecStart="):])


@pytest.mark.parametrize("unit", sorted(p.name for p in UNITS.glob("*.service")))
def test_each_systemd_units_command_line_is_a_valid_process_invocation(unit: str, tmp_path: Path) -> None:
    settings = tmp_path / "ziplog.toml"
    settings.write_text('zk = "10.0.0.10:2181,10.0.0.11:2181,10.0.0.12:2181"\n'
                        'cluster_key_file = "/etc/ziplog/cluster.key"\n[storage]\nreplicas = 2\n'
                        '[kvshard]\nshards = 4\n[logdb_coordinator]\nkv_shards = 4\n')
    values: dict[str, Any] = {"${SHARD}": "0", "${REPLICA}": "1", "${ADDR}": "10.0.0.20", "%i": "1"}
    argv = []
    for word in _exec_start(UNITS / unit):
        for k, v in values.items():
            word = word.replace(k, v)
        argv.append({"/opt/ziplog/bin/python": sys.executable, "/etc/ziplog/ziplog.toml": str(settings)}.get(word, word))
    assert argv[0] == sys.executable and argv[1] == "-m", argv
    done = subprocess.run([*argv, "--check-config"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and "ok" in done.stdout, (argv, done.stderr)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed (Debian's systemd)")
@pytest.mark.parametrize("unit", sorted(p.name for p in UNITS.glob("*.service")))
def test_each_systemd_unit_passes_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    # systemd's own reading of the unit (sections, keys, values), as an instance of the
    # template; the interpreter the unit names is swapped for this one, which exists
    text = (UNITS / unit).read_text().replace("/opt/ziplog/bin/python", sys.executable)
    (tmp_path / unit).write_text(text)
    instance = tmp_path / unit.replace("@.", "@0-1.")
    done = subprocess.run(["systemd-analyze", "verify", str(instance)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on a key it could not parse, but says so: any word from it is a finding
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr
