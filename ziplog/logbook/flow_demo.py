"""``python -m ziplog.logbook.flow_demo``: BokiFlow's travel reservations under worker
kills and duplicate requests, checked (see :mod:`ziplog.tools.flow_demo`)."""

import sys

from ziplog.tools.flow_demo import main

if __name__ == "__main__":
    sys.exit(main())
