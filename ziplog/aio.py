"""``ziplog.aio``: the asyncio client (:mod:`ziplog.client.aio`) under its public name.

    ziplog.aio.run(main(hosts))      # on uvloop when it is installed
"""

from ziplog.client.aio import AsyncClient, AsyncSubscription, Record, run

__all__ = ["AsyncClient", "AsyncSubscription", "Record", "run"]
