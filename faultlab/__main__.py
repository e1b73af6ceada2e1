"""``python -m faultlab``."""

import sys

from faultlab.cli import main

sys.exit(main())
