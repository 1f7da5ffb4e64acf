"""Egress: what a cell may reach on the network.

``none`` and ``loopback`` are namespaces only (:mod:`agentcell.cell.namespaces`). ``proxy``: the
cell's only way out is a listening socket made inside its network namespace and served from the
host's by :mod:`.proxy`, under domain rules (:mod:`.rules`, named lists in :mod:`.presets`);
:mod:`.egress` starts and stops it for a cell and collects what it refused. The credentials the proxy
injects (:mod:`.credentials`) are the session's, kept here with it and out of the policy layer.
"""
