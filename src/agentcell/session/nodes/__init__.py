"""The session's nodes, one module per step: each node calls one layer and writes one audit record;
edges and retries are the graph's (:mod:`..graph`).

A node is a function of the supervisor's :class:`~..state.Runtime` and the state; it returns the part
of the state it changes. A node that fails raises: its ``RetryPolicy`` (in :mod:`..graph`) retries it,
and when the retries are spent its error handler (:func:`.kit.on_error`) routes the session — to
``abort`` before anything runs, to ``terminate`` once something does. The teardown nodes
(``terminate``, ``cleanup``, ``abort``, ``audit``) never raise: they work from the checkpointed state
alone when the supervisor's handles are gone (``session recover``), and report what they could not undo.

Fault injection (tests): :attr:`Runtime.faults` names a point and how many times it fails —
``preflight``, ``account``, ``firewall``, ``spawn``, ``telemetry``, ``audit@NODE`` (that node's audit
record is written to a path that cannot be written, so the trail's own retries run and fail for real),
and ``kill@NODE`` (the supervisor is killed with SIGKILL after that node's work, before its checkpoint).
"""
