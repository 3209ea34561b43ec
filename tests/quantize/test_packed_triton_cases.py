"""The Triton packed-attention kernel under the interpreter: every case of ``interpreted_triton.py``
but the layouts on full and static storage (those run in ``test_packed_triton.py``): the layouts on
sliding storage, every split count, masks and several queries, odd head dims, bf16. A file of its
own so that pytest-xdist's two workers (``--dist loadfile``) run the two interpreter processes at
the same time."""

from __future__ import annotations

import pytest

from tests.quantize.test_packed_triton import HAS_TRITON, run_interpreted


@pytest.mark.slow(seconds=90)
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the `triton` extra)")
def test_other_cases_under_the_interpreter():
    run_interpreted("cases")
