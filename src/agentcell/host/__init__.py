"""Hosts of cells: where a cell and its supervision live. The cell host (:mod:`.server`: a live cell, or
one supervised command), the warm launcher (:mod:`.zygote`) and its client (:mod:`.warm`), and the wire
they speak (:mod:`.wire`)."""
