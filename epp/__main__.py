import sys

from epp.cli import main

sys.exit(main())
