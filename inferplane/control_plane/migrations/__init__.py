"""Alembic migrations for the control plane database; run through `inferplane.control_plane.db`.

A package (not a loose folder) so setuptools ships it with `inferplane`.
"""
