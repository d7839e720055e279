"""Asking the index tier (sans-I/O): one lookup answered at one cut from every source.

The sources are the index nodes (the aggregator process, or an engine asking them
itself) or one aggregator (an engine asking through it). With one source the lookup goes
as it is (``exact=False``: the source picks a cut at or above the session's position).
With several, every node is asked at the same cut ``C`` (``exact=True``): the highest
cut all of them are known to have reached, and never below the session's position;
``read_next`` takes the smallest hit, ``read_prev`` the largest (IndiLog's aggregation,
with Boki's rule that an answer is computed on one prefix of the log). A node that no
longer answers at ``C`` (TOO_OLD: it dropped rows under a trim) makes the round start
again at its floor; a node that does not answer (BEHIND, BUSY, silence) is asked again
every ``retry_ns``; the lookup fails after ``timeout_ns``. A lookup that asks for its
hit's record has it in its result when the source that gave the hit kept it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

from ziplog.cores.effects import Messages
from ziplog.logbook.core import frames as f
from ziplog.logbook.core.index import Hit, first, last

#: a source that has not answered is asked again this often
RETRY_NS = 1_000_000_000
#: lookups in flight at most (more fail BUSY at once)
MAX_PENDING = 10_000


@dataclass(frozen=True, slots=True)
class Result:
    """A lookup's outcome: ``(cut, hit, trim_point, trimmed_top)``, or ``error`` (a
    frames' code); ``trimmed_top``: see ``Found``; ``record``: the hit's record, if
    asked for and kept where the hit came from."""
    key: Hashable
    cut: int = 0
    hit: Hit | None = None
    trim_point: int = 0
    trimmed_top: int = 0
    error: str | None = None
    message: str = ""
    record: bytes | None = None


class _Pending:
    __slots__ = ("key", "q", "deadline", "cut", "round", "answers", "asked_at", "needed")

    def __init__(self, key: Hashable, q: f.Lookup, deadline: int) -> None:
        self.key = key
        self.q = q
        self.deadline = deadline
        self.cut = q.cut
        #: the request id of the current round (answers to earlier ones are stale)
        self.round = 0
        #: source -> its answer in this round
        self.answers: dict[int, f.Found] = {}
        #: source -> when it was last asked in this round
        self.asked_at: dict[int, int] = {}
        #: how many nodes the assignment has at the cut, as the nodes say
        self.needed = 0


class AggregatorCore:
    def __init__(self, timeout_ns: int, retry_ns: int = RETRY_NS, max_pending: int = MAX_PENDING) -> None:
        self.timeout_ns = timeout_ns
        self.retry_ns = retry_ns
        self.max_pending = max_pending
        #: the sources' addresses (index: the node's number); None: not registered now
        self.sources: list[str | None] = []
        #: each source's watermark as it last said
        self.watermarks: list[int] = []
        self._pending: dict[int, _Pending] = {}  # round req -> lookup
        #: the keys of the lookups in flight (an asker's resend is not a new lookup)
        self._keys: set[Hashable] = set()
        self._req = 0

    def set_sources(self, addrs: list[str | None], now: int) -> Messages:
        """The sources now; a source whose address changed is asked again at once."""
        old = self.sources
        self.sources = list(addrs)
        self.watermarks = (self.watermarks + [0] * len(addrs))[:len(addrs)]
        out: Messages = []
        for p in list(self._pending.values()):
            for i, addr in enumerate(addrs):
                if addr is not None and (i >= len(old) or old[i] != addr) and i not in p.answers:
                    out.extend(self._ask(p, i, now))
        return out

    @property
    def pending(self) -> int:
        return len(self._pending)

    def lookup(self, key: Hashable, how: int, book: int, tag: int | None, seqnum: int, min_cut: int, now: int,
               exact: bool = False, record: bool = False) -> tuple[Messages, list[Result]]:
        """Start a lookup at a cut at or above ``min_cut`` (exactly there if ``exact``),
        asking for the hit's record with it if ``record``."""
        if key in self._keys:
            return [], []  # a resend of a lookup in flight: its answer comes once
        if len(self._pending) >= self.max_pending:
            return [], [Result(key, error=f.BUSY, message=f"{self.max_pending} lookups in flight")]
        q = f.Lookup(req=0, how=how, book=book, tag=tag, seqnum=seqnum, cut=min_cut, exact=exact, record=record)
        p = _Pending(key, q, now + self.timeout_ns)
        self._keys.add(key)
        if not exact and len(self.sources) > 1:
            p.cut = max(min_cut, min(self.watermarks))
        return self._round(p, now), []

    def _round(self, p: _Pending, now: int) -> Messages:
        self._pending.pop(p.round, None)
        self._req += 1
        p.round = self._req
        p.answers.clear()
        p.asked_at.clear()
        p.needed = 0
        self._pending[p.round] = p
        out: Messages = []
        for i in range(len(self.sources)):
            out.extend(self._ask(p, i, now))
        return out

    def _ask(self, p: _Pending, i: int, now: int) -> Messages:
        addr = self.sources[i]
        p.asked_at[i] = now
        if addr is None:
            return []
        single = len(self.sources) == 1
        q = f.Lookup(req=p.round, how=p.q.how, book=p.q.book, tag=p.q.tag, seqnum=p.q.seqnum, cut=p.cut,
                     exact=p.q.exact or not single, record=p.q.record)
        return [((addr,), q)]

    def on_answer(self, source: int, ans: f.Answer, now: int) -> tuple[Messages, list[Result]]:
        """An answer from source ``source`` (its position in the sources)."""
        if not (type(ans) is f.Found or type(ans) is f.Failed):
            return [], []
        p = self._pending.get(ans.req)
        if p is None or not 0 <= source < len(self.sources):
            return [], []  # an earlier round's, or a lookup that ended
        if type(ans) is f.Failed:
            if ans.code == f.TOO_OLD and ans.floor > p.cut and not p.q.exact:
                p.cut = ans.floor
                return self._round(p, now), []
            if ans.code in (f.BEHIND, f.BUSY):
                return [], []  # asked again on the next tick
            return [], [self._end(p, Result(p.key, error=ans.code, message=ans.message))]
        assert type(ans) is f.Found
        self.watermarks[source] = ans.watermark
        p.needed = max(p.needed, ans.nodes)
        if p.needed > len(self.sources):
            # nodes were added from an epoch at or below the cut, and these sources do not
            # know them yet: the answer waits until they do (set_sources asks the new ones)
            if len(self.sources) > 1:
                p.answers[source] = ans
            return [], []
        if len(self.sources) == 1:
            hit = Hit(ans.gsn, ans.shard) if ans.found else None
            return [], [self._end(p, Result(p.key, ans.cut, hit, ans.trim_point, ans.trimmed_top,
                                            record=ans.record if hit is not None else None))]
        if ans.cut != p.cut:
            return [], []  # not this round's cut (cannot happen with exact lookups): ignore
        p.answers[source] = ans
        return [], self._complete(p)

    def _complete(self, p: _Pending) -> list[Result]:
        """The round's result once every node at the cut answered, all fed by the same
        assignment (a node that has not learned a step its peers have at the cut yet is
        asked again)."""
        for source in [s for s, a in p.answers.items() if a.nodes < p.needed]:
            del p.answers[source]
        if len(p.answers) < len(self.sources) or p.needed > len(self.sources):
            return []
        hits = [Hit(a.gsn, a.shard) if a.found else None for a in p.answers.values()]
        hit = first(hits) if p.q.how == f.NEXT else last(hits)
        point = max(a.trim_point for a in p.answers.values())
        top = max(a.trimmed_top for a in p.answers.values())  # each entry is on one node
        record = None if hit is None else next(
            (a.record for a in p.answers.values() if a.found and a.gsn == hit.gsn), None)
        return [self._end(p, Result(p.key, p.cut, hit, point, top, record=record))]

    def _end(self, p: _Pending, result: Result) -> Result:
        self._pending.pop(p.round, None)
        self._keys.discard(p.key)
        return result

    def tick(self, now: int) -> tuple[Messages, list[Result]]:
        """Fail what is past its deadline; ask again the sources that did not answer."""
        out: Messages = []
        results: list[Result] = []
        for p in list(self._pending.values()):
            if now >= p.deadline:
                results.append(self._end(p, Result(p.key, error=f.BEHIND, message=(
                    f"the index tier did not answer at a cut at or above {p.cut} in time"))))
                continue
            for i in range(len(self.sources)):
                if i not in p.answers and now - p.asked_at.get(i, 0) >= self.retry_ns:
                    out.extend(self._ask(p, i, now))
        return out, results

    def status(self) -> dict[str, Any]:
        return {"sources": len(self.sources), "watermark": min(self.watermarks, default=0), "pending": len(self._pending)}
