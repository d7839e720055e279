"""BokiFlow's workflow ids (ziplog/logbook/core/flow_records.py ``callee_of``,
``check_workflow_id``; ziplog/logbook/core/flow.py ``intent``): a call a workflow makes
has an id no caller can pick, one to one with (caller, step) at every depth, and a call
of an id whose first intent is another function's is refused rather than answered with
that function's outcome.

The runtime's own objects (``FlowClient``, ``Worker``, ``FlowBook``, ``Env``,
``BokiQueue``, ``SqliteDatabase``) run here in one process, on LogBook sessions whose
engine is the production index over a log kept in memory (every append stable at once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ziplog.cores.app_session import Insert, ReadRecord
from ziplog.logbook import flow as flow_api
from ziplog.logbook.client import AUX_ENTRIES, EngineState, LogBook
from ziplog.logbook.core import flow as fc
from ziplog.logbook.core import flow_records as fr
from ziplog.logbook.core import session as ls
from ziplog.logbook.flow import Env, FlowBook, FlowClient, Functions, SqliteDatabase, Worker

BOOK = 40


class MemoryEngine(EngineState):
    """A LogBook engine over a log in memory: each insert takes the next gsn and is fed to
    the production index at once, which then answers every lookup at the log's tail."""

    def __init__(self) -> None:
        super().__init__(1.0, AUX_ENTRIES)
        self.start_at(0, "local", 0)
        self.log: dict[int, bytes] = {}

    def perform(self, op: Any) -> Any:
        if type(op) is Insert:
            gsn = max(self.log, default=0) + 1
            self.log[gsn] = op.data
            self.feed(gsn, 0, op.data)
            self.on_watermark(gsn)
            return gsn, 0
        if type(op) is ReadRecord:
            return self.log[op.rid[0]]
        assert type(op) is ls.Lookup, op
        return self.answer(op)

    def refresh(self) -> None:
        pass


# -- a shop: an order charges a wallet through a call ----------------------------------------------------
shop = Functions()


@shop.register
def note(env: Env, text: str) -> str:
    """A user's own workflow, named like a call an order makes."""
    return f"noted {text}"


@shop.register
def charge(env: Env, req: dict[str, Any]) -> str:
    balance = env.read("wallets", req["wallet"], 100)
    env.write("wallets", req["wallet"], balance - req["amount"])
    env.write("charges", req["order"], req["amount"])
    return f"charged {req['amount']} for {req['order']}"


@shop.register
def order(env: Env, req: dict[str, Any]) -> str:
    number = env.remember(lambda: 7)
    receipt = env.invoke("charge", {"wallet": req["wallet"], "order": env.workflow, "amount": req["amount"]})
    env.write("orders", env.workflow, [number, receipt])
    return f"order {env.workflow}: {receipt}"


@pytest.fixture
def shop_world(tmp_path: Path) -> Iterator[tuple[FlowClient, Worker, SqliteDatabase]]:
    lb = LogBook("", BOOK, _engine=MemoryEngine())  # type: ignore[arg-type]
    db = SqliteDatabase(str(tmp_path / "shop.sqlite"), audit=True)
    try:
        yield FlowClient(lb), Worker(FlowBook(lb.child(), db), shop), db
    finally:
        db.close()


def _run_all(worker: Worker) -> None:
    while worker.run_one():
        pass


def test_users_workflows_named_like_an_orders_calls_do_not_take_their_place(
        shop_world: tuple[FlowClient, Worker, SqliteDatabase]) -> None:
    """Workflows ``nsorder.1`` .. ``nsorder.12`` started before the order ``nsorder``:
    the order's charge runs, once, and the order ends with its own answer."""
    client, worker, db = shop_world
    for i in range(1, 13):
        client.start("note", f"mine {i}", f"nsorder.{i}")
    client.start("order", {"wallet": "alice", "amount": 30}, "nsorder")
    _run_all(worker)
    assert client.result("nsorder", timeout=5) == "order nsorder: charged 30 for nsorder"
    assert {k: fc.unpack(v) for k, v in db.rows("charges").items()} == {"nsorder": 30}
    assert fc.unpack(db.rows("wallets")["alice"]) == 70
    applied = [(table, key) for table, key, _ in db.applied()]
    assert applied.count(("charges", "nsorder")) == 1 and applied.count(("wallets", "alice")) == 1
    # the users' workflows are theirs, each ended with its own input's answer
    assert [client.result(f"nsorder.{i}", timeout=5) for i in range(1, 13)] == [f"noted mine {i}" for i in range(1, 13)]
    # and the order's call is under an id no caller could have started
    callee = fc.unpack(client._drive(fc.first_step("nsorder", 2, "invoke"))[1].value)
    with pytest.raises(fr.ReservedWorkflowId):
        client.start("note", "squat", callee)
    assert client.result(callee, timeout=5) == "charged 30 for nsorder"


def test_a_callers_id_in_the_calls_namespace_is_refused_before_anything_is_recorded(
        shop_world: tuple[FlowClient, Worker, SqliteDatabase]) -> None:
    client, worker, _ = shop_world
    for taken in (fr.callee_of("nsorder", 2), fr.callee_of(fr.callee_of("x", 1), 3), "@", "@anything"):
        with pytest.raises(fr.ReservedWorkflowId, match="begins with '@'"):
            client.start("note", "squat", taken)
        assert client._drive(fc.read_intent(taken)) is None
    assert not worker.run_one()  # nothing was pushed either
    # an "@" anywhere else, and the old callee form, are ids like any other
    for fine in ("a@b", "nsorder.2", "h:0123", " @x"):
        client.start("note", fine, fine)
    _run_all(worker)
    assert [client.result(w, timeout=5) for w in ("a@b", "nsorder.2", "h:0123", " @x")] == [
        "noted a@b", "noted nsorder.2", "noted h:0123", "noted  @x"]


