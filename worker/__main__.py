"""`python -m worker`."""
from __future__ import annotations

import os
import sys

# A worker shares its cores with its peer worker and with its own KV transfer threads. torch's
# OpenMP threads spin while they wait (libgomp's default), so when a teammate is descheduled the
# others burn the core it needs: under DI load both workers' compute then runs several times
# slower. Read by libgomp when torch loads, so it is set before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from worker.server.cli import main  # noqa: E402 - after the environment above

sys.exit(main())
