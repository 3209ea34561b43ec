"""Tenants: who may find whose stored conversations, and the API keys that say who asks.

    scope = Scope.of(tenant, salt)      what a stored prefix is filed under (``SHARED``: "", no salt)
    tenants = load_api_keys(path)       ``--api-keys FILE``; ``PolicyError`` naming the field
    tenants = Tenants.single(key)       ``--api-key KEY``: one tenant, named "" (the shared scope)
    tenants.find(token) -> name | None  the tenant a bearer token belongs to (None: no such key)
    tenants.budgets -> {name: bytes}    the tenants with a ``budget``

The keys file (YAML, read by the generic loader of policies; a key given twice in one mapping is
refused, a secret is never shown in an error)::

    alice:
      key: sk-alice-...           # one key
      budget: 512MiB              # optional: bytes of alice's stored entries, all tiers together
    bob:
      keys: [sk-bob-1, sk-bob-2]  # or several

A stored prefix is found only by requests of its scope: the same tenant and the same
``cache_salt`` (a request's string; vLLM's field). ``Scope.digest`` is a sha256 of both (never
the salt itself), so a persisted or remote entry carries no salt in clear; the shared scope has an
empty digest, so a server without keys files its entries, and names its Redis chunks, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field

from tiercache.errors import PolicyError
from tiercache.policy.fields import Size, build, read_yaml


@dataclass(frozen=True)
class Scope:
    tenant: str = ""
    digest: str = ""  # sha256 of (tenant, salt); "" for the shared scope

    @classmethod
    def of(cls, tenant: str | None = None, salt: str | None = None) -> "Scope":
        tenant, salt = tenant or "", salt or ""
        if not tenant and not salt:
            return SHARED
        return cls(tenant, hashlib.sha256(json.dumps([tenant, salt]).encode("utf-8")).hexdigest()[:32])


SHARED = Scope()


@dataclass(frozen=True)
class Tenant:
    key: str | None = field(default=None, metadata={"secret": True}, repr=False)
    keys: tuple[str, ...] = field(default=(), metadata={"secret": True}, repr=False)
    budget: Size | None = None  # bytes of this tenant's stored entries, every tier together (None: no own limit)

    @property
    def all_keys(self) -> tuple[str, ...]:
        return ((self.key,) if self.key is not None else ()) + self.keys


class Tenants:
    def __init__(self, tenants: dict[str, Tenant]):
        self.tenants = dict(tenants)
        self._digests = [(_digest(k), name) for name, t in self.tenants.items() for k in t.all_keys]

    @classmethod
    def single(cls, key: str) -> "Tenants":
        return cls({"": Tenant(key=key)})

    @property
    def budgets(self) -> dict[str, int]:
        return {name: int(t.budget) for name, t in self.tenants.items() if t.budget is not None}

    def find(self, token: str) -> str | None:
        """The tenant of ``token``; every key is compared, in constant time, whatever matches."""
        given, found = _digest(token), None
        for digest, name in self._digests:
            if hmac.compare_digest(given, digest):
                found = name
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def load_api_keys(path) -> Tenants:
    """``--api-keys FILE``: the tenants and their keys, checked (see the module docstring)."""
    where = f"api keys {str(path)!r}"
    data = read_yaml(path, "api keys file", secret=True)
    if not isinstance(data, dict) or not data:
        raise PolicyError(f"{where}: expected a mapping of tenant names to {{key: SECRET}} or {{keys: [...]}} "
                          "(and an optional budget), got " + ("nothing" if not data else type(data).__name__))
    tenants = build(dict[str, Tenant], data, where)
    owner: dict[bytes, str] = {}
    for name, t in tenants.items():
        at = f"{where}.{name}"
        if not name.strip():
            raise PolicyError(f"{where}: a tenant name is empty; give each tenant a name")
        if not t.all_keys:
            raise PolicyError(f"{at}: no key; give key: SECRET or keys: [SECRET, ...]")
        for i, k in enumerate(t.all_keys):
            if not k.strip() or k != k.strip():
                raise PolicyError(f"{at}: key {i} is empty or has spaces around it (not shown); give the key alone")
            d = _digest(k)
            if d in owner:
                raise PolicyError(f"{at}: a key of tenant {name!r} is also a key of tenant {owner[d]!r} (not "
                                  "shown); a key names one tenant")
            owner[d] = name
        if t.budget is not None and t.budget < 1:
            raise PolicyError(f"{at}.budget: a budget of 0 bytes stores nothing; give a size such as 256MiB, "
                              "or omit it")
    return Tenants(tenants)
