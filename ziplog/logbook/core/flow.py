"""BokiFlow's protocols (Boki journal 5.1, after Beldi) as sans-I/O steps: a workflow's
operations exactly once although the function that performs them crashes and is run
again, or runs twice at once.

A run of a workflow numbers its operations (1, 2, ...): a function is deterministic
given the outcomes of its operations, so every run of it asks for the same operation at
the same number. Every operation's outcome is a **step record** (tag ``hash(workflow,
step)``), and only the step's *first* record counts (``read_next(tag, 0)`` after the
append): a run that comes second, or again, takes the first one's outcome.

* **write** ``(table, key, value)``: the step record is the write; the database write
  is conditioned on the row's version: applied iff ``version < seqnum`` of the step's
  first record, so a repeat applies nothing, and of two writes to a row the later in
  the log wins wherever they land.
* **read**: the database's value, then its step record; a re-run reads the record.
* **remember**: a value the run made up, then its step record (the same way).
* **invoke** ``(function, input)``: a pre-record naming the callee's workflow id (in the
  calls' own namespace: ``flow_records.callee_of``), and a post-record with its return
  value, both first-wins; a call whose post-record exists is not made again, and the
  callee is a workflow of its own (exactly once by itself; a callee id whose intent is
  another function's is refused, :class:`WorkflowIdTaken`).
* **lock** / **unlock**: a lock's chain (:mod:`ziplog.logbook.core.flow_lock`) taken or
  given back for the step's holder (:func:`~ziplog.logbook.core.flow_records.holder_of`),
  the outcome a step record; a run that took the lock although the step's first record
  says it failed (it came second) gives it back, and if that run died before it could,
  the next step that finds the lock held by such a holder gives it back for it.
* **transaction**: Beldi's: per-key locks taken without waiting (a lock held elsewhere
  aborts), reads logged, writes kept, then a decision record (first-wins, with the
  write set); a commit applies the writes at the decision's seqnum, and the locks are
  given back after. Strict two-phase locking: serializable among transactions.

The steps yield the book's operations (:mod:`ziplog.logbook.core.book_ops`), those on
the locks' book inside :class:`OnLocks`, and :class:`DbWrite`, :class:`DbRead` and
:class:`Call`; a driver performs them (``ziplog.logbook.flow``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator

import msgpack

from ziplog.cores.app_session import relay
from ziplog.logbook.core import flow_records as fr
from ziplog.logbook.core.book_ops import Append, BookOp, ReadNext
from ziplog.logbook.core.flow_lock import LockChain

Steps = Generator[Any, Any, Any]


@dataclass(frozen=True, slots=True)
class OnLocks:
    """``op`` on the locks' book (performed as on the workflows' book)."""
    op: BookOp


@dataclass(frozen=True, slots=True)
class DbWrite:
    """Write ``value`` at ``table``/``key`` iff the row's version is below ``version``;
    whether it was written is sent back."""
    table: str
    key: str
    value: bytes
    version: int


@dataclass(frozen=True, slots=True)
class DbRead:
    """The value at ``table``/``key`` (None: no row) is sent back."""
    table: str
    key: str


@dataclass(frozen=True, slots=True)
class Call:
    """Run workflow ``workflow`` (function ``function``, ``input``) to its end; its
    outcome (:func:`pack_outcome` bytes) is sent back."""
    function: str
    workflow: str
    input: bytes


class WorkflowFailed(Exception):
    """A workflow (or a callee) ended with an exception; its text is the message."""


class WorkflowIdTaken(ValueError):
    """A call of a workflow id whose first intent is another function's: refused, never
    answered with that workflow's outcome. (A later call's input is not compared: the
    first intent's is the call's, as a step's first record is its outcome whatever a
    later run asked; a deterministic caller passes the same value, whose msgpack bytes
    may still differ, a map built in another order, and a duplicate request under one id
    is that request.)"""


class Suspended(Exception):
    """A run gave its worker back in the middle (a lock wait past its share, ``Env.lock``):
    it recorded nothing more, and the workflow runs again from its records when it is
    pushed again (the sweeper pushes every workflow with no done record)."""


class NondeterministicWorkflow(Exception):
    """A run of a workflow asked for another operation at a step than its first run did
    (its function depends on something it did not ask of its environment)."""


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def pack_outcome(ok: bool, value: Any) -> bytes:
    """A workflow's outcome: its return value, or (``ok`` False) its exception's text."""
    return pack([ok, value])


def unpack_outcome(data: bytes) -> Any:
    """The return value an outcome holds; WorkflowFailed if the workflow raised."""
    ok, value = unpack(data)
    if not ok:
        raise WorkflowFailed(value)
    return value


def first_of(tag: str, matches: Callable[[Any], bool]) -> Steps:
    """The first record of ``tag`` that ``matches`` (its decoded record): ``(seqnum,
    record)`` or None. Records of a colliding tag are skipped."""
    seqnum = 0
    while True:
        got = yield ReadNext(tag, seqnum)
        if got is None:
            return None
        at, data = got
        rec = fr.decode(data)
        if rec is not None and matches(rec):
            return at, rec
        seqnum = at + 1


def first_step(workflow: str, step: int, op: str | None, part: int = 0) -> Steps:
    """The first record of a step: ``(seqnum, Step)`` or None. ``op``: the operation this
    run asks for there (None: any); NondeterministicWorkflow if the record is another's."""
    found = yield from first_of(fr.step_tag(workflow, step), lambda r: type(r) is fr.Step and r.workflow == workflow
                                and r.step == step and r.part == part)
    if found is not None and op is not None and found[1].op != op:
        raise NondeterministicWorkflow(f"workflow {workflow!r} asks for a {op} at step {step}, where its first run "
                                       f"did a {found[1].op}")
    return found


