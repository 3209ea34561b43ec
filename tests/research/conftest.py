"""The research tooling lives in ``bench/research`` (not installed): put ``bench/`` on the path."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
