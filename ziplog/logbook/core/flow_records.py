"""BokiFlow's records in a book, and their tags (Boki journal 5.1, after Beldi).

A workflow is named by an id (a string its caller picks, or a random one; a call a
workflow makes is named by :func:`callee_of`, in a namespace of its own that no
caller's id enters: :func:`check_workflow_id`); every operation it performs is a
numbered **step**. Each kind of record is tagged so that
its readers find it with one ``read_next(tag, 0)``, and names what it belongs to in
full, because a tag is a 64-bit hash: a record of another workflow (or another
library) under a colliding tag is skipped by every reader the same way.

* :class:`Intent` (tag :func:`intent_tag` and :data:`INTENTS`): workflow ``workflow``
  is function ``function`` called with ``input``. The first intent of an id is the
  call; a later one (a duplicate request) changes nothing.
* :class:`Step` (tag :func:`step_tag`): the outcome of step ``step`` of a run of the
  workflow (``part`` 1 is an invoke's return value beside part 0, its callee's id). The
  first record of a step is the outcome every run of the workflow takes.
* :class:`Done` (tag :func:`done_tag`): the workflow's return value; the first counts.
* :class:`LockOp` (tag :func:`lock_tag`, in the locks' book): a link of a lock's chain
  (:mod:`ziplog.logbook.core.flow_lock`).

Values (a step's outcome, an input, a return value) are msgpack bytes, encoded by the
environment: what a function may pass is what msgpack holds.
"""

from __future__ import annotations

from typing import Annotated, Union

import hashlib

import msgspec

from ziplog.protocol.app_records import RecordCodec

MAGIC = b"ZLBF"
FORMAT = 1
HEADER = MAGIC + bytes([FORMAT])
#: the longest workflow id, function name, table, key or lock name
MAX_NAME = 512
#: where a flow's locks and its queue of workflow ids live: in the books after the
#: workflows' own (the collection trims the workflows' book only)
LOCKS_BOOK_OFFSET = 1
QUEUE_BOOK_OFFSET = 2
#: the tag of every intent: the workflows ever called, in call order (the runtime's
#: sweeper reads them to find a workflow nobody finished)
INTENTS = "flow:intents"
#: how every workflow id :func:`callee_of` makes begins, and no id a caller picks may
#: (:func:`check_workflow_id`): a call's id is never a workflow a caller started
CALLEE_PREFIX = "@"

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
StepNo = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0)]


class Intent(msgspec.Struct, array_like=True, tag=1, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    workflow: Name
    function: Name
    input: bytes


class Step(msgspec.Struct, array_like=True, tag=2, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    workflow: Name
    step: StepNo
    part: Annotated[int, msgspec.Meta(ge=0, le=1)]
    #: the operation (``write``, ``read``, ...): a run that asks for another one at this
    #: step is not deterministic, and is stopped rather than given another's outcome
    op: Annotated[str, msgspec.Meta(min_length=1, max_length=16)]
    #: the step's outcome (msgpack)
    value: bytes


class Done(msgspec.Struct, array_like=True, tag=3, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    workflow: Name
    #: the workflow's return value (msgpack)
    result: bytes


class LockOp(msgspec.Struct, array_like=True, tag=4, tag_field="kind", forbid_unknown_fields=True, frozen=True):
    lock: Name
    #: the seqnum of the chain's tail its writer saw (0: the chain was empty)
    prev: U64
    #: who takes or gives the lock back: a workflow's step (``holder_of``)
    holder: Name
    #: True: take the lock; False: give it back
    acquire: bool


FlowRecord = Union[Intent, Step, Done, LockOp]
_codec: RecordCodec[FlowRecord] = RecordCodec(HEADER, FlowRecord)
decode = _codec.decode


def check_name(what: str, name: str) -> str:
    """``name`` if it can be a workflow id, function, table, key or lock name (else ValueError)."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
        raise ValueError(f"a {what} is a string of 1..{MAX_NAME} characters, not {name!r}")
    return name


class ReservedWorkflowId(ValueError):
    """A caller's workflow id begins with :data:`CALLEE_PREFIX`: such ids name the calls
    workflows make (:func:`callee_of`), and a caller's workflow under one could take a
    call's place."""


def check_workflow_id(workflow: str) -> str:
    """``workflow`` if a caller may start a workflow under it (ValueError if it is no
    name; :class:`ReservedWorkflowId` if it is in the calls' namespace)."""
    check_name("workflow id", workflow)
    if workflow.startswith(CALLEE_PREFIX):
        raise ReservedWorkflowId(f"workflow id {workflow!r} begins with {CALLEE_PREFIX!r}: ids that begin with it "
                                 f"name the calls workflows make, and no caller may start one")
    return workflow


def encode(record: FlowRecord) -> bytes:
    """The record's bytes, its names checked first (msgspec checks constraints only when
    decoding, and a record every reader skips would be lost without a word)."""
    for field in ("workflow", "function", "lock", "holder"):
        value = getattr(record, field, None)
        if value is not None:
            check_name(field, value)
    return _codec.encode(record)


def intent_tag(workflow: str) -> str:
    return "flow:i:" + workflow


def step_tag(workflow: str, step: int) -> str:
    return f"flow:s:{step}:{workflow}"


def done_tag(workflow: str) -> str:
    return "flow:d:" + workflow


def lock_tag(lock: str) -> str:
    return "flow:l:" + lock


def holder_of(workflow: str, step: int) -> str:
    """Who holds a lock taken at ``step`` of ``workflow``: every run of the workflow is
    that holder, and no other step of it is (a step that failed to take the lock must
    not give back one a later step took)."""
    return f"{step}/{workflow}"


def step_of_holder(holder: str) -> tuple[str, int] | None:
    """``(workflow, step)`` of a holder :func:`holder_of` made (None: not one)."""
    step_text, _, workflow = holder.partition("/")
    if not step_text.isdigit() or holder_of(workflow, int(step_text)) != holder:
        return None
    return workflow, int(step_text)


def callee_of(workflow: str, step: int) -> str:
    """The workflow id of the call made at ``step`` of ``workflow``: the same in every run,
    ``"@" + step + ":" + workflow``, and past MAX_NAME characters (a deep nest of calls)
    ``"@h:"`` and the BLAKE2b-128 hex of that.

    One to one, and never a caller's id: every such id begins with :data:`CALLEE_PREFIX`,
    which a caller's id may not (:func:`check_workflow_id`); after it come the step's
    digits up to the first ``":"`` (or ``"h:"``, no digit, and a hash), then the caller's
    whole id, itself a caller's id or another call's, so an id reads back to one (caller,
    step) only. (Appending the step instead, ``workflow + "." + step``, made
    ``("a.1", 2)`` and ``(("a", 1), 2)`` one id, and let a caller's workflow ``a.1``
    stand in for the call at step 1 of ``a``.)"""
    callee = f"{CALLEE_PREFIX}{step}:{workflow}"
    if len(callee) > MAX_NAME:
        callee = f"{CALLEE_PREFIX}h:" + hashlib.blake2b(callee.encode(), digest_size=16).hexdigest()
    return callee
