"""BokiFlow demo: travel reservations that run exactly once while their workers are killed.

``python -m ziplog.logbook.flow_demo`` starts a local cluster and three worker processes,
then clients book trips concurrently: a trip searches for a hotel and a flight, then
reserves both in one transaction, or neither. Meanwhile workers are SIGKILLed and started
again, and some trips are requested twice under the same workflow id. At the end it
checks, from the database and the log, that every trip ended, that a duplicate request
got the first one's answer, that no room or seat was sold twice or lost, and that every
booking holds a hotel and a flight; it prints each check and exits 1 if one fails.
"""

import sys

from ziplog.tools.flow_demo import main

if __name__ == "__main__":
    sys.exit(main())
