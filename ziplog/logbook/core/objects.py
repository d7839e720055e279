"""BokiStore's objects and transactions as a sans-I/O protocol (Boki journal 5.2, after
Tango): JSON objects named by strings, whose updates are records in a book tagged with
the object's name; reading an object replays its tag.

* a **write** sets one field of one object (always takes effect);
* a transaction appends **txn_start** (its seqnum S is the snapshot: reads replay only up
  to S: snapshot isolation) and at the end **txn_commit** with its write set. The
  commit is speculative: it takes effect iff no *successful* write to an object it
  writes lies strictly between S and the commit's own seqnum (a failed transaction's
  commit in between is ignored, which may be decided only by looking at its own window:
  :meth:`Replay.committed` does so, once per commit, remembered);
* a read-only transaction appends nothing: it reads at the session's position.

Every engine reaches the same outcome for the same commit, because each is a function
of the records below it, and nothing can appear below a cut once served.

The steps yield :class:`Scan` (the records of one tag in a seqnum range, in order) and
the session's operations (:mod:`ziplog.logbook.core.session`); the library drives them.
"""

from __future__ import annotations

import bisect
from typing import Annotated, Any, Generator, Union

import msgspec

from ziplog.logbook.core.records import tag_of
from ziplog.protocol.app_records import RecordCodec

MAGIC = b"ZLBS"
FORMAT = 1
HEADER = MAGIC + bytes([FORMAT])
MAX_NAME = 256
#: views of one object an engine keeps
VIEWS_KEPT = 16
#: commit outcomes an engine remembers (the oldest forgotten first: decided again if asked)
OUTCOMES_KEPT = 1_000_000
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]


class Write(msgspec.Struct, array_like=True, tag=1, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    obj: Name
    field: Name
    value: Any


class TxnStart(msgspec.Struct, array_like=True, tag=2, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    txn: Annotated[int, msgspec.Meta(ge=0)]


class TxnCommit(msgspec.Struct, array_like=True, tag=3, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    txn: Annotated[int, msgspec.Meta(ge=0)]
    #: the seqnum of its txn_start: the snapshot it read
    start: Annotated[int, msgspec.Meta(ge=0)]
    #: (object, field, value), in the order written
    writes: list[tuple[Name, Name, Any]]


Update = Union[Write, TxnStart, TxnCommit]
_codec: RecordCodec[Update] = RecordCodec(HEADER, Update)
decode = _codec.decode


def encode(update: Update) -> bytes:
    """The update's bytes, refused (ValueError) when every replay would decode it as not
    BokiStore's (an empty or too long name: msgspec checks constraints only when
    decoding), which would make a write that is acknowledged and never takes effect."""
    data = _codec.encode(update)
    if decode(data) is None:
        raise ValueError(f"not a BokiStore update (names are 1..{MAX_NAME} characters): {update!r:.200}")
    return data


def object_tag(obj: str) -> int:
    """The tag an object's updates carry."""
    return tag_of("obj:" + obj)


class Scan:
    """Operation: the updates tagged ``tag`` with ``lo <= seqnum <= hi``, in seqnum
    order: a list of ``(seqnum, Update)`` is sent back."""

    __slots__ = ("tag", "lo", "hi")

    def __init__(self, tag: int, lo: int, hi: int) -> None:
        self.tag, self.lo, self.hi = tag, lo, hi


Steps = Generator[Any, Any, Any]


class Replay:
    """What an engine remembers of BokiStore's log: commit outcomes (final once decided)
    and object views (an object's fields as of a seqnum)."""

    def __init__(self) -> None:
        self.outcomes: dict[int, bool] = {}  # commit seqnum -> took effect
        #: object -> views built, as (seqnum the view is as of, fields), increasing; the
        #: last VIEWS_KEPT of each (a transaction's snapshot may lie behind the newest)
        self.views: dict[str, list[tuple[int, dict[str, Any]]]] = {}

    def committed(self, seqnum: int, commit: TxnCommit) -> Steps:
        """Whether the commit at ``seqnum`` took effect. Commits in its window that are
        not decided yet are decided first, with an explicit stack (a long chain of them
        needs no deep recursion)."""
        outcomes = self.outcomes
        stack: list[tuple[int, TxnCommit]] = [(seqnum, commit)]
        #: (commit seqnum, object) -> the updates of the object in that commit's window
        scans: dict[tuple[int, str], list[tuple[int, Update]]] = {}
        while stack:
            s, c = stack[-1]
            if s in outcomes:
                stack.pop()
                continue
            ok, first_undecided = True, None
            for obj in dict.fromkeys(o for o, _, _ in c.writes):
                if s - 1 <= c.start:
                    break
                updates = scans.get((s, obj))
                if updates is None:
                    updates = scans[(s, obj)] = yield Scan(object_tag(obj), c.start + 1, s - 1)
                for s2, u in updates:
                    if type(u) is Write and u.obj == obj:
                        ok = False
                    elif type(u) is TxnCommit and any(o == obj for o, _, _ in u.writes):
                        if s2 not in outcomes:
                            first_undecided = (s2, u)
                        elif outcomes[s2]:
                            ok = False
                    if not ok or first_undecided is not None:
                        break
                if not ok or first_undecided is not None:
                    break
            if first_undecided is not None and ok:
                stack.append(first_undecided)  # decide it, then look at this one again
                continue
            outcomes[s] = ok
            if len(outcomes) > OUTCOMES_KEPT:
                del outcomes[next(iter(outcomes))]
            stack.pop()
            if s == seqnum:
                return ok
        return outcomes[seqnum]

    def view(self, obj: str, at: int) -> Steps:
        """The object's fields as of seqnum ``at`` (a copy)."""
        kept = self.views.setdefault(obj, [])
        i = bisect.bisect_right(kept, at, key=lambda v: v[0])
        since, fields = kept[i - 1] if i else (0, {})
        fields = dict(fields)
        if since < at:
            updates = yield Scan(object_tag(obj), since + 1, at)
            for s, u in updates:
                if type(u) is Write and u.obj == obj:
                    fields[u.field] = u.value
                elif type(u) is TxnCommit and (yield from self.committed(s, u)):
                    for o, f, v in u.writes:
                        if o == obj:
                            fields[f] = v
            kept.insert(bisect.bisect_right(kept, at, key=lambda v: v[0]), (at, dict(fields)))
            if len(kept) > VIEWS_KEPT:
                del kept[0]
        return fields
