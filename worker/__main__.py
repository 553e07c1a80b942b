"""`python -m worker`."""
from __future__ import annotations

import sys

from worker.server.cli import main

sys.exit(main())
