"""Progress on demand without I/O: shard 0's replicas (real cores) hear NOTICEs from
shard 1's primary. A notice makes the primary pass the named gsn at once (its unused
slots become no-ops, replicated like any decision); one of a later epoch waits for it,
one of an earlier epoch, of a shard that is no member, or naming a gsn outside its epoch
changes nothing; a primary that does not decide ignores them; a member can burn at most
the rest of one epoch. A backup guesses past a notice as its primary places past it (its
log moves only by the primary's forwards). A primary that decided records announces them
to the other members, once per turn, and not to a shard that announced a higher gsn
itself."""

from __future__ import annotations

from tests.harness import ShardHarness, request
from ziplog.protocol import frames as wire
from ziplog.protocol.gsna import EpochConfig, EpochSchedule, epoch_base, epoch_end

SHARDS = (0, 1)


class Harness(ShardHarness):
    def __init__(self, replicas: int = 2) -> None:
        super().__init__({}, [[0, list(SHARDS)]], replicas=replicas)
        for r in range(1, replicas):
            self.cores[r].connect_primary(0)  # type: ignore[union-attr]
        self.pump()
        self.next_epoch()

    def notice(self, gsn: int, epoch: int | None = None, shard: int = 1) -> None:
        msg = wire.Notice(shard=shard, epoch=self.epoch if epoch is None else epoch, gsn=gsn)
        request(self.P, b"peer", wire.open_signed(KEY, wire.seal(KEY, wire.encode(msg)), wire.decode_member_request),
                self.now)
        self.pump()

    def slot_gsn(self, shard: int, slot: int) -> int:
        return EpochSchedule(self.config(self.epoch, SHARDS)).gsn(shard, slot)


from ziplog.protocol.auth import ClusterKey  # noqa: E402

KEY = ClusterKey(b"a test cluster's secret")


def test_a_notice_passes_the_gsn_at_once_and_the_backup_holds_the_no_ops_first() -> None:
    h = Harness()
    g = h.slot_gsn(1, 40)  # shard 1 decided its 41st slot
    before = h.P.frontier
    assert before < g
    h.notice(g)
    assert h.P.frontier >= g and h.B.frontier == h.P.frontier, "passed, and forwarded to the backup"
    assert h.P.stable >= g, "stable once the backup holds the no-ops: a subscriber may deliver g"
    # the next insert takes the first slot of ours after g
    h.insert(1, b"after the notice")
    h.pump()
    assert h.P.log.gsns[-1] > g and h.P.log.gsns[-1] == h.slot_gsn(0, EpochSchedule(
        h.config(h.epoch, SHARDS)).first_slot_after(0, g))


def test_notices_that_must_change_nothing() -> None:
    h = Harness()
    h.next_epoch()
    frontier = h.P.frontier
    h.notice(epoch_base(h.epoch - 1) + 5, epoch=h.epoch - 1)  # an earlier epoch
    h.notice(epoch_end(h.epoch) + 7)  # a gsn outside its epoch
    h.notice(h.slot_gsn(1, 5), shard=9)  # a shard that is no member
    h.notice(h.slot_gsn(1, 5), shard=0)  # ourselves
    assert h.P.frontier == frontier
    # a backup's log does not move (it only guesses past the gsn), and a frozen or
    # starting primary takes no notice
    msg = wire.Notice(shard=1, epoch=h.epoch, gsn=h.slot_gsn(1, 5))
    request(h.B, b"peer", msg, h.now)
    fresh = h.new_core(0)
    request(fresh, b"peer", msg, h.now)
    assert fresh.frontier == 0 and h.B.frontier == frontier


def test_a_notice_of_a_later_epoch_waits_for_it_and_none_goes_past_the_epoch() -> None:
    h = Harness()
    later = h.epoch + 1
    g = epoch_base(later) + 1000
    h.notice(g, epoch=later)
    assert h.P.frontier < epoch_base(later), "nothing of a later epoch passes now"
    h.next_epoch()
    assert h.P.frontier >= g, "the epoch began: the waiting notice passed it"
    # the largest gsn of the epoch burns at most this epoch's slots
    h.notice(epoch_end(h.epoch))
    assert h.P.frontier == epoch_end(h.epoch)
    h.next_epoch()
    assert h.P.frontier < epoch_end(h.epoch)


