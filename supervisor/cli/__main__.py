"""``python -m trainwarden.supervisor.cli``: the console script without its entry point."""

import sys

from trainwarden.supervisor.cli.main import main

sys.exit(main())