def test_a_call_of_an_id_called_as_another_function_is_refused(
        shop_world: tuple[FlowClient, Worker, SqliteDatabase]) -> None:
    """At the top: a second call of an id as another function raises, records nothing and
    pushes nothing; one as the same function, even with another input, is the first call."""
    client, worker, _ = shop_world
    assert flow_api.WorkflowIdTaken is fc.WorkflowIdTaken and flow_api.ReservedWorkflowId is fr.ReservedWorkflowId
    client.start("note", "first", "w1")
    with pytest.raises(fc.WorkflowIdTaken, match="'note'"):
        client.start("charge", {"wallet": "bob", "order": "w1", "amount": 5}, "w1")
    assert client.start("note", "second", "w1") == "w1"  # a duplicate: the first call's input
    _run_all(worker)
    assert client.result("w1", timeout=5) == "noted first"
    intent = client._drive(fc.read_intent("w1"))
    assert intent[1].function == "note"


def test_a_nested_call_whose_id_was_called_as_another_function_fails_its_caller(
        shop_world: tuple[FlowClient, Worker, SqliteDatabase]) -> None:
    """A call's id taken by an intent of another function (a run of the caller that asked
    another function at that step, or records from before the calls had their own ids):
    the call raises WorkflowIdTaken in the caller, which ends with it as its exception,
    and neither function's run is taken for the other's."""
    client, worker, db = shop_world
    callee = fr.callee_of("o2", 2)
    worker.flow.drive(fc.intent(callee, "note", fc.pack("planted")))
    client.start("order", {"wallet": "carol", "amount": 10}, "o2")
    _run_all(worker)
    with pytest.raises(fc.WorkflowFailed, match=r"WorkflowIdTaken: .*called as function 'note'.*as 'charge'"):
        client.result("o2", timeout=5)
    assert db.rows("charges") == {} and db.rows("wallets") == {} and db.rows("orders") == {}
    assert worker.flow.drive(fc.read_done(callee)) is None  # the planted workflow was not run for the order


def test_a_call_recorded_under_an_earlier_ids_form_keeps_it(
        shop_world: tuple[FlowClient, Worker, SqliteDatabase]) -> None:
    """A caller whose invoke step was recorded before the calls had their own ids takes
    the recorded id, as every step's first record, and its run again ends the same call."""
    client, worker, db = shop_world
    client.start("order", {"wallet": "dave", "amount": 4}, "o3")
    flow = worker.flow
    flow.drive(fc.logged("o3", 1, "remember", fc.pack(7)))
    flow.drive(fc.logged("o3", 2, "invoke", fc.pack("o3.2")))  # the earlier form
    _run_all(worker)
    assert client.result("o3", timeout=5) == "order o3: charged 4 for o3"
    assert flow.drive(fc.read_intent("o3.2"))[1].function == "charge"
    assert flow.drive(fc.read_intent(fr.callee_of("o3", 2))) is None


# -- the ids themselves -------------------------------------------------------------------------------------
user_ids = st.text(min_size=1, max_size=12).filter(lambda w: not w.startswith(fr.CALLEE_PREFIX))
paths = st.lists(st.integers(1, 10**6), min_size=1, max_size=4)


def _nest(workflow: str, path: list[int]) -> str:
    for step in path:
        workflow = fr.callee_of(workflow, step)
    return workflow


@settings(max_examples=500, deadline=None)
@given(a=user_ids, path_a=paths, b=user_ids, path_b=paths)
def test_call_ids_are_one_to_one_at_every_depth_and_never_a_callers(a: str, path_a: list[int], b: str,
                                                                     path_b: list[int]) -> None:
    ca, cb = _nest(a, path_a), _nest(b, path_b)
    assert (ca == cb) == ((a, path_a) == (b, path_b)), (a, path_a, b, path_b)
    for made in (ca, cb):
        assert fr.check_name("workflow id", made) == made
        with pytest.raises(fr.ReservedWorkflowId):
            fr.check_workflow_id(made)
    assert fr.check_workflow_id(a) == a


def test_the_old_form_collisions_are_gone() -> None:
    # a caller's workflow named like a call, and two nestings that read the same
    assert fr.callee_of("nsorder", 1) != "nsorder.1"
    assert fr.callee_of("a.1", 2) != fr.callee_of(fr.callee_of("a", 1), 2)
    assert fr.callee_of("nsorder", 2) == "@2:nsorder"
    assert fr.callee_of(fr.callee_of("nsorder", 2), 3) == "@3:@2:nsorder"


def test_long_call_ids_are_hashed_inside_the_calls_namespace() -> None:
    long = "x" * fr.MAX_NAME
    hashed = fr.callee_of(long, 1)
    assert hashed.startswith("@h:") and len(hashed) == 3 + 32
    assert hashed != fr.callee_of(long, 2) and hashed != fr.callee_of(long[:-1] + "y", 1)
    assert fr.callee_of(hashed, 4) == "@4:" + hashed  # its own calls nest as any other
    deep = _nest("w", [10**6] * 80)  # grows past MAX_NAME, hashed, and grows again: still a call's
    assert "@h:" in deep and len(deep) <= fr.MAX_NAME and deep.startswith("@1000000:")
    with pytest.raises(fr.ReservedWorkflowId):
        fr.check_workflow_id(hashed)
    assert fr.check_workflow_id("h:" + hashed[3:]) == "h:" + hashed[3:]  # the old hashed form is a caller's id now
