"""Failure handler: recovers a shard whose replica failed (dissertation 4.2.5).

``failure_handler.recovery`` is the protocol (sans-I/O); ``failure_handler.server``
the replicated process around it (``python -m failure_handler.server``).
"""
