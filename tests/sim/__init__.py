"""Deterministic simulations of ziplog's protocol cores. ``python -m tests.sim --seeds N``."""
