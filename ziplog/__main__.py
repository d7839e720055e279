"""``python -m ziplog``: the ``ziplog`` command line (:mod:`ziplog.tools.cli`)."""

import sys

from ziplog.tools.cli import main

sys.exit(main())
