"""Config files for server processes: every flag settable in TOML, flags override it.

A file may hold one process's settings (top-level keys) or a whole cluster's: a table
per role (``[storage]``, ``[mms]``, ``[failure_handler]``, ``[logdb_coordinator]``,
``[kvshard]``, ``[index_node]``, ``[aggregator]``, ``[feeder]``) whose keys apply to
that role only, beside top-level keys every role shares (``zk``,
``cluster_key_file``). A key is a flag's name without its dashes (``data_dir`` or
``data-dir`` for ``--data-dir``; ``no_notices = true`` for ``--no-notices``); a value
has the flag's type. Every error is reported at once, with its key. Secrets go by file
path only (``cluster_key_file``): a file of settings is read by more people than the
key should be.

Each process's ``main`` parses its command line with :func:`parse_args`, which adds
``--config FILE`` and ``--check-config`` (check the file against this process's flags,
print what is wrong, and exit) to its parser."""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path
from typing import Any, Sequence

#: the roles a cluster file may have a table for, and the module each one runs
ROLES = {
    "storage": "ziplog.server",
    "mms": "mms.server",
    "failure_handler": "failure_handler.server",
    "logdb_coordinator": "ziplog.logdb.coordinator",
    "kvshard": "ziplog.logdb.kvshard",
    "index_node": "ziplog.logbook.index_node",
    "aggregator": "ziplog.logbook.aggregator",
    "feeder": "ziplog.logbook.feeder",
}
#: keys that would put a secret in the file
SECRET_KEYS = frozenset(("cluster_key", "key", "secret", "password"))
#: top-level keys some role has: one this role lacks is another role's, not an error
SHARED_KEYS = frozenset(("zk", "cluster_key_file", "bind", "host", "advertise", "data_dir", "log_format", "log_level",
                         "metrics_port", "metrics_bind", "fsync", "name", "replicas", "registry_lease_s"))
#: flags a file cannot set (they are about the file itself)
NOT_IN_FILES = frozenset(("help", "config", "check_config"))


class ConfigError(ValueError):
    """What is wrong with a config file: every problem, one per line, each with its key."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _key(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def _actions_by_key(ap: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    out: dict[str, argparse.Action] = {}
    for action in ap._actions:
        for opt in action.option_strings:
            if opt.startswith("--"):
                out[_key(opt)] = action
    return out


def _value_for(action: argparse.Action, value: Any) -> Any:
    """``value`` from TOML as the flag would have it (ValueError: it cannot be)."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, not {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if not isinstance(action, argparse._StoreAction) or action.nargs not in (None, "?"):
        raise ValueError("cannot be set in a file")
    kind = action.type
    if isinstance(value, (dict, list)):
        raise ValueError(f"must be a single value, not {type(value).__name__}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, not {value!r}")
        out: Any = value
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"must be a number, not {value!r}")
        out = float(value)
    elif kind is None or kind is str:
        if not isinstance(value, str):
            raise ValueError(f"must be a string, not {value!r}")
        out = value
    else:  # Path, or a parser's own converter: from the text a flag would carry
        if isinstance(value, bool):
            raise ValueError(f"must not be a boolean: {value!r}")
        try:
            out = kind(value if isinstance(value, str) else str(value))  # type: ignore[operator]
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(str(exc) or f"invalid value {value!r}") from None
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}, not {value!r}")
    return out


def settings_for(ap: argparse.ArgumentParser, path: Path, role: str) -> dict[str, tuple[argparse.Action, Any]]:
    """The flags ``path`` sets for ``role``, each with its action and converted value.
    ConfigError lists every problem (unknown keys, wrong types, secrets, tables of other
    roles' misspellings) with its key."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read it: {exc.strerror or exc}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not TOML: {exc}"]) from None
    problems: list[str] = []
    shared = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in doc.items() if isinstance(v, dict)}
    for name in tables:
        if name not in ROLES:
            problems.append(f"{path}: [{name}]: not a role (roles: {', '.join(ROLES)})")
    actions = _actions_by_key(ap)
    out: dict[str, tuple[argparse.Action, Any]] = {}
    for where, values, strict in (("", shared, False), (f"[{role}] ", tables.get(role, {}), True)):
        for raw_key, value in values.items():
            key = _key(raw_key)
            if key in SECRET_KEYS:
                problems.append(f"{path}: {where}{raw_key}: secrets go by file path (cluster_key_file), never in "
                                "a settings file")
                continue
            action = actions.get(key)
            if action is None or key in NOT_IN_FILES:
                if strict or key not in SHARED_KEYS:
                    problems.append(f"{path}: {where}{raw_key}: not a setting of {role}")
                continue  # a shared key another role has (this one has no such flag)
            try:
                out[action.dest] = (action, _value_for(action, value))
            except ValueError as exc:
                problems.append(f"{path}: {where}{raw_key}: {exc}")
    if problems:
        raise ConfigError(problems)
    return out



def _config_path(argv: Sequence[str]) -> Path | None:
    """``--config FILE`` or ``--config=FILE`` in ``argv`` (before the parser sees it: a
    required flag may come from the file)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1])
    return None


def parse_args(ap: argparse.ArgumentParser, argv: Sequence[str] | None, role: str) -> argparse.Namespace:
    """``ap.parse_args(argv)`` with ``--config FILE`` (its settings become the defaults,
    flags override them) and ``--check-config`` (report the file's problems and exit:
    status 0 when there are none, 2 otherwise)."""
    ap.add_argument("--config", type=Path, default=None, metavar="FILE",
                    help=f"settings from this TOML file (top-level keys, and the [{role}] table); flags override them")
    ap.add_argument("--check-config", action="store_true", help="check --config against this process's flags and exit")
    args_list = list(sys.argv[1:] if argv is None else argv)
    path = _config_path(args_list)
    if path is not None:
        try:
            settings = settings_for(ap, path, role)
        except ConfigError as exc:
            print("\n".join(exc.problems), file=sys.stderr)
            raise SystemExit(2) from None
        for action, value in settings.values():
            action.default = value
            action.required = False  # given by the file; a flag still overrides it
    if "--check-config" in args_list:
        for action in ap._actions:
            action.required = False  # per-process flags (--shard, --id) are not the file's to give
    args = ap.parse_args(args_list)  # a usage error (a flag's value, a required flag missing) exits here
    if args.check_config:
        if path is None:
            ap.error("--check-config needs --config FILE")
        print(f"{path}: [{role}] ok")
        raise SystemExit(0)
    return args
