"""Global sequence number assignment (GSNA): the epoch slot schedule.

Pure and deterministic. Every shard derives the same schedule from the epoch
configuration broadcast by the membership service, so shards assign gsns on
their own with no cross-shard traffic.

The schedule: shard ``s`` with integer rate ``r_s`` (records per second)
expects its ``k``-th record (``k = 0, 1, ...``) at time ``(k + 1) / r_s`` after
the epoch starts. Projecting every shard's expected arrivals onto one time
axis, ties broken by shard id, gives a total order of (shard, slot) pairs; the
``i``-th pair in that order owns gsn ``base + i``.

Counting the pairs before (s, k) in closed form keeps everything in exact
integer arithmetic (no float ever decides an order)::

    before(t; s, k) = floor(((k+1) * r_t - [t >= s]) / r_s)

is the number of slots of shard t that precede slot k of shard s: slot j of t
comes first iff (j+1)/r_t < (k+1)/r_s, or the times are equal and t < s. For
t == s it is exactly k.  ``gsn(s, k) = base + sum_t before(t; s, k)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import numpy as np

EPOCH_BITS = 32
EPOCH_SPAN = 1 << EPOCH_BITS
#: Largest rate a shard may announce. Bounds (k+1)*r below 2**63 for any slot
#: index k < 2**32, so the int64 numpy arithmetic below cannot overflow.
MAX_RATE = 1 << 30
NS_PER_S = 1_000_000_000
#: Up to this many shards, plain integer loops beat numpy's per-call overhead.
SMALL = 32


def epoch_base(epoch: int) -> int:
    """First gsn of ``epoch``: e * 2^32 + 1."""
    return epoch * EPOCH_SPAN + 1


def epoch_end(epoch: int) -> int:
    """Last gsn of ``epoch``: (e + 1) * 2^32."""
    return (epoch + 1) * EPOCH_SPAN


def epoch_of(gsn: int) -> int:
    """The epoch a gsn belongs to (gsn 0 is the genesis position, epoch -1)."""
    return (gsn - 1) >> EPOCH_BITS


@dataclass(frozen=True)
class EpochConfig:
    """What the membership service broadcasts to start an epoch."""

    epoch: int
    shards: tuple[int, ...]  # sorted, unique
    rates: tuple[int, ...]  # records per second, one per shard, each >= 1

    def __post_init__(self) -> None:
        # ValueError, not assert: a configuration comes off the wire (EPOCH) and is input
        if self.epoch < 0:
            raise ValueError(f"epoch {self.epoch} is negative")
        if list(self.shards) != sorted(set(self.shards)):
            raise ValueError("shards must be sorted and unique")
        if len(self.rates) != len(self.shards):
            raise ValueError("one rate per shard")
        if not all(1 <= r <= MAX_RATE for r in self.rates):
            raise ValueError("rates must be in [1, MAX_RATE]")

    def at(self, epoch: int) -> EpochConfig:
        """The same shards and rates for ``epoch``. Skips the checks of ``__post_init__``
        (O(n log n) in the shards), which this config passed already: the membership
        service restates one config for every epoch of a block."""
        assert epoch >= 0, epoch
        if epoch == self.epoch:
            return self
        cfg = EpochConfig.__new__(EpochConfig)  # the class's own (it may run compiled)
        # frozen: fields are set the way the generated __init__ sets them
        object.__setattr__(cfg, "epoch", epoch)
        object.__setattr__(cfg, "shards", self.shards)
        object.__setattr__(cfg, "rates", self.rates)
        return cfg

    def with_rates(self, rates: tuple[int, ...]) -> EpochConfig:
        """The same epoch and shards at ``rates``, checked only for their count: the
        membership planner patches a few rates of a config that passed every check,
        each clamped into [1, MAX_RATE] (O(shards) checks per block otherwise)."""
        assert len(rates) == len(self.shards), (len(rates), len(self.shards))
        cfg = EpochConfig.__new__(EpochConfig)  # as at() makes one
        object.__setattr__(cfg, "epoch", self.epoch)
        object.__setattr__(cfg, "shards", self.shards)
        object.__setattr__(cfg, "rates", rates)
        return cfg

    @property
    def base(self) -> int:
        return epoch_base(self.epoch)

    @property
    def end(self) -> int:
        return epoch_end(self.epoch)

    def rate_of(self, shard: int) -> int:
        return self.rates[self.shards.index(shard)]


@dataclass
class EpochSchedule:
    """Slot <-> gsn arithmetic for one epoch configuration."""

    config: EpochConfig
    _index: dict[int, int] = field(init=False, repr=False)
    _slot_counts: dict[int, int] = field(init=False, repr=False)
    #: the rates as an array, built on first use: small configs never need it
    _rates_arr: Any = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self._index = {s: i for i, s in enumerate(self.config.shards)}
        self._slot_counts = {}
        self._rates_arr = None  # set here too: compiled, a field's default is not

    @property
    def _rates(self) -> np.ndarray:
        r = self._rates_arr
        if r is None:
            import numpy as np  # only configurations of more than SMALL shards use it

            r = self._rates_arr = np.asarray(self.config.rates, dtype=np.int64)
        return r  # type: ignore[no-any-return]

    # -- gsn of slots -----------------------------------------------------------------
    def _offsets(self, i: int, ks: np.ndarray) -> np.ndarray:
        """Offsets from base of slots ``ks`` (int64 array) of shard index ``i``."""
        import numpy as np

        rates = self._rates
        tie = (np.arange(rates.shape[0]) >= i).astype(np.int64)
        num = (ks[:, None] + 1) * rates[None, :] - tie[None, :]
        return (num // rates[i]).sum(axis=1)

    def slot_gsns(self, shard: int, first_slot: int, count: int) -> list[int]:
        """Gsns of slots ``first_slot .. first_slot+count-1`` of ``shard`` (may run past
        the epoch's end; callers cut at :meth:`slot_count`)."""
        i = self._index[shard]
        base = self.config.base
        if len(self.config.rates) <= SMALL:
            # numpy's per-call overhead dominates for a handful of shards
            rates = self.config.rates
            r_s = rates[i]
            terms = [(r_t, 1 if t >= i else 0) for t, r_t in enumerate(rates)]
            return [base + sum((k1 * r_t - tie) // r_s for r_t, tie in terms)
                    for k1 in range(first_slot + 1, first_slot + count + 1)]
        import numpy as np  # a process that never sees a large configuration never loads it

        ks = np.arange(first_slot, first_slot + count, dtype=np.int64)
        return [base + int(o) for o in self._offsets(i, ks)]

    def gsn(self, shard: int, slot: int) -> int:
        """Gsn of slot ``slot`` of ``shard`` (exact, pure-Python for small shard counts)."""
        i = self._index[shard]
        rates = self.config.rates
        if len(rates) > SMALL:
            return self.slot_gsns(shard, slot, 1)[0]
        r_s = rates[i]
        k1 = slot + 1
        total = 0
        for t, r_t in enumerate(rates):
            total += (k1 * r_t - (1 if t >= i else 0)) // r_s
        return self.config.base + total

    # -- inverse ------------------------------------------------------------------------
    def first_slots_after(self, gsn: int) -> np.ndarray:
        """For every shard (in config order), the first slot whose gsn exceeds ``gsn``.

        Vectorised binary search. ``gsn(s, k) - base`` lies within
        [(k+1)R/r_s - n, (k+1)R/r_s] (R the rate sum, n the shard count), so the
        search window per shard is only about n slots wide.
        """
        import numpy as np

        rates = self._rates
        n = rates.shape[0]
        base = self.config.base
        d = gsn - base + 1  # need offset >= d
        if d <= 0:
            return np.zeros(n, dtype=np.int64)
        total = int(rates.sum())
        # (k+1) >= d * r_s / R is necessary; (k+1) >= (d+n) * r_s / R is sufficient.
        lo = np.maximum((d * rates) // total - 1, 0)
        hi = ((d + n) * rates + total - 1) // total  # exclusive-ish upper bound, then +1 margin
        hi = hi + 1
        tie = (np.arange(n)[None, :] >= np.arange(n)[:, None]).astype(np.int64)
        # invariant: answer in [lo, hi]
        while True:
            active = lo < hi
            if not active.any():
                break
            mid = (lo + hi) // 2
            num = (mid[:, None] + 1) * rates[None, :] - tie
            offs = (num // rates[:, None]).sum(axis=1)
            ok = offs >= d
            hi = np.where(active & ok, mid, hi)
            lo = np.where(active & ~ok, mid + 1, lo)
        return lo

    def first_slot_after(self, shard: int, gsn: int) -> int:
        """First slot of ``shard`` whose gsn exceeds ``gsn``."""
        i = self._index[shard]
        if gsn < self.config.base:
            return 0
        rates = self.config.rates
        if len(rates) > SMALL:
            return int(self.first_slots_after(gsn)[i])
        d = gsn - self.config.base + 1
        total = sum(rates)
        r_s = rates[i]
        lo = max((d * r_s) // total - 1, 0)
        hi = ((d + len(rates)) * r_s + total - 1) // total + 1
        base = self.config.base
        while lo < hi:
            mid = (lo + hi) // 2
            if self.gsn(shard, mid) - base >= d:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def slot_count(self, shard: int) -> int:
        """How many slots ``shard`` owns in this epoch (slots whose gsn <= end)."""
        c = self._slot_counts.get(shard)
        if c is None:
            c = self.first_slot_after(shard, self.config.end)
            self._slot_counts[shard] = c
        return c

    # -- time ---------------------------------------------------------------------------
    def slots_due(self, shard: int, elapsed_ns: int) -> int:
        """How many slots of ``shard`` were expected to have arrived ``elapsed_ns`` after the
        epoch started (slot k is expected at (k+1)/rate seconds)."""
        if elapsed_ns <= 0:
            return 0
        return (elapsed_ns * self.config.rates[self._index[shard]]) // NS_PER_S

    def rate(self, shard: int) -> int:
        """``shard``'s rate in this epoch (records/s)."""
        return self.config.rates[self._index[shard]]

    def expected_ns(self, shard: int, slot: int) -> int:
        """Expected arrival of ``slot`` in ns after epoch start (rounded up)."""
        r = self.config.rates[self._index[shard]]
        return -((-(slot + 1) * NS_PER_S) // r)


class SlotCursor:
    """A shard's walk through its own slots in one epoch, with the next gsns cached.

    Assigning gsns one at a time is the hot path; the cursor computes them in
    numpy batches so the per-record cost is a list index.
    """

    BATCH = 16

    def __init__(self, schedule: EpochSchedule, shard: int) -> None:
        self.schedule = schedule
        self.shard = shard
        self.count = schedule.slot_count(shard)
        self._cache_first = 0
        self._cache: list[int] = []

    def gsn(self, slot: int) -> int:
        """Gsn of ``slot``; slot == count means 'past the epoch' and maps to end + 1."""
        idx = slot - self._cache_first
        if 0 <= idx < len(self._cache):
            return self._cache[idx]
        assert 0 <= slot <= self.count, (slot, self.count)
        if slot == self.count:
            return self.schedule.config.end + 1
        if idx < 0:
            # A look back (tick and insert interleave): one exact value, keep the window.
            return self.schedule.gsn(self.shard, slot)
        n = min(self.BATCH, self.count - slot)
        self._cache = self.schedule.slot_gsns(self.shard, slot, n)
        self._cache_first = slot
        return self._cache[0]

    def first_slot_after(self, gsn: int) -> int:
        return min(self.schedule.first_slot_after(self.shard, gsn), self.count)

    def passed(self, next_slot: int, gsn: int) -> int:
        """The next slot once every slot from ``next_slot`` up to ``gsn`` is passed (a
        no-op): ``next_slot`` itself when none of them is at or below ``gsn``."""
        if next_slot >= self.count or self.gsn(next_slot) > gsn:
            return next_slot
        return self.first_slot_after(min(gsn, self.schedule.config.end))


def partition_check(config: EpochConfig, upto: int) -> Sequence[int]:
    """Every gsn in [base, base+upto) with the shard that owns it, computed by brute force
    from the time-axis definition (for tests)."""
    from fractions import Fraction

    events = []
    for s, r in zip(config.shards, config.rates):
        k = 0
        while True:
            t = Fraction(k + 1, r)
            events.append((t, s, k))
            k += 1
            if k > upto:
                break
    events.sort()
    return [s for (_, s, _) in events[:upto]]
