import sys

from ferrum.entrypoints.cli import main

sys.exit(main())
