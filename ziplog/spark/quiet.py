"""A streaming query stopped in the middle of a ``foreachBatch`` function, without a
stack trace.

``query.stop()`` (or Ctrl-C, whose ``finally`` stops the query) interrupts the stream
thread and cancels the batch's jobs; the function, running in the driver's Python
process behind a Py4J callback, then fails (``collect()`` raises Py4JJavaError) and
Py4J hands the JVM the whole Python traceback as the message of a Py4JException,
thousands of characters with the Java stack trace inside. Spark decides whether such
an error means "stopped" (SPARK-39218) by matching that message with
``py4j.protocol.Py4JJavaError: An error occurred while calling((.|\\r\\n|\\r|\\n)*)
(java.lang.InterruptedException|...)``: the alternation inside a greedy loop recurses
once per character in java.util.regex, and on that message it overflows the stream
thread's stack. The StackOverflowError escapes the thread and the JVM prints it with
over a thousand regex frames, although the query stopped as asked.

:func:`foreach_batch` wraps the function: when it fails because its query is being
stopped, it raises a short error instead, one line that Spark's pattern recognizes, so
the query ends as stopped, quietly. Any other error passes through unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

#: how Spark's pattern starts (a constant, so that the line raising the short error does
#: not itself show the prefix in the traceback Spark matches)
PY4J_PREFIX = "py4j.protocol.Py4JJavaError: An error occurred while calling"
#: what Spark counts as an interruption (StreamExecution.IO_EXCEPTION_NAMES)
INTERRUPTIONS = ("java.lang.InterruptedException", "java.io.InterruptedIOException",
                 "java.nio.channels.ClosedByInterruptException")


class QueryStopped(Exception):
    """The foreachBatch function was cut short because its query was stopped."""


def interruption_of(exc: BaseException) -> str | None:
    """The name of the Java interruption behind a Py4JJavaError, if it is one: its
    cause chain holds an interruption, or a job cancelled with the query's job group."""
    from py4j.protocol import Py4JJavaError
    if not isinstance(exc, Py4JJavaError):
        return None
    try:
        j = exc.java_exception
        while j is not None:
            name = j.getClass().getName()
            if name in INTERRUPTIONS:
                return str(name)
            if name == "org.apache.spark.SparkException" and "cancelled" in str(j.getMessage() or ""):
                return INTERRUPTIONS[0]  # the stop cancelled the job: the stream thread was interrupted
            j = j.getCause()
    except Exception:  # the JVM is going away: nothing more to learn
        return None
    return None


def foreach_batch(func: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
    """``func`` for ``writeStream.foreachBatch``, ending quietly when its query is stopped
    while it runs (see the module's documentation)."""

    @functools.wraps(func)
    def run(batch: Any, batch_id: int) -> None:
        try:
            func(batch, batch_id)
        except Exception as exc:
            name = interruption_of(exc)
            if name is None:
                raise
            # One short line, no chained context: Spark's pattern needs the Py4JJavaError
            # prefix and the interruption's class name, and recurses once per character
            # between them and the end of the message.
            raise QueryStopped(f"{PY4J_PREFIX} foreachBatch (batch {batch_id}): {name}") from None
    return run
