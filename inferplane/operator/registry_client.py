"""The operator asks the control plane's registry what a `model: {name, version}` (and each of
`adapters`) resolves to.

Over the admin API (`GET /admin/v1/models/resolve`, `/admin/v1/adapters/resolve`) with a platform
admin credential, so the registry's database stays the control plane's alone and the answer is the
same function `inferplane up` calls in-process (`registry.resolve_for_deployment`, `resolve_adapter`).
"""

from __future__ import annotations

from pathlib import Path

import httpx

from inferplane.api.model_resolution import ModelResolutionError, ResolvedAdapter, ResolvedModel, model_ref_text


class RegistryClient:
    def __init__(self, base_url: str, *, token: str | None = None, token_file: Path | None = None,
                 timeout: float = 10.0, transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self._token, self._token_file = token, token_file
        self._client = httpx.AsyncClient(timeout=timeout, transport=transport)

    def _headers(self) -> dict[str, str]:
        # Read each time: a rotated Secret shows up in the mounted file without a restart.
        token = self._token if self._token is not None else (
            self._token_file.read_text().strip() if self._token_file else None)
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def resolve(self, name: str, version: str | None) -> ResolvedModel:
        response = await self._get("models", name, version)
        if response.status_code == 200:
            return ResolvedModel.from_dict(response.json())
        message = _error_message(response) or f"HTTP {response.status_code}"
        if response.status_code == 404:
            raise ModelResolutionError("ModelNotFound", message)
        if response.status_code == 409:
            raise ModelResolutionError("ModelNotVerified", message)
        raise ModelResolutionError("RegistryUnavailable", f"registry answered {response.status_code} resolving "
                                   f"{model_ref_text(name, version)}: {message}")

    async def resolve_adapter(self, name: str, version: str | None) -> ResolvedAdapter:
        """A deployment's `adapters` entry (GET /admin/v1/adapters/resolve)."""
        response = await self._get("adapters", name, version)
        if response.status_code == 200:
            return ResolvedAdapter.from_dict(response.json())
        message = _error_message(response) or f"HTTP {response.status_code}"
        if response.status_code == 404:
            raise ModelResolutionError("AdapterNotFound", message)
        raise ModelResolutionError("RegistryUnavailable", f"registry answered {response.status_code} resolving "
                                   f"adapter {model_ref_text(name, version)}: {message}")

    async def _get(self, collection: str, name: str, version: str | None) -> httpx.Response:
        params = {"name": name} | ({"version": version} if version else {})
        ref = model_ref_text(name, version)
        try:
            return await self._client.get(f"{self.base_url}/admin/v1/{collection}/resolve", params=params,
                                          headers=self._headers())
        except OSError as exc:  # the credential file is missing or unreadable
            raise ModelResolutionError("RegistryUnavailable", f"registry credential unreadable resolving {ref}: "
                                       f"{exc}") from exc
        except httpx.HTTPError as exc:
            raise ModelResolutionError("RegistryUnavailable", f"registry at {self.base_url} unreachable "
                                       f"resolving {ref}: {exc}") from exc

    async def close(self) -> None:
        await self._client.aclose()


def _error_message(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
