"""Research tooling behind ``bench/bench_real.py``, ``bench_retrieval.py`` and friends: not part of
the installed package (nothing under ``tiercache/`` imports it).

``texts`` (code and prose ids), ``seeded`` (prefill once, seed every cache), ``forced``
(teacher-forced decoding), ``multitext`` (many windows), ``retrieval`` / ``retrievalbench`` (the
pass key), ``needle`` (attention on the needle), ``sensitivity`` (per-layer cost, mixed
precision), ``realbench`` (the run), ``real_report`` / ``summary`` (tables and plots).
Scripts in ``bench/`` import it as ``research``; the tests put ``bench/`` on ``sys.path``.
"""
