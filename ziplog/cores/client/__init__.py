"""The client core (sans-I/O), one for every client: the calls (insert, read, trim,
status), the waits that say when a request is settled, the subscription lifecycle, and
what a client keeps across calls."""
