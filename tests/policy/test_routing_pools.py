"""relay/policy/routing.py without sockets: several upstreams listing one name form its pool."""

from __future__ import annotations

import pytest

from relay.config import UpstreamConfig
from relay.policy.routing import NoRoute, Pool, Route, Router, model_list


def up(name: str, **kw: object) -> UpstreamConfig:
    return UpstreamConfig(name=name, url="http://127.0.0.1:1", **kw)  # type: ignore[arg-type]


def test_upstreams_listing_one_model_form_its_pool_in_the_order_written():
    r = Router([up("a", models=["tiny"]), up("b", models=["big"]), up("c", models=["tiny"])])
    assert r.candidates("tiny") == Route(Pool("tiny", ("a", "c")))
    assert r.candidates("big") == Route(Pool("b", ("b",)))
    assert r.pools == [Pool("tiny", ("a", "c"))]


def test_a_model_is_listed_once_by_v1_models():
    r = Router([up("a", models=["tiny", "x"]), up("b", models=["tiny"], aliases=["t"])])
    assert r.models == [("tiny", "a"), ("x", "a"), ("t", "b")]
    assert model_list(r.models).count(b'"tiny"') == 1


def test_an_alias_listed_by_several_upstreams_is_a_pool_too():
    r = Router([up("a", models=["m1"], aliases=["fast"]), up("b", models=["m2"], aliases=["fast"])])
    assert r.candidates("fast").pool == Pool("fast", ("a", "b"))


def test_an_alias_naming_the_same_members_shares_the_model_pool():
    r = Router([up("a", models=["tiny"], aliases=["t"]), up("b", models=["tiny"], aliases=["t"])])
    assert r.candidates("t").pool is r.candidates("tiny").pool
    assert r.pools == [Pool("tiny", ("a", "b"))]


def test_a_catch_all_joins_no_pool_and_only_the_first_is_one():
    r = Router([up("a", models=["tiny"]), up("any"), up("other"), up("c", models=["tiny"])])
    assert r.candidates("unknown") == Route(Pool("any", ("any",)))
    assert r.candidates("tiny").pool == Pool("tiny", ("a", "c"))


def test_no_catch_all_no_route():
    r = Router([up("a", models=["tiny"]), up("b", models=["tiny"])])
    with pytest.raises(NoRoute):
        r.candidates("unknown")


def test_a_request_without_a_model_goes_to_the_first_upstreams_pool():
    r = Router([up("a", models=["tiny"]), up("b", models=["tiny"])])
    assert r.candidates(None).pool == Pool("tiny", ("a", "b"))
    assert r.candidates("").pool == Pool("tiny", ("a", "b"))
    bare = Router([up("x"), up("y", models=["tiny"])])
    assert bare.candidates(None).pool == Pool("x", ("x",))


def test_fallbacks_follow_the_pool_each_alone_once_and_never_a_member():
    r = Router(
        [
            up("a", models=["tiny"], fallback=["cloud", "b"]),
            up("b", models=["tiny"], fallback=["cloud", "spare"]),
            up("cloud", models=["gpt"]),
            up("spare", models=["gpt"]),
        ]
    )
    route = r.candidates("tiny")
    assert route.fallbacks == (Pool("cloud", ("cloud",)), Pool("spare", ("spare",)))
    assert route.candidates == (Pool("tiny", ("a", "b")), *route.fallbacks)


def test_a_name_a_client_invents_is_not_remembered():
    r = Router([up("any")])
    for i in range(100):
        assert r.candidates(f"model-{i}").pool.members == ("any",)
    # One entry stands for every name the catch-all takes.
    assert len(r._routes) == 1


def test_a_pool_is_found_by_its_name():
    r = Router([up("a", models=["tiny"]), up("b", models=["tiny"]), up("c", models=["big"])])
    assert r.named("tiny") == Pool("tiny", ("a", "b"))
    assert r.named("c") == Pool("c", ("c",))
    assert r.named("nope") is None
