"""The escape monitor: sources of events about a cell (each a :class:`.source.Source`), a verdict,
freeze-record-kill (:mod:`.monitor`).
"""
