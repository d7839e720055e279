from __future__ import annotations

import os
import sys

# Tests import `tests.sim` and the packages from the checkout.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
