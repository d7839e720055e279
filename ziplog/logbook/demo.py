"""``python -m ziplog.logbook.demo``: BokiStore counters on LogBook with the index tier,
under faults (see :mod:`ziplog.tools.logbook_demo`)."""

import sys

from ziplog.tools.logbook_demo import main

if __name__ == "__main__":
    sys.exit(main())
