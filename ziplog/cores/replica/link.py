"""A backup's link to its primary (sans-I/O): its state, when it last asked the primary
for a catch-up, and the primary incarnation it follows.

The link is the backup's fence (docs/ARCHITECTURE.md, Fencing): the HELLOs and PREFIXes
it sends carry the backup's state and name the primary incarnation they are meant for,
as that primary's registration named it when the driver linked to it; only FORWARDs from
that incarnation, meant for this backup's own, are applied; and the backup's ACKs name
it, so that a guess agrees only with that incarnation's decision.
"""

from __future__ import annotations

import enum

from ziplog.protocol import frames as f


class Link(enum.Enum):
    #: no primary known yet
    DOWN = "down"
    #: HELLO sent (again every hello_retry) and not answered yet
    CONNECTING = "connecting"
    #: the primary's forwards arrive and apply
    IN_STEP = "in_step"


#: Link changes: DOWN only before the first HELLO or FORWARD; (re)connecting from any
#: state (a new address, a RESUME, a HELLO repeated); IN_STEP only by a FORWARD that
#: applies.
_LINKS = {
    Link.DOWN: {Link.CONNECTING, Link.IN_STEP},
    Link.CONNECTING: {Link.CONNECTING, Link.IN_STEP},
    Link.IN_STEP: {Link.CONNECTING, Link.IN_STEP},
}


class PrimaryLink:
    __slots__ = ("state", "inc", "primary_inc", "hello_sent_at", "retry_ns")

    def __init__(self, incarnation: int, hello_retry_ns: int) -> None:
        self.state = Link.DOWN
        #: this backup's incarnation: what the primary's FORWARDs must be meant for
        self.inc = incarnation
        #: the primary incarnation followed (0: unknown, or a primary of a build before
        #: incarnations, which names none)
        self.primary_inc = 0
        #: when the last HELLO left (None: none unanswered)
        self.hello_sent_at: int | None = None
        self.retry_ns = hello_retry_ns

    def _become(self, state: Link) -> None:
        assert state in _LINKS[self.state], ("illegal link change", self.state, state)
        self.state = state

    def connect(self, now: int, primary_inc: int | None) -> None:
        """A HELLO leaves now; from a new incarnation (``primary_inc``; None: the same
        one, again) on, everything the backup sends names it."""
        if primary_inc is not None:
            self.primary_inc = primary_inc
        self._become(Link.CONNECTING)
        self.hello_sent_at = now

    def in_step(self) -> None:
        """A FORWARD applied: the primary answered."""
        self.hello_sent_at = None
        self._become(Link.IN_STEP)

    def may_ask(self, now: int) -> bool:
        """A catch-up may be asked for now (none is, or the last went unanswered for
        hello_retry); if so, it counts as asked."""
        if self.hello_sent_at is not None and now - self.hello_sent_at <= self.retry_ns:
            return False
        self.hello_sent_at = now
        return True

    def retry_due(self, now: int) -> bool:
        """A HELLO went unanswered for hello_retry: the primary may not be up yet, or the
        HELLO was lost."""
        sent = self.hello_sent_at
        return self.state is Link.CONNECTING and sent is not None and now - sent > self.retry_ns

    def deadline(self) -> int | None:
        sent = self.hello_sent_at
        return sent + self.retry_ns if self.state is Link.CONNECTING and sent is not None else None

    def forward_fenced(self, msg: f.Forward) -> bool:
        """``msg`` comes from the primary incarnation followed and is meant for this
        backup's: a FORWARD of the incarnation before (delayed past its restart) would put
        decisions in the log that the incarnation told our state may have lost, and one
        meant for this backup's incarnation before it would qualify it on a stream it
        does not hold all of. A primary that names no incarnation (a build before them)
        is taken at its word, as before."""
        if self.primary_inc == 0:
            return msg.inc == 0 or msg.to_inc == self.inc
        return msg.inc == self.primary_inc and msg.to_inc == self.inc

    def hello(self, shard: int, replica: int, frontier: int, guessed_top: int) -> f.Hello:
        return f.Hello(shard=shard, replica=replica, frontier=frontier, guessed_top=guessed_top,
                       to_inc=self.primary_inc, inc=self.inc)

    def prefix(self, replica: int, frontier: int) -> f.Prefix:
        return f.Prefix(replica=replica, frontier=frontier, to_inc=self.primary_inc)
