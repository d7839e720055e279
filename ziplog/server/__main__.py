import sys

from ziplog.server.storage import main

sys.exit(main())
