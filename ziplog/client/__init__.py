"""The clients: :class:`Client` (blocking) and ``ziplog.aio.AsyncClient`` (asyncio)."""

from ziplog.client.blocking import Client, Record, Subscription

__all__ = ["Client", "Record", "Subscription"]
