"""Reliability tests: random operation programs, bad tensors, non-finite values, injected faults, threads.

Hypothesis profiles (select with the environment variable ``HYPOTHESIS_PROFILE``):

- ``default``: a handful of programs per chain, derandomized (the same programs every run), so
  ``make test`` stays fast: the whole directory runs well under a minute on two CPU cores.
- ``nightly``: 200 random programs of up to 40 operations per chain, new ones every run
  (``HYPOTHESIS_PROFILE=nightly pytest tests/reliability``): about half an hour on two cores,
  for a scheduled run. A failure prints the shrunk program and the ``@reproduce_failure``
  line that replays it.

Deadlines are off in both: the first example of a chain pays for imports and allocations.
"""

import os
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # kvmodel: the chain grid and the reference

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("default", max_examples=6, derandomize=True, print_blob=True, **_common)
settings.register_profile("nightly", max_examples=200, print_blob=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