def test_a_primary_announces_its_records_once_per_turn_to_the_shards_not_past_them() -> None:
    h = Harness()
    h.insert(1, b"a")
    h.insert(2, b"b")
    h.pump()
    sent = [(s, m) for s, m in h.notices if isinstance(m, wire.Notice)]
    top = max(h.P.log.gsns)
    assert sent == [(1, wire.Notice(shard=0, epoch=h.epoch, gsn=top, stamp=h.now))], sent
    # in one turn we decide a record, then shard 1 announces a gsn beyond it: at the
    # turn's end shard 1 is known to be past ours, and is not told
    h.notices.clear()
    h.insert(3, b"c", to=(0,))
    ours = max(h.P.log.gsns)
    theirs = h.slot_gsn(1, 500)
    assert ours < theirs
    request(h.P, b"peer", wire.Notice(shard=1, epoch=h.epoch, gsn=theirs), h.now)
    h.pump()
    assert h.notices == []


def test_a_lone_backup_knows_the_no_ops_are_stable_when_it_applies_them() -> None:
    """Another shard's record waits for these no-ops to be stable, and subscriptions read
    a two-replica shard from its backup: the backup knows they are stable when the
    FORWARD that carries them lands (both replicas hold them), before the primary hears
    its PREFIX, and the primary sends nothing for stability alone."""
    h = Harness()
    h.now += 1_000_000_000  # long after the first epoch's FORWARDs
    g = h.slot_gsn(1, 40)
    request(h.P, b"peer", wire.Notice(shard=1, epoch=h.epoch, gsn=g), h.now)
    h.P.flush(h.now)
    forward = [m for d, m in h.P.ready().messages if isinstance(m, wire.Forward)]
    assert len(forward) == 1 and forward[0].stable < g, "the primary cannot know yet that the no-ops are stable"
    h.B.on_forward(forward[0], h.now)
    assert h.B.log.stable >= g, "the backup applied the no-ops and does not know both replicas hold them"
    h.B.flush(h.now)
    prefix = [m for _, m in h.B.ready().messages if isinstance(m, wire.Prefix)]
    assert prefix and h.P.stable < g
    h.P.on_request(b"backup", prefix[0], h.now)
    assert h.P.stable >= g
    h.P.flush(h.now + h.P.s.stable_push_ns)
    assert not [m for _, m in h.P.ready().messages if isinstance(m, wire.Forward)], \
        "a FORWARD for stability alone, which the backup already knows"


def test_with_two_backups_the_primary_tells_them_the_no_ops_are_stable() -> None:
    """With two backups neither knows what the other holds: the primary tells them (a
    FORWARD of the watermark) without waiting for a record of its own or a heartbeat."""
    h = Harness(replicas=3)
    h.now += 1_000_000_000
    g = h.slot_gsn(1, 40)
    h.notice(g)
    backups = [h.cores[1], h.cores[2]]
    assert h.P.stable >= g and all(b is not None and b.log.stable < g for b in backups), \
        "a backup took the no-ops for stable before the primary told it"
    deadline = h.P.next_deadline(h.now)
    assert deadline is not None and deadline - h.now < h.P.s.heartbeat_ns, "told no sooner than a heartbeat"
    h.now = deadline
    h.pump()
    assert all(b is not None and b.log.stable >= g for b in backups), "a backup still does not know"


