"""``tiercache tune`` and ``tiercache check``: a policy for this model and this budget, found by
measurement, and the guardrail that measures a policy before a deployment.

Modules: ``text`` (the calibration and verification token windows: the user's files or the
built-in held-out text), ``metrics`` (KLD of the next-token distribution against full precision,
perplexity change, top-1 agreement, pass-key retrieval), ``calibrate`` (one full-precision pass and
per-layer key / value sensitivity: ``tiercache.planner.mixed.Sensitivity``), ``verify`` (a policy
measured end to end through a ``TieredCache``), ``search`` (per-layer formats within the planner's
byte budget, then verified, stepping back toward more bits), ``report`` (the policy YAML with its
header, the frontier table and plot), ``inputs`` (the model and text both commands start from),
``session`` (one ``tune`` run, start to end), ``command`` (the two CLI commands' flags and ``check``).
"""
