"""tests/bench: the benchmark tools' pure parts, and the load generator against a real server."""

from __future__ import annotations

import os
import sys

# The server test harness lives in tests/server; import it rather than copy it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "server"))
