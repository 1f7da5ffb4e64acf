"""The escape monitor: sources of events about a cell, a verdict, freeze-record-kill.

This version has the Landlock source (:mod:`.kaudit`), the cell's cgroup events and telemetry
(:mod:`.monitor`); exec watch, canary credentials, seccomp reports and the egress events are next.
"""
