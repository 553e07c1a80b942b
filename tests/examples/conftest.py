from __future__ import annotations

import sys

from tests.helpers import ROOT

# The example scripts import their sibling modules by name, as they do when run as scripts.
sys.path.insert(0, str(ROOT / "examples"))
