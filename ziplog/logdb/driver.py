"""LogDB's client driver: runs a transaction's steps (:mod:`ziplog.logdb.core.transaction`)
over the ports. The blocking :class:`~ziplog.logdb.LogDB` runs it on its log client's
runtime while a call waits, :class:`~ziplog.logdb.AsyncLogDB` on the asyncio runtime,
and the simulation on a simulated process: the same code in all three.

* ``Insert`` and ``ReadRecord`` go to the log through a :class:`LogPort` (the log
  client's own driver on the same runtime: :class:`ClientLog`).
* ``Ask`` and ``AskKv`` go over one DEALER per address to the coordinators (the leader
  first) or the key's KV shard, as the :class:`DirectoryView` names them. A request
  unanswered within ``request_timeout_ns`` (or answered BUSY) goes to the next
  coordinator replica (every request is idempotent); the step fails with
  ``ZiplogTimeoutError`` after ``timeout_ns``. Answers are routed by request id. An
  Outcome answered FORGOTTEN goes to each other replica once (each forgets at its own
  moment) before the answer stands.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from ziplog.cores.app_session import CallbackRun
from ziplog.io.ports import Connector, Endpoint, Runtime, Timer
from ziplog.logdb.core import frames as f
from ziplog.logdb.core.transaction import Ask, AskKv, Insert, Op, ReadRecord, Rid, Steps
from ziplog.protocol.errors import ZiplogTimeoutError
from ziplog.protocol.types import RecordId

#: a request unanswered this long goes to the next replica
REQUEST_TIMEOUT_NS = 1_000_000_000
#: nothing to ask yet (no coordinator or KV shard registered): look again this often
RETRY_NS = 50_000_000
#: connections to addresses no longer in the directory are closed beyond this many
MAX_IDLE_CONNECTIONS = 8

#: what a log operation reports: (value, None) or (None, the error)
OnResult = Callable[[Any, BaseException | None], None]


class LogPort(Protocol):
    """The log a LogDB client inserts into and reads from, answering later."""

    def insert(self, data: bytes, after: Rid, on_result: OnResult) -> None:
        """Insert ``data`` after ``after``; ``on_result(RecordId, None)``."""

    def read(self, rid: Rid, on_result: OnResult) -> None:
        """Read the record ``rid``; ``on_result(bytes, None)``."""


class DirectoryView(Protocol):
    """Where a LogDB's processes are now (``ziplog.io.zk_logdb.Directory`` in production)."""

    def coordinators(self) -> list[str]:
        """Coordinator addresses, the leader first."""

    #: how many KV shards the LogDB has
    kv_shards: int

    def kv_addr(self, shard: int) -> str | None: ...


