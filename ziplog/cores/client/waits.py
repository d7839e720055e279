"""When a request is settled (sans-I/O): each class takes the decoded replies of one
request, replica by replica, and says when it is settled, or raises what it earned."""

from __future__ import annotations

from ziplog.protocol import frames as wire
from ziplog.protocol.errors import ZiplogError, from_reply


class Redirect(Exception):
    """The shard will not hold this record and holds no copy of it: the primary refused it
    for good (not a member, blocked awaiting recovery, its rid's epoch did not come in
    time, too many requests waiting) and every backup said it has no copy, or the
    recovering shard's authority said it will not hold it. Another shard may take it
    under the same client id and sequence number, and it still appears once.
    ``refusal`` is the primary's error, if it refused."""

    def __init__(self, refusal: wire.Error | None = None) -> None:
        super().__init__(refusal.message if refusal is not None else "the shard holds no copy")
        self.refusal = refusal


#: A primary's refusals are final: it will never decide the record (it remembers it). A
#: backup may still hold an acknowledged guess of it, which a failure recovery would roll
#: forward, so a refusal alone does not settle the insert: the client asks again until
#: every backup says it holds no copy (then the record may go elsewhere) or a recovery's
#: authority answers for good.
PRIMARY_REFUSALS = frozenset((wire.E_NOT_MEMBER, wire.E_NOT_READY, wire.E_TIMEOUT, wire.E_OVERLOADED,
                              wire.E_DISK_FULL, wire.E_LOG_FULL))
#: A backup's answers that it holds no copy and will not guess one (DISK_FULL: it cannot
#: write; LOG_FULL: it holds its limit of records in memory; either way it still holds
#: what the primary decides).
NO_COPY_ANSWERS = frozenset((wire.E_NO_GUESS, wire.E_DISK_FULL, wire.E_LOG_FULL))


#: A backup's latest answer when it holds no copy of the record (E_NO_GUESS).
NO_COPY = -1


