"""Hosts of cells: where a cell and its supervision live (today: the live cell host, server.py)."""