class ClientLog:
    """A :class:`LogPort` on a ziplog client's driver (the runtime both run on)."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def insert(self, data: bytes, after: Rid, on_result: OnResult) -> None:
        _Report(on_result).started(lambda done: self.driver.insert(data, max(after[0], 0), None, done))

    def read(self, rid: Rid, on_result: OnResult) -> None:
        _Report(on_result).started(lambda done: self.driver.read(RecordId(*rid), done))


class _Report:
    """Reports a client call's outcome once it is done, also when it was done before
    the driver returned it (a closed client fails a call as it starts)."""

    __slots__ = ("on_result", "call", "early")

    def __init__(self, on_result: OnResult) -> None:
        self.on_result = on_result
        self.call: Any = None
        self.early = False

    def started(self, start: Callable[[Callable[[], None]], Any]) -> None:
        self.call = start(self.done)
        if self.early:
            self.done()

    def done(self) -> None:
        call = self.call
        if call is None:
            self.early = True
            return
        if call.error is not None:
            self.on_result(None, call.error)
        else:
            self.on_result(call.value, None)


class Run(CallbackRun):
    """One drive of a transaction's steps, and the coordinator or KV shard request it
    waits on (if any)."""

    __slots__ = ("ask", "timer")

    def __init__(self, steps: Steps, perform: Callable[[Any, Any], None],
                 on_done: Callable[[], None] | None) -> None:
        super().__init__(steps, perform, None if on_done is None else lambda _run: on_done())
        self.ask: _Asking | None = None
        self.timer: Timer | None = None


class _Asking:
    """An Ask or AskKv in flight: its frame, deadline and how many replicas were tried."""

    __slots__ = ("op", "frame", "req", "deadline", "tried", "forgotten")

    def __init__(self, op: Ask | AskKv, deadline: int) -> None:
        self.op = op
        self.frame = f.encode(op.request)
        self.req = op.request.req
        self.deadline = deadline
        self.tried = 0
        #: replicas that answered FORGOTTEN
        self.forgotten = 0


class TransactionDriver:
    def __init__(self, rt: Runtime, net: Connector, directory: DirectoryView, log: LogPort, timeout_ns: int,
                 request_timeout_ns: int = REQUEST_TIMEOUT_NS) -> None:
        self.rt = rt
        self.net = net
        self.directory = directory
        self.log = log
        self.timeout_ns = timeout_ns
        self.request_timeout_ns = request_timeout_ns
        self.conns: dict[str, Endpoint] = {}
        #: request id -> the run waiting for its answer (one per run in flight)
        self.pending: dict[int, Run] = {}

    def run(self, steps: Steps, on_done: Callable[[], None] | None = None) -> Run:
        """Start driving ``steps``; ``on_done`` is called (on the runtime) when it ends."""
        run = Run(steps, self._perform, on_done)
        run.start()
        return run

    def close(self) -> None:
        for run in list(self.pending.values()):
            run.resume(None, ZiplogTimeoutError("the LogDB client closed"))
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()

    # -- the steps --------------------------------------------------------------------------------
    def _perform(self, run: Run, op: Op) -> None:
        if type(op) is Insert:
            self.log.insert(op.data, op.after, run.resume)
        elif type(op) is ReadRecord:
            self.log.read(op.rid, run.resume)
        else:
            assert type(op) is Ask or type(op) is AskKv
            run.ask = _Asking(op, self.rt.now() + self.timeout_ns)
            self.pending[run.ask.req] = run
            self._send(run)

    # -- asking coordinators and KV shards --------------------------------------------------------
    def _send(self, run: Run) -> None:
        """Send the run's request to the next replica (or wait for one to register)."""
        ask = run.ask
        assert ask is not None
        if run.timer is not None:
            run.timer.cancel()
            run.timer = None
        now = self.rt.now()
        if now >= ask.deadline:
            self._answered(run, None, ZiplogTimeoutError(
                f"no answer to {type(ask.op.request).__name__} within {self.timeout_ns / 1e9:g}s"))
            return
        targets = self._targets(ask.op)
        wait = RETRY_NS
        if targets:
            addr = targets[ask.tried % len(targets)]
            ask.tried += 1
            if self._conn(addr).send(ask.frame):
                wait = self.request_timeout_ns
        run.timer = self.rt.call_at(min(ask.deadline, now + wait), lambda: self._send(run))

    def _answered(self, run: Run, answer: f.Answer | None, error: BaseException | None) -> None:
        ask = run.ask
        assert ask is not None
        self.pending.pop(ask.req, None)
        run.ask = None
        if run.timer is not None:
            run.timer.cancel()
            run.timer = None
        run.resume(answer, error)

    def _on_answer(self, frame: bytes) -> None:
        try:
            ans = f.decode_answer(frame)
        except f.BadFrame:
            return  # a broken answer: the request goes to the next replica when it times out
        run = self.pending.get(ans.req)
        if run is None:
            return  # the answer to an earlier try, or to a run that ended
        if type(ans) is f.Failed and ans.code == f.BUSY:
            self._send(run)  # ask the next replica now
            return
        ask = run.ask
        if (type(ans) is f.Failed and ans.code == f.FORGOTTEN and ask is not None
                and ask.forgotten + 1 < len(self._targets(ask.op))):
            ask.forgotten += 1
            self._send(run)  # another replica may remember it
            return
        self._answered(run, ans, None)

    def _targets(self, op: Ask | AskKv) -> list[str]:
        if type(op) is AskKv:
            addr = self.directory.kv_addr(op.shard)
            return [addr] if addr else []
        return self.directory.coordinators()

    def _conn(self, addr: str) -> Endpoint:
        conn = self.conns.get(addr)
        if conn is None:
            if len(self.conns) >= MAX_IDLE_CONNECTIONS:
                d = self.directory
                live = set(d.coordinators()) | {d.kv_addr(i) for i in range(d.kv_shards)}
                for old in [a for a in self.conns if a not in live]:
                    self.conns.pop(old).close()
            conn = self.conns[addr] = self.net.dealer(addr, self._on_answer, "logdb", f.ANSWER_LIMIT)
        return conn
