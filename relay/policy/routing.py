"""Which upstreams may serve a request: model name -> ordered candidate list.

Exact model names first, then aliases, then an upstream that lists no models (a catch-all,
as `--upstream URL` gives); a request without a model goes to the first upstream. The list
continues with the primary's `fallback` names, in order.
"""

from __future__ import annotations

import msgspec

from relay.config import UpstreamConfig


class NoRoute(LookupError):
    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model


class Router:
    def __init__(self, upstreams: list[UpstreamConfig]) -> None:
        self.order = [u.name for u in upstreams]
        self.fallback = {u.name: list(u.fallback) for u in upstreams}
        self.exact: dict[str, str] = {}
        self.alias: dict[str, str] = {}
        for u in upstreams:
            for m in u.models:
                self.exact.setdefault(m, u.name)
            for a in u.aliases:
                self.alias.setdefault(a, u.name)
        self.catch_all = next((u.name for u in upstreams if not u.models), None)
        # Every public name, aliases included, once (with the upstream it routes to).
        self.models = [(m, u.name) for u in upstreams for m in u.models if self.exact[m] == u.name]
        self.models += [
            (a, u.name)
            for u in upstreams
            for a in u.aliases
            if a not in self.exact and self.alias[a] == u.name
        ]

    def primary(self, model: str | None) -> str:
        if not model:
            return self.order[0]
        name = self.exact.get(model) or self.alias.get(model) or self.catch_all
        if name is None:
            raise NoRoute(model)
        return name

    def candidates(self, model: str | None) -> list[str]:
        first = self.primary(model)
        out = [first]
        for name in self.fallback.get(first, ()):
            if name not in out:
                out.append(name)
        return out


class _Model(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str


class _ModelList(msgspec.Struct):
    object: str
    data: list[_Model]


def model_list(models: list[tuple[str, str]]) -> bytes:
    """OpenAI's `GET /v1/models` shape for the configured models."""
    return msgspec.json.encode(
        _ModelList("list", [_Model(m, "model", 0, owner) for m, owner in models])
    )