class InsertWait:
    """Waits out one InsertAfter on a shard with ``n`` replicas (replica 0 the primary).

    The primary's ack is the decision. The insert is done when every backup's
    *latest* ack equals it; it took the fast path when every backup's *first* ack
    already did. During failure recovery a single *final* ack (from the replica whose
    state the failure handler keeps) settles it: that gsn is what recovery rolls forward.

    A record may only move to another shard once this shard provably holds no copy of
    it (``Redirect``): otherwise recovery could roll a backup's guess forward while the
    record is also stored elsewhere.

    Every ACK names the primary incarnation its gsn belongs to (``Ack.inc``: the
    primary's own; the one a backup follows): a backup's ACK agrees with the decision only
    when both name the same one (or either names none: a server of a build before). A
    guess a backup made for a restarted primary is no copy of a decision its previous
    incarnation took and lost with its unwritten tail.

    Each resend is a new round under a new request id (:meth:`next_round`). An ACK of
    any round counts, as it would have then; a refusal and a backup's "no copy" count
    only in reply to the current round. They are promises of one process, kept in its
    memory: a replica restarted on the same address forgot them, and an answer its
    previous incarnation gave (or one still on its way from it) must not be combined
    with what the new one says (a primary's refusal before a power loss, a backup's
    NO_GUESS after its restart, while the restarted primary parks the resend and
    decides it later: the record on two shards).
    """

    __slots__ = ("req_id", "earlier", "n", "decided", "decided_inc", "latest", "latest_inc", "first", "stable",
                 "refused", "frozen", "final")

    refused: wire.Error | None

    def __init__(self, req_id: int, replicas: int) -> None:
        self.req_id = req_id
        #: the ids of this wait's earlier rounds (one per resend: bounded by the call's
        #: deadline over the resend interval)
        self.earlier: set[int] = set()
        self.n = replicas
        self.decided: int | None = None
        #: the primary incarnation the decision's ACK named (0: none named)
        self.decided_inc = 0
        self.latest: list[int | None] = [None] * replicas
        #: the incarnation each replica's latest ACK named (0: none named)
        self.latest_inc: list[int] = [0] * replicas
        self.first: list[int | None] = [None] * replicas
        self.stable = 0
        self.refused = None  # the primary's final refusal
        self.frozen = False  # a replica said the shard is frozen for recovery
        self.final = False

    def next_round(self, req_id: int) -> None:
        """The request is sent again as ``req_id``: the refusal and the "no copy"
        answers collected so far no longer count (the ACKs do)."""
        assert req_id != self.req_id and req_id not in self.earlier, ("a round's id used twice", req_id)
        self.earlier.add(self.req_id)
        self.req_id = req_id
        self.refused = None
        self.latest = [None if g == NO_COPY else g for g in self.latest]

    def feed(self, replica: int, msg: wire.Reply) -> bool:
        """One reply from ``replica``; True once the insert is settled. Raises the
        server's error, or ``Redirect`` once the shard provably holds no copy."""
        t = type(msg)
        if msg.req_id != self.req_id:
            if t is not wire.Ack or msg.req_id not in self.earlier:
                return False  # a late answer to another request, or an earlier round's refusal
        if t is wire.Error:
            assert isinstance(msg, wire.Error)
            code = msg.code
            if code in NO_COPY_ANSWERS and replica > 0:
                self.latest[replica] = NO_COPY
                if self.first[replica] is None:
                    self.first[replica] = NO_COPY
            elif code == wire.E_NOT_HELD:
                raise Redirect(self.refused)
            elif code == wire.E_FROZEN:
                self.frozen = True
            elif code in PRIMARY_REFUSALS and replica == 0:
                self.refused = msg
            else:
                raise from_reply(code, msg.message)
            if self.refused is not None and all(self.latest[i] == NO_COPY for i in range(1, self.n)):
                raise Redirect(self.refused)
            return False
        if t is not wire.Ack:
            return False
        assert isinstance(msg, wire.Ack)
        gsn = msg.gsn
        if msg.stable > self.stable:
            self.stable = msg.stable
        if msg.final:
            self.decided = gsn
            self.final = True
            return True
        if replica == 0:
            if self.decided is not None and self.decided != gsn:
                # Only after a failure recovery that did not keep the record (it was never
                # acknowledged): the recovered primary placed the resend anew.
                self.latest = [None] * self.n
                self.latest_inc = [0] * self.n
                self.first = [None] * self.n
            self.decided = gsn
            self.decided_inc = msg.inc
        if self.first[replica] is None:
            self.first[replica] = gsn
        self.latest[replica] = gsn
        self.latest_inc[replica] = msg.inc
        return self.done

    def _agrees(self, replica: int) -> bool:
        """``replica``'s latest ACK is the decision: the same gsn, of the same primary
        incarnation (when both name one)."""
        if self.latest[replica] != self.decided:
            return False
        inc, decided_inc = self.latest_inc[replica], self.decided_inc
        return inc == decided_inc or not inc or not decided_inc

    def settled(self, replica: int) -> bool:
        """Nothing more is expected from ``replica`` for now (for the primary: its
        decision or refusal; for a backup: an ack equal to the decision, or no copy)."""
        if self.final:
            return True
        if replica == 0:
            return self.decided is not None or self.refused is not None or self.frozen
        return (self.decided is not None and self._agrees(replica)) or self.latest[replica] == NO_COPY

    @property
    def done(self) -> bool:
        if self.final:
            return True
        if self.decided is None:
            return False
        for i in range(self.n):
            if not self._agrees(i):
                return False
        return True

    @property
    def fast(self) -> bool:
        return not self.final and all(g == self.decided for g in self.first)

    @property
    def troubled(self) -> bool:
        """The shard is refusing or recovering: ask again soon, and send new records elsewhere."""
        return self.frozen or self.refused is not None


class ReadWait:
    """Waits out a ReadRecord sent to ``n`` replicas: one stable answer settles it, as
    does agreement of all."""

    __slots__ = ("req_id", "gsn", "n", "answers", "data", "stable")

    def __init__(self, req_id: int, gsn: int, replicas: int) -> None:
        self.req_id = req_id
        self.gsn = gsn
        self.n = replicas
        self.answers: dict[int, bytes] = {}
        self.data: bytes | None = None
        self.stable = 0  # highest stable watermark a replica reported

    def feed(self, replica: int, msg: wire.Reply) -> bool:
        if msg.req_id != self.req_id:
            return False
        if isinstance(msg, wire.Error):
            raise from_reply(msg.code, msg.message)
        if not isinstance(msg, wire.ReadOk):
            return False
        if msg.stable > self.stable:
            self.stable = msg.stable
        if msg.stable >= self.gsn:  # stable: every replica holds exactly this
            self.data = msg.data
            return True
        self.answers[replica] = msg.data
        if len(self.answers) == self.n:
            values = list(self.answers.values())
            if any(v != values[0] for v in values):
                raise ZiplogError("replicas disagree on a decided record")
            self.data = values[0]
            return True
        return False


class EachReplica:
    """Waits for one answer from each of ``n`` replicas (trim, status); an ERROR raises.
    Answers to an earlier attempt (another ``req_id``) are ignored."""

    __slots__ = ("req_id", "n", "replies")

    def __init__(self, req_id: int, replicas: int) -> None:
        self.req_id = req_id
        self.n = replicas
        self.replies: dict[int, wire.Reply] = {}

    def feed(self, replica: int, msg: wire.Reply) -> bool:
        if msg.req_id != self.req_id:
            return False
        if isinstance(msg, wire.Error):
            raise from_reply(msg.code, msg.message)
        self.replies[replica] = msg
        return len(self.replies) == self.n
