"""Keeps the catalog's LoRA adapters in step with the registry: a background thread reads the
verified adapters every few seconds (and at once after an admin registers one), so the request
path never waits on the database. A failed read keeps the last list (stale, not empty).
"""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from inferplane.control_plane.auth import ALL_TENANTS
from inferplane.control_plane.gateway.catalog import AdapterRecord, Catalog
from inferplane.control_plane.periodic import PeriodicThread
from inferplane.control_plane.registry import list_adapters


class AdapterSync:
    def __init__(self, sessions: sessionmaker[Session], catalog: Catalog, refresh_interval: float = 2.0):
        self.sessions = sessions
        self.catalog = catalog
        self.refresh_interval = refresh_interval
        self._loop = PeriodicThread("inferplane-adapters", lambda: self.refresh_interval, self.refresh,
                                    "refreshing LoRA adapters from the registry failed")

    def refresh(self) -> None:
        with self.sessions() as session:
            adapters = list_adapters(session, ALL_TENANTS)
        self.catalog.set_adapters([
            AdapterRecord(name=a.name, owner_tenant=a.owner_tenant_id, uri=a.uri, sha256=a.sha256 or "",
                          base_sha256=a.base_sha256 or "", created=int(a.created_at.timestamp()))
            for a in adapters])  # versions oldest first: a name's latest version wins

    def start(self) -> None:
        self._loop.run_once()
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
