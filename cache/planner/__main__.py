"""``python -m cache.planner``: the ``blocktrie`` command."""

import sys

from cache.planner.cli import main

sys.exit(main())
