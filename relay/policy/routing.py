"""Which upstreams may serve a request: model name -> its pool, then its fallbacks.

Every public name (a `models` entry or an `aliases` entry) is served by the upstreams that list
it, in the order written: one upstream, or several, which then form that name's pool and are
balanced (`policy.affinity`, `proxy.slots`). Exact model names first, then aliases; a name no
upstream lists goes to the first upstream that lists no models (a catch-all, as
`--upstream URL` gives: it joins no pool, and only the first one is the catch-all); a request
without a model goes to the pool of the first upstream's first name (the first upstream alone
when it lists none). After the pool come the `fallback` names of its members, in order, each
an upstream of its own: another model or provider, tried once every member failed before
content.
"""

from __future__ import annotations

import msgspec

from relay.config import UpstreamConfig

# The routes cache's key for every name no upstream lists (the catch-all's).
_OTHER = "\x00other"


class NoRoute(LookupError):
    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model


class Pool(msgspec.Struct, frozen=True, gc=False):
    """The upstreams serving one public name, in the order written (one or more). `name` is
    the first public name served by exactly these members, or the upstream's own name when
    it stands alone: what rows and metrics call it."""

    name: str
    members: tuple[str, ...]


class Route(msgspec.Struct, frozen=True, gc=False):
    """Where a request may go: its pool first, then each fallback upstream alone."""

    pool: Pool
    fallbacks: tuple[Pool, ...] = ()

    @property
    def candidates(self) -> tuple[Pool, ...]:
        return (self.pool, *self.fallbacks)


class Router:
    def __init__(self, upstreams: list[UpstreamConfig]) -> None:
        self.order = [u.name for u in upstreams]
        self.fallback = {u.name: list(u.fallback) for u in upstreams}
        # Each upstream alone, for its fallbacks and a catch-all.
        self.alone = {u.name: Pool(u.name, (u.name,)) for u in upstreams}
        exact: dict[str, list[str]] = {}
        alias: dict[str, list[str]] = {}
        for u in upstreams:
            for m in u.models:
                _join(exact, m, u.name)
            for a in u.aliases:
                _join(alias, a, u.name)
        self.exact = self._pools(exact, {})
        self.alias = self._pools(alias, self.exact)
        self.catch_all = next((u.name for u in upstreams if not u.models), None)
        first = upstreams[0] if upstreams else None
        self.default = (
            self.exact[first.models[0]]
            if first is not None and first.models
            else self.alone.get(first.name if first is not None else "")
        )
        # Every public name, aliases included, once (with the first upstream it routes to).
        self.models = [(m, p.members[0]) for m, p in self.exact.items()]
        self.models += [(a, p.members[0]) for a, p in self.alias.items() if a not in self.exact]
        self._routes: dict[str | None, Route] = {}

    def _pools(self, names: dict[str, list[str]], known: dict[str, Pool]) -> dict[str, Pool]:
        """Each name's pool; members that already form a pool (of a model, an alias seen
        before, or one upstream alone) share it, so that it has one name."""
        by_members = {p.members: p for p in known.values()}
        by_members.update({p.members: p for p in self.alone.values()})
        out: dict[str, Pool] = {}
        for name, members in names.items():
            key = tuple(members)
            pool = by_members.get(key)
            if pool is None:
                pool = by_members[key] = Pool(name, key)
            out[name] = pool
        return out

    @property
    def pools(self) -> list[Pool]:
        """Every pool of two or more members, once, in the order its name first appears."""
        seen: dict[tuple[str, ...], Pool] = {}
        for pool in (*self.exact.values(), *self.alias.values()):
            if len(pool.members) > 1:
                seen.setdefault(pool.members, pool)
        return list(seen.values())

    def named(self, name: str) -> Pool | None:
        """The pool of this name (a pool of several members by its model name, an upstream
        alone by its own)."""
        for pool in (*self.exact.values(), *self.alias.values(), *self.alone.values()):
            if pool.name == name:
                return pool
        return None

    def primary(self, model: str | None) -> Pool:
        if not model:
            if self.default is None:
                raise NoRoute("")
            return self.default
        pool = self.exact.get(model) or self.alias.get(model)
        if pool is None and self.catch_all is not None:
            pool = self.alone[self.catch_all]
        if pool is None:
            raise NoRoute(model)
        return pool

    def candidates(self, model: str | None) -> Route:
        """The pool serving `model`, then its members' fallbacks (NoRoute: none serves it)."""
        route = self._routes.get(model)
        if route is None and model and model not in self.exact and model not in self.alias:
            route = self._routes.get(_OTHER)
        if route is not None:
            return route
        pool = self.primary(model)
        fallbacks: list[Pool] = []
        for member in pool.members:
            for name in self.fallback.get(member, ()):
                alone = self.alone[name]
                if name not in pool.members and alone not in fallbacks:
                    fallbacks.append(alone)
        route = Route(pool, tuple(fallbacks))
        if model is None or model in self.exact or model in self.alias:
            self._routes[model] = route
        else:
            # Any other name goes to the catch-all: one entry for all of them (a client
            # cannot grow this map with names of its own).
            self._routes[_OTHER] = route
        return route


def _join(names: dict[str, list[str]], name: str, upstream: str) -> None:
    members = names.setdefault(name, [])
    if upstream not in members:
        members.append(upstream)


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
