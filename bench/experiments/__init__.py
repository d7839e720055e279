"""The experiments of ``python -m bench``: each module has ``run(quick, out) -> rows``."""