def _insert_after_notice(to_backup: bool) -> tuple[Harness, bool]:
    """Shard 1 announces a gsn well beyond shard 0's next slot; the notice reaches shard
    0's primary (and its backup, when ``to_backup``), then an insert follows."""
    from ziplog.cores.client.waits import InsertWait

    h = Harness()
    g = h.slot_gsn(1, 40)
    note = wire.Notice(shard=1, epoch=h.epoch, gsn=g, stamp=5)
    for core in (h.P, h.B) if to_backup else (h.P,):
        request(core, b"peer", note, h.now)
    h.insert(1, b"after the notice", stamp=6)
    h.pump()
    w = InsertWait(1, 2)
    assert any(w.feed(i, m) for i, m in h.replies(1))
    assert w.decided is not None and w.decided > g, "the primary placed it past the notice"
    return h, w.fast


def test_a_backup_guesses_past_a_notice_as_its_primary_places_past_it() -> None:
    h, fast = _insert_after_notice(to_backup=True)
    assert fast and h.B.stats["confirmed_guesses"] == 1
    assert h.B.log.frontier == h.P.log.frontier, "its log moved only by the primary's forward"


def test_without_the_notice_the_backup_guesses_a_passed_slot() -> None:
    """What a notice to the backups is for (the test above would pass vacuously if
    nothing went wrong without it)."""
    h, fast = _insert_after_notice(to_backup=False)
    assert not fast and h.B.stats["reacks"] == 1


def test_a_backup_ignores_notices_of_other_epochs_and_outsiders() -> None:
    h = Harness()
    sp = h.B.role.spec  # type: ignore[union-attr]
    assert sp is not None
    before = sp.next_slot
    for msg in (wire.Notice(shard=1, epoch=h.epoch + 1, gsn=epoch_base(h.epoch + 1) + 50),
                wire.Notice(shard=1, epoch=h.epoch, gsn=epoch_end(h.epoch) + 7),
                wire.Notice(shard=9, epoch=h.epoch, gsn=h.slot_gsn(1, 40)),
                wire.Notice(shard=0, epoch=h.epoch, gsn=h.slot_gsn(1, 40))):
        request(h.B, b"peer", msg, h.now)
    assert sp.next_slot == before
    request(h.B, b"peer", wire.Notice(shard=1, epoch=h.epoch, gsn=h.slot_gsn(1, 40)), h.now)
    assert sp.next_slot > before


class IdleNeighbourHarness(Harness):
    """Shard 0 busy (100,000 records/s), shard 1 at the planner's lowest rate: shard 1
    owns one gsn in 501 of the epoch."""

    def config(self, epoch: int, members: tuple[int, ...]) -> EpochConfig:
        return EpochConfig(epoch, members, tuple(100_000 if s == 0 else 200 for s in members))


def test_a_shard_with_no_slot_below_the_news_is_not_told() -> None:
    """A busy shard's NOTICEs reach an idle shard only when they cross one of its slots:
    every other NOTICE would pass nothing there and move no guess, and would only wake
    its replicas. Every slot of the idle shard at or below a decided record is still
    named by a NOTICE (each NOTICE at the end of the turn that crossed it)."""
    h = IdleNeighbourHarness()
    sched = EpochSchedule(h.config(h.epoch, SHARDS))
    h.notices.clear()
    told: list[int] = []
    for seq in range(1, 1501):
        h.now += h.P.s.notice_interval_ns  # each turn may announce
        h.insert(seq, b"r", to=(0,))
        h.pump()
        top = max(h.P.log.gsns)
        told += [m.gsn for s, m in h.notices if isinstance(m, wire.Notice)]
        h.notices.clear()
        # the idle shard's slots at or below ``top``: the last of them is covered
        crossed = sched.first_slot_after(1, top)
        if crossed:
            assert told and max(told) >= sched.gsn(1, crossed - 1), (seq, crossed, told[-3:])
    crossed = sched.first_slot_after(1, max(h.P.log.gsns))
    assert crossed >= 2, "the test must cross some of the idle shard's slots"
    assert len(told) == crossed, (len(told), crossed)
    # each NOTICE crossed a slot the one before it had not
    for a, b in zip(told, told[1:]):
        assert sched.first_slot_after(1, a) < sched.first_slot_after(1, b)


