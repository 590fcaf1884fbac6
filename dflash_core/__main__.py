"""``python -m dflash_core``: see ``dflash_core.cli``."""

import sys

from .cli import main

sys.exit(main())
