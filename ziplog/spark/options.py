"""The options of ``format("ziplog")``, named as in Spark's Kafka source, read from the
case-insensitive mapping Spark hands over (never copied into a plain dict: that would
lower-case the keys and lose the options a user spelled in camel case)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

#: a partition holds at most this many records unless told otherwise
DEFAULT_RECORDS_PER_PARTITION = 100_000
ENV_ZK = "ZIPLOG_ZK"


class OptionError(ValueError):
    pass


def _get(options: Mapping[str, str], name: str) -> str | None:
    # Spark's mapping is case-insensitive; a plain mapping (tests) is looked up both ways
    if name in options:
        return options[name]
    low = name.lower()
    for k in options:
        if k.lower() == low:
            return options[k]
    return None


def _int(options: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = _get(options, name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise OptionError(f"option {name} must be an integer, not {raw!r}") from None
    if value < 0:
        raise OptionError(f"option {name} must not be negative")
    return value


def _offset(options: Mapping[str, str], name: str, words: tuple[str, ...]) -> str | int | None:
    raw = _get(options, name)
    if raw is None:
        return None
    if raw.strip().lower() in words:
        return raw.strip().lower()
    try:
        value = json.loads(raw)
        gsn = value["gsn"]
        assert type(gsn) is int and gsn >= 0
        return gsn
    except Exception:
        raise OptionError(f"option {name} must be one of {', '.join(words)} or {{\"gsn\": N}}, not {raw!r}") from None


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _get(options, name)
    if raw is None:
        return default
    if raw.strip().lower() in ("true", "1", "yes"):
        return True
    if raw.strip().lower() in ("false", "0", "no"):
        return False
    raise OptionError(f"option {name} must be true or false, not {raw!r}")


def _seconds(options: Mapping[str, str], name: str, default: float) -> float:
    raw = _get(options, name)
    if raw is None:
        return default
    text = raw.strip().lower()
    for unit, factor in (("ms", 0.001), ("s", 1.0), ("m", 60.0)):
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return float(text[: -len(unit)]) * factor
    try:
        return float(text) / 1000.0  # a bare number is milliseconds, as in Spark
    except ValueError:
        raise OptionError(f"option {name} must be a duration such as 500ms or 5s, not {raw!r}") from None


@dataclass(frozen=True)
class ReadOptions:
    zk: str
    #: "earliest", "latest" or a gsn (exclusive: the first row has a gsn above it)
    starting: str | int
    #: batch only: "latest" or a gsn (inclusive)
    ending: str | int
    max_records_per_trigger: int | None
    min_records_per_trigger: int | None
    max_trigger_delay_s: float
    min_partitions: int | None
    records_per_partition: int
    fail_on_data_loss: bool
    #: option keyFile: the client key of a cluster that speaks CURVE (rights: read, and
    #: admin for the trim points the plan asks STATUS for); None: $ZIPLOG_CLIENT_KEY_FILE
    key_file: str | None = None

    @staticmethod
    def parse(options: Mapping[str, Any], streaming: bool) -> "ReadOptions":
        zk = _get(options, "zk") or os.environ.get(ENV_ZK)
        if not zk:
            raise OptionError(f"option zk (ZooKeeper hosts) is required, or set ${ENV_ZK}")
        starting = _offset(options, "startingOffsets", ("earliest", "latest"))
        ending = _offset(options, "endingOffsets", ("latest",))
        if streaming and ending is not None:
            raise OptionError("endingOffsets is for batch queries only")
        return ReadOptions(
            zk=zk,
            starting=starting if starting is not None else ("latest" if streaming else "earliest"),
            ending=ending if ending is not None else "latest",
            max_records_per_trigger=_int(options, "maxRecordsPerTrigger", None),
            min_records_per_trigger=_int(options, "minRecordsPerTrigger", None),
            max_trigger_delay_s=_seconds(options, "maxTriggerDelay", 15 * 60.0),
            min_partitions=_int(options, "minPartitions", None),
            records_per_partition=_int(options, "maxRecordsPerPartition", DEFAULT_RECORDS_PER_PARTITION) or 1,
            fail_on_data_loss=_bool(options, "failOnDataLoss", True),
            key_file=_get(options, "keyFile"),
        )


@dataclass(frozen=True)
class WriteOptions:
    zk: str
    #: names a batch write for exactly-once across re-runs (streaming uses the query id)
    write_id: str | None
    #: a partition's rows keep their order in the log (one insert in flight), or are
    #: pipelined in no particular order
    ordered: bool = True
    #: option keyFile (rights: append, read); None: $ZIPLOG_CLIENT_KEY_FILE
    key_file: str | None = None
    #: option allowSingleReplica: write to a cluster with a shard of one replica, where a
    #: task that runs again is not exactly once (refused by default: ``sink.SingleReplicaError``)
    allow_single_replica: bool = False

    @staticmethod
    def parse(options: Mapping[str, Any]) -> "WriteOptions":
        zk = _get(options, "zk") or os.environ.get(ENV_ZK)
        if not zk:
            raise OptionError(f"option zk (ZooKeeper hosts) is required, or set ${ENV_ZK}")
        return WriteOptions(zk=zk, write_id=_get(options, "writeId"), ordered=_bool(options, "ordered", True),
                            key_file=_get(options, "keyFile"),
                            allow_single_replica=_bool(options, "allowSingleReplica", False))
