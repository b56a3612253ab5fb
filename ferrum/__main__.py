import sys

from ferrum.entrypoints.cli import main

if __name__ == "__main__":  # not when a spawned worker (ferrum tune's compile pool) imports it
    sys.exit(main())
