"""What a full genesis subscription says a LogBook read at a cut must answer: the
oracle the real-process LogBook tests hold every served answer to."""

from __future__ import annotations

import ziplog
from ziplog.logbook.core import records as r

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
