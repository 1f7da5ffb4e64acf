"""Hosts of cells: where a cell and its supervision live. One interface to start a cell (:mod:`.base`:
in this process, remote, or fake), the client of a remote one (:mod:`.remote`), the cell host
(:mod:`.server`: a live cell, or one supervised command), the warm launcher (:mod:`.zygote`) and its
client (:mod:`.warm`), the wire they speak (:mod:`.wire`), and a host with no kernel for tests
(:mod:`.fake`)."""