def logged(workflow: str, step: int, op: str, value: bytes, part: int = 0) -> Steps:
    """Append ``value`` as the outcome of step ``step`` (operation ``op``), then take the
    step's first record (ours, or an earlier run's): ``(seqnum, value)`` of that record."""
    yield Append(fr.encode(fr.Step(workflow=workflow, step=step, part=part, op=op, value=value)),
                 fr.step_tag(workflow, step))
    found = yield from first_step(workflow, step, op, part)
    assert found is not None, ("a step record the session appended is not found", workflow, step)
    return found[0], found[1].value


# -- a workflow's beginning and end -----------------------------------------------------------------
def intent(workflow: str, function: str, input: bytes) -> Steps:
    """Call ``function(input)`` as ``workflow`` unless it was called already: the
    workflow's first intent, ``(seqnum, Intent)``; WorkflowIdTaken if that intent is of
    another function (the call is refused: its caller must not take that one's outcome)."""
    found = yield from read_intent(workflow)
    if found is None:
        yield Append(fr.encode(fr.Intent(workflow=workflow, function=function, input=input)),
                     fr.intent_tag(workflow), (fr.INTENTS,))
        found = yield from read_intent(workflow)
        assert found is not None, ("an intent the session appended is not found", workflow)
    if found[1].function != function:
        raise WorkflowIdTaken(f"workflow {workflow!r} was called as function {found[1].function!r}: a call of it "
                              f"as {function!r} is refused")
    return found


def read_intent(workflow: str) -> Steps:
    return (yield from first_of(fr.intent_tag(workflow),
                                lambda r: type(r) is fr.Intent and r.workflow == workflow))


def read_done(workflow: str) -> Steps:
    """The workflow's outcome (bytes), or None while it has none."""
    found = yield from first_of(fr.done_tag(workflow), lambda r: type(r) is fr.Done and r.workflow == workflow)
    return None if found is None else found[1].result


def finish(workflow: str, outcome: bytes) -> Steps:
    """Record the workflow's outcome; the first one recorded (what every caller gets)."""
    yield Append(fr.encode(fr.Done(workflow=workflow, result=outcome)), fr.done_tag(workflow))
    done = yield from read_done(workflow)
    assert done is not None, ("a done record the session appended is not found", workflow)
    return done


# -- the operations -----------------------------------------------------------------------------------
def write(workflow: str, step: int, table: str, key: str, value: bytes) -> Steps:
    fr.check_name("table", table)
    fr.check_name("key", key)
    seqnum, logged_value = yield from logged(workflow, step, "write", pack([table, key, value]))
    table, key, value = unpack(logged_value)  # the first run's write, whatever this run asked
    yield DbWrite(table, key, value, seqnum)


