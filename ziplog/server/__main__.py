import logging
import os
import sys

from ziplog.server.process import main

code = main()
# Everything is written, synced and closed by now (segments, the clean-close marker,
# sockets, the ZooKeeper session). Tearing down the interpreter would still free every
# record the replica held in memory, one object at a time: tens of milliseconds that a
# successor taking over (--take-over) waits for before it may open the data directory.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
