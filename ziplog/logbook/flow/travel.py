"""The travel reservations of BokiFlow's demo (``python -m ziplog.tools.flow_demo``):
a trip searches for a hotel and a flight, then reserves both in one transaction, or
neither. ``functions`` is what the demo's worker processes run."""

from __future__ import annotations

import random
import time
from typing import Any

from ziplog.logbook.flow import Env, Functions

HOTELS = {f"hotel-{i}": 6 for i in range(4)}
FLIGHTS = {f"flight-{i}": 6 for i in range(4)}

functions = Functions()


@functions.register
def search(env: Env, req: dict[str, Any]) -> dict[str, str]:
    """The first hotel and flight, from the trip's preference on, with room left (as read now)."""
    start = req["prefer"]
    names_h, names_f = sorted(HOTELS), sorted(FLIGHTS)
    hotel = next((h for h in names_h[start:] + names_h[:start] if env.read("hotels", h, 0) > 0), names_h[start])
    flight = next((f for f in names_f[start:] + names_f[:start] if env.read("flights", f, 0) > 0), names_f[start])
    return {"hotel": hotel, "flight": flight}


@functions.register
def reserve(env: Env, req: dict[str, str]) -> bool:
    """A room and a seat for trip ``req["trip"]``, both or neither (a transaction)."""
    for _ in range(20):  # another trip's transaction held a lock: try again
        with env.transaction() as t:
            rooms, seats = t.read("hotels", req["hotel"], 0), t.read("flights", req["flight"], 0)
            if rooms <= 0 or seats <= 0:
                return False
            t.write("hotels", req["hotel"], rooms - 1)
            t.write("flights", req["flight"], seats - 1)
            t.write("bookings", req["trip"], [req["hotel"], req["flight"]])
        if t.committed:
            return True
        time.sleep(env.remember(lambda: random.uniform(0.001, 0.02)))
    return False


@functions.register
def book_trip(env: Env, req: dict[str, Any]) -> dict[str, Any]:
    choice = env.invoke("search", req)
    booked = env.invoke("reserve", {**choice, "trip": env.workflow})
    return {**choice, "booked": booked}


@functions.register
def setup(env: Env, _: Any) -> None:
    for name, n in HOTELS.items():
        env.write("hotels", name, n)
    for name, n in FLIGHTS.items():
        env.write("flights", name, n)