def test_a_shard_that_missed_nothing_new_hears_again_in_the_next_epoch() -> None:
    """What a shard was told is forgotten when the epoch changes: the next epoch's first
    record that crosses a slot of the idle shard is announced again."""
    h = IdleNeighbourHarness()
    sched = EpochSchedule(h.config(h.epoch, SHARDS))
    seq = 0
    while sched.first_slot_after(1, max(h.P.log.gsns, default=0)) == 0:
        seq += 1
        h.now += h.P.s.notice_interval_ns
        h.insert(seq, b"r", to=(0,))
        h.pump()
    assert [m.gsn for _, m in h.notices if isinstance(m, wire.Notice)], "the first crossing is told"
    h.next_epoch()
    h.notices.clear()
    sched = EpochSchedule(h.config(h.epoch, SHARDS))
    while sched.first_slot_after(1, max(h.P.log.gsns)) == 0:
        seq += 1
        h.now += h.P.s.notice_interval_ns
        h.insert(seq, b"r", to=(0,))
        h.pump()
    notes = [m for _, m in h.notices if isinstance(m, wire.Notice)]
    assert len(notes) == 1 and notes[0].epoch == h.epoch


def test_a_notice_that_lost_the_race_to_the_close_and_an_announcement_the_close_overtook_are_counted() -> None:
    """STATUS says how often the epoch's close, not a NOTICE, released another shard's
    record: a NOTICE of an epoch this primary closed already (``late_notices``), and an
    announcement held back by the notice interval whose epoch closed first
    (``announcements_closed``). A NOTICE that changes nothing for another reason (a shard
    that is no member, a gsn outside its epoch) is not counted."""
    h = Harness()
    stats = h.P.stats
    h.notice(h.slot_gsn(1, 5), shard=9)
    h.notice(epoch_end(h.epoch) + 7)
    assert stats.get("late_notices", 0) == 0
    h.next_epoch()
    h.notice(epoch_base(h.epoch - 1) + 5, epoch=h.epoch - 1)
    assert stats["late_notices"] == 1
    # a record announced at once; the next one, within the interval, waits, and the
    # epoch closes before the interval is up
    h.insert(1, b"first", to=(0,))
    h.pump()
    h.insert(2, b"held back", to=(0,))
    h.pump()
    assert stats.get("announcements_closed", 0) == 0
    h.next_epoch()
    h.now += h.P.s.notice_interval_ns
    h.P.flush(h.now)
    assert stats["announcements_closed"] == 1



def test_a_shard_covers_the_gsns_below_its_first_slot_as_its_epoch_begins() -> None:
    """Nothing below a shard's first slot of an epoch is its own: its frontier starts just
    below that slot, so a record another shard decided there waits for no NOTICE (none is
    sent: the shard owns no slot below it) and for no close. Before, the frontier stayed
    at the epoch's base until the shard's first decision or the close: in the quiet
    simulation (``tests/sim/tails.py``) about 1 % of records waited for the close."""
    h = ShardHarness({}, [[0, list(SHARDS)]])
    h.B.connect_primary(0)
    h.pump()
    cfg = EpochConfig(0, SHARDS, (10, 1000))  # shard 0 slow: shard 1's slots come first
    first = EpochSchedule(cfg).gsn(0, 0)
    assert first > cfg.base + 10, "shard 1 owns the epoch's first gsns"
    for core in (h.P, h.B):
        core.on_epoch(cfg, h.now)
    h.pump()
    assert h.P.frontier == first - 1 and h.B.frontier == first - 1
    assert h.P.stable == first - 1 and h.B.stable == first - 1, "a subscriber may deliver shard 1's records there"
    # shard 1's record below our first slot: its primary tells us nothing, and we pass nothing
    request(h.P, b"peer", wire.Notice(shard=1, epoch=0, gsn=cfg.base + 3), h.now)
    h.pump()
    assert h.P.frontier == first - 1 and "passed_on_notice" not in h.P.stats
