"""Cluster topology: link levels, axis placement, the collective cost model and ``plan``.

A concept of the mesh layer: ``Mesh.from_topology`` delegates here. Nothing here imports a stage.
"""
