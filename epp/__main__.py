import sys

from epp.server.cli import main

sys.exit(main())
