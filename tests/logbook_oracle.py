"""What a full genesis subscription says a LogBook read at a cut must answer: the
oracle the real-process LogBook tests hold every served answer to."""

from __future__ import annotations

import random
from typing import Any, Callable

import ziplog
from ziplog.logbook.core import records as r
from ziplog.logbook.core.session import MAX_SEQNUM

#: (how: "next" | "prev" | "tail", book, tag or None, seqnum, the cut it was served at, answer seqnum or None)
Served = tuple[str, int, "int | None", int, int, "int | None"]


def check_served(zk_hosts: str, served: list[Served], end: int) -> int:
    """Replay the log from genesis up to ``end`` and assert every served answer is what
    the log up to its cut says; how many reads found a record."""
    entries: list[tuple[int, int, tuple[int, ...]]] = []
    trims: list[tuple[int, int, int]] = []
    with ziplog.Client(zk_hosts) as c, c.subscribe(ziplog.RID_GENESIS, end=end) as sub:
        for rec in sub:
            x = r.decode(rec.data)
            if type(x) is r.Entry:
                entries.append((rec.rid.gsn, x.book, x.tags))
            elif type(x) is r.Trim:
                trims.append((rec.rid.gsn, x.book, x.seqnum))
    found = 0
    for how, book, tag, seqnum, cut, answer in served:
        assert cut <= end, (cut, end)
        point = max((p for g, b, p in trims if b == book and g <= cut), default=0)
        visible = [g for g, b, ts in entries if b == book and point <= g <= cut and (tag is None or tag in ts)]
        if how == "next":
            want = next((g for g in visible if g >= seqnum), None)
        else:
            want = max((g for g in visible if g <= seqnum), default=None)
        assert answer == want, (how, book, tag, seqnum, cut, answer, want)
        found += answer is not None
    return found


def random_ops(rng: random.Random, sessions: list[Any], steps: int, tags: list[int], recent: int = 10,
               from_zero: float = 0.0, faults: dict[int, Callable[[], object]] | None = None) -> list[Served]:
    """Random appends, trims and reads from ``sessions`` (LogBook sessions), ``faults[i]``
    run before step i; every read's answer and the cut it was served at (a session's
    position after the read), checking that no read went below the session's position.
    Reads ask near one of the last ``recent`` seqnums given; a read_next asks from 0 with
    chance ``from_zero``."""
    served: list[Served] = []
    given: list[int] = []
    for step in range(steps):
        if faults and step in faults:
            faults[step]()
        lb = rng.choice(sessions)
        before = lb.position
        what = rng.random()
        if what < 0.45:
            given.append(lb.append(b"%d" % rng.randrange(1000), rng.sample(tags, rng.randint(0, 2))))
        elif what < 0.5 and given:
            lb.trim(rng.choice(given[-10:]))
        else:
            how = rng.choice(["next", "prev", "tail"])
            tag = rng.choice([None, *tags])
            seqnum = rng.choice(given[-recent:]) + rng.randint(-1, 1) if given else 0
            if from_zero and rng.random() < from_zero:
                seqnum = 0 if how == "next" else seqnum
            if how == "next":
                rec = lb.read_next(seqnum, tag)
            elif how == "prev":
                rec = lb.read_prev(seqnum, tag)
            else:
                rec, seqnum = lb.check_tail(tag), MAX_SEQNUM
            assert lb.position >= before, "a read went below the session's position"
            served.append((how, lb.book_id, tag, seqnum, lb.position, None if rec is None else rec.seqnum))
    return served
