"""Client credentials, gateway client keys and tenants.

Two modes, decided by the configuration:
- forward (no `upstreams.<name>.api_key`, no `auth.keys`): the client's own provider credential
  goes upstream as it came; the tenant is derived from it.
- gateway keys (`auth.keys` configured, required when any upstream key is configured): the client
  presents a gateway key (as its API key, Bearer or x-api-key, or in `X-Gateway-Key`); the gateway
  key is never forwarded. The upstream gets the configured key in its own header form, or else
  the client's provider credential when that came separately from the gateway key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote_plus

from gateway.config import Settings

GATEWAY_KEY_HEADER = "X-Gateway-Key"
ANONYMOUS = "anonymous"


class AuthError(Exception):
    """The caller did not present a valid gateway key (rendered as a 401 in its dialect)."""


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    # The provider credential to forward when no upstream key is configured; never a gateway key.
    credential: str | None
    # No credential at all (forward mode): nothing to scope memory by, so none is kept.
    anonymous: bool = False


def presented_credential(headers: Mapping[str, str]) -> str | None:
    """The API key as an SDK sends it: `Authorization: Bearer …` (OpenAI, anthropic >= 2) or `x-api-key`."""
    value = headers.get("Authorization")
    if value:
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


def tenant_for(credential: str | None, *, client_tenant: str | None = None) -> str:
    """The gateway key's tenant, else a stable digest of the upstream credential, else anonymous."""
    if client_tenant:
        return client_tenant
    if credential:
        return hashlib.sha256(credential.encode()).hexdigest()[:16]
    return ANONYMOUS


def _digest(key: str) -> bytes:
    # Keys are looked up by digest so the dict lookup does not compare secrets byte by byte.
    return hashlib.sha256(key.encode()).digest()


_TENANT_CACHE_SIZE = 4096


class Authenticator:
    def __init__(self, settings: Settings) -> None:
        self._tenants = {_digest(k.key): k.tenant for k in settings.auth.keys}
        self.required = bool(self._tenants) or settings.requires_client_keys()
        token = settings.auth.admin_token
        self._admin = _digest(token) if token else None
        self._admin_len = len(token) if token else 0
        # Where the token may stand in a header, path or query: between characters it does not hold
        # itself (so it is one piece wherever it stands alone), looked up by digest, never searched
        # for as a substring (the time a search takes tells how much of the secret a guess matches).
        seps = "".join(c for c in " \t,;=&/?:\"'()<>[]{}@+" if not token or c not in token)
        self._pieces = re.compile(f"[^{re.escape(seps)}]+") if seps else None
        # A client sends the same credential on every request: hash it once, not per request.
        self._derived: dict[str, str] = {}

    def _carries_admin(self, credential: str | None, headers: Mapping[str, str], target: str) -> bool:
        """Whether the admin token is anywhere a proxied request takes upstream: the credential the
        gateway reads, any other header's value or name (a second key header, `api-key`, a custom
        one), the path or the query string (also percent-decoded)."""
        admin, n = self._admin, self._admin_len
        assert admin is not None
        if credential and hmac.compare_digest(_digest(credential), admin):
            return True
        texts = [text for item in headers.items() for text in item if len(text) >= n]
        if len(target) >= n:
            texts += (target, unquote_plus(target))
        if self._pieces is None:
            return any(hmac.compare_digest(_digest(text), admin) for text in texts)
        return any(len(piece) == n and hmac.compare_digest(_digest(piece), admin)
                   for text in texts for piece in self._pieces.findall(text))

    def _tenant_of(self, credential: str | None) -> str:
        if credential is None:
            return ANONYMOUS
        tenant = self._derived.get(credential)
        if tenant is None:
            tenant = tenant_for(credential)
            if len(self._derived) >= _TENANT_CACHE_SIZE:
                self._derived.clear()
            self._derived[credential] = tenant
        return tenant

    def identify(self, headers: Mapping[str, str], target: str = "") -> Identity:
        """The request's tenant and provider credential. `target`: a proxied request's raw path and
        query, which go upstream too."""
        credential = presented_credential(headers)
        if self._admin is not None and self._carries_admin(credential, headers, target):
            # Never forwarded upstream as a provider key, nor taken as a tenant's credential.
            raise AuthError("the admin token serves the conversation API only")
        if not self.required:
            return Identity(self._tenant_of(credential), credential, anonymous=credential is None)
        explicit = headers.get(GATEWAY_KEY_HEADER)
        key = explicit.strip() if explicit else credential
        tenant = self._tenants.get(_digest(key)) if key else None
        if tenant is None:
            raise AuthError("missing gateway key" if not key else "invalid gateway key")
        # Only a credential that came apart from the gateway key may be a provider credential.
        return Identity(tenant, credential if explicit and credential != key else None)
