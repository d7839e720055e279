"""BokiFlow on LogBook: workflows of functions that run exactly once although the
processes that run them crash and run them again (Boki journal 5.1, after Beldi).

    from ziplog.logbook.flow import Functions, FlowClient

    functions = Functions()

    @functions.register
    def greet(env, name):
        count = env.read("visits", name, 0) + 1
        env.write("visits", name, count)
        return f"hello {name}, visit {count}"

The protocols are in :mod:`ziplog.logbook.core.flow` (steps) and
:mod:`ziplog.logbook.core.flow_lock` (locks); the environment a function sees in
:mod:`ziplog.logbook.flow.env`; the database in :mod:`ziplog.logbook.flow.db`; the
runtime (a client, worker processes on a BokiQueue, a pool) in
:mod:`ziplog.logbook.flow.runtime`.
"""

from ziplog.logbook.core.flow import WorkflowFailed, WorkflowIdTaken
from ziplog.logbook.core.flow_records import ReservedWorkflowId
from ziplog.logbook.flow.db import Database, SqliteDatabase
from ziplog.logbook.flow.env import Env, FlowBook, Transaction, TransactionAborted, run_workflow
from ziplog.logbook.flow.runtime import FlowClient, Functions, Worker, WorkerPool

__all__ = ["Env", "FlowBook", "FlowClient", "Functions", "Worker", "WorkerPool", "Database", "SqliteDatabase",
           "ReservedWorkflowId", "Transaction", "TransactionAborted", "WorkflowFailed", "WorkflowIdTaken",
           "run_workflow"]