def read(workflow: str, step: int, table: str, key: str) -> Steps:
    found = yield from first_step(workflow, step, "read")
    if found is not None:
        return unpack(found[1].value)
    value = yield DbRead(fr.check_name("table", table), fr.check_name("key", key))
    _, logged_value = yield from logged(workflow, step, "read", pack(value))
    return unpack(logged_value)


def remember(workflow: str, step: int, make: Callable[[], bytes]) -> Steps:
    """A value a run makes up (a random number, the time): the first run's (``make`` is
    called only when the step has no record yet)."""
    found = yield from first_step(workflow, step, "remember")
    if found is not None:
        return found[1].value
    _, value = yield from logged(workflow, step, "remember", make())
    return value


def invoke(workflow: str, step: int, function: str, input: bytes) -> Steps:
    """Call ``function`` as a workflow of its own; its outcome (bytes)."""
    _, callee = yield from logged(workflow, step, "invoke", pack(fr.callee_of(workflow, step)))
    post = yield from first_step(workflow, step, "invoke", 1)
    if post is not None:
        return post[1].value
    outcome = yield Call(function, unpack(callee), input)
    _, logged_outcome = yield from logged(workflow, step, "invoke", outcome, part=1)
    return logged_outcome


def lock(workflow: str, step: int, chain: LockChain) -> Steps:
    """Try to take ``chain``'s lock for this step (no waiting); True if taken."""
    found = yield from first_step(workflow, step, "lock")
    if found is not None:
        return bool(unpack(found[1].value))
    holder = fr.holder_of(workflow, step)
    # The chain, then the step's record again at a cut at or above the chain's, then the
    # acquire from that chain. A run that read the step at a cut below its record (a
    # duplicate, a run again on an engine behind) may find the chain at a later cut
    # where an earlier run of this step took the lock and gave it back: an acquire then
    # would join, and hold the lock for good for a holder whose unlock is recorded. A
    # holder gives the lock back only after its step's record, so a step with no record
    # at or above the chain's cut has not given it back there.
    yield from _on_locks(chain.replay())
    found = yield from first_step(workflow, step, "lock")
    if found is not None:
        return bool(unpack(found[1].value))
    taken = yield from _on_locks(chain.acquire(holder))
    if not taken and chain.holder is not None and (yield from _failed_to_lock(chain.holder)):
        yield from _on_locks(chain.release(chain.holder))
        taken = yield from _on_locks(chain.acquire(holder))
    _, outcome = yield from logged(workflow, step, "lock", pack(taken))
    if taken and not unpack(outcome):
        yield from _on_locks(chain.release(holder))  # an earlier run of this step failed first
    return bool(unpack(outcome))


def _failed_to_lock(holder: str) -> Steps:
    """The lock step ``holder`` names recorded that it did not take the lock: a run of it
    that came second took it (its acquire joined after that record) and died before it
    gave it back (:func:`lock` does, below the acquire). No run of that step holds the
    lock then, nor ever will (the step's first record is every run's outcome), and no
    run of its workflow gives it back: whoever finds it may. A holder whose step has no
    record yet may still be taking it: it is left alone."""
    step = fr.step_of_holder(holder)
    if step is None:
        return False
    found = yield from first_step(*step, None)
    return found is not None and found[1].op == "lock" and not unpack(found[1].value)


def unlock(workflow: str, step: int, chain: LockChain, holder: str) -> Steps:
    """Give back the lock ``holder`` (the step that took it) holds."""
    found = yield from first_step(workflow, step, "unlock")
    if found is None:
        yield from _on_locks(chain.release(holder))
        yield from logged(workflow, step, "unlock", pack(True))


def _on_locks(steps: Steps) -> Steps:
    """Run a lock chain's steps on the locks' book."""
    return (yield from relay(steps, OnLocks))


# -- transactions ----------------------------------------------------------------------------------------
def decide(workflow: str, step: int, commit: bool, writes: list[list[Any]]) -> Steps:
    """A transaction's decision (first-wins): ``(seqnum, commit, writes)`` of the first
    decision record; a commit's writes are applied at its seqnum."""
    seqnum, value = yield from logged(workflow, step, "decide", pack([commit, writes]))
    commit, writes = unpack(value)
    if commit:
        for table, key, data in writes:
            yield DbWrite(table, key, data, seqnum)
    return seqnum, commit, writes
