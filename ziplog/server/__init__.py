"""Server processes: thin drivers over the cores (``python -m ziplog.server`` is one
storage replica)."""
