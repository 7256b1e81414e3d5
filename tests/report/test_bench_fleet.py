"""bench.fleet's pure parts (issue 32): the replay's conversations, reading an answer, the
figures (hit ratio, the ideal, percentiles, load spread, moves), the goals and the configs."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from bench import fleet as F
from bench import relay_conf
from relay.config import load_config, parse_config

SHAPE = F.Shape(conversations=4, turns=3, first_tokens=1000, last_tokens=3000, max_tokens=16)


def test_sizes_grow_from_the_first_prompt_to_the_last():
    s = F.plan_sizes(F.Shape(16, 6, 2000, 8000, 16))
    # 1200 tokens a turn: the reply (16) and two templates (16) leave 1168 for the tool result;
    # the first prompt: a tenth for the question, the rest less two templates for the system
    assert (s.system, s.first_user, s.later_user) == (1784, 200, 1168)


def test_conversations_are_seeded_distinct_and_sized_by_the_token_ratio():
    convs = F.make_conversations(SHAPE, chars_per_token=0.5)
    assert convs == F.make_conversations(SHAPE, chars_per_token=0.5)
    other = F.make_conversations(F.Shape(**{**SHAPE.__dict__, "seed": 7}), 0.5)
    assert [c.system for c in other] != [c.system for c in convs]
    assert len(convs) == 4 and all(len(c.users) == 3 for c in convs)
    # each its own text, not only its own first words
    assert len({c.system.split(". ", 1)[1][:40] for c in convs}) == 4
    assert len({c.users[1].split(": ", 1)[1][:40] for c in convs}) == 4
    # system 1000 - 100 - 16 = 884 tokens = 442 characters; question 100 tokens = 50 (+ "Task i: ");
    # a tool result (1000 - 16 - 16) = 968 tokens = 484 characters (+ "Tool result i.k: ")
    assert [len(c.system) for c in convs] == [442] * 4
    assert len(convs[0].users[0]) == len("Task 0: ") + 50
    assert len(convs[2].users[1]) == len("Tool result 2.1: ") + 484


def test_a_turn_carries_the_whole_conversation_with_the_servers_replies():
    c = F.Conversation(0, "sys", ("q1", "q2", "q3"))
    assert c.messages(0, []) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
    ]
    body = c.body(2, ["r1", "r2"], 16)
    assert [(m["role"], m["content"]) for m in body["messages"]] == [
        ("system", "sys"),
        ("user", "q1"),
        ("assistant", "r1"),
        ("user", "q2"),
        ("assistant", "r2"),
        ("user", "q3"),
    ]
    assert (body["stream"], body["max_tokens"], body["model"]) == (True, 16, "tiny")


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_an_answer_gives_its_text_its_timings_and_its_server():
    model = "/tmp/a/tiny.gguf"
    raw = (
        _event({"model": model, "choices": [{"delta": {"role": "assistant", "content": None}}]})
        + _event({"model": model, "choices": [{"delta": {"content": "Hello"}}]})
        + _event({"model": model, "choices": [{"delta": {"content": " from"}}]})
        + _event(
            {
                "model": model,
                "choices": [{"finish_reason": "length", "delta": {}}],
                "timings": {"cache_n": 10, "prompt_n": 5, "prompt_ms": 1.5},
            }
        )
        + b"data: [DONE]\n\n"
    )
    for data in (raw, raw.replace(b"\n", b"\r\n")):
        out = F.read_stream(data)
        assert out == F.Readout(
            "Hello from", {"cache_n": 10, "prompt_n": 5, "prompt_ms": 1.5}, model
        )
    assert F.read_stream(b"") == F.Readout("", None, None)


def _turn(
    conv, turn, prompt_n, cache_n, ttft, member="m1", error=None, prompt_ms=None, predicted_ms=None
):
    return {
        "conv": conv,
        "turn": turn,
        "prompt_n": prompt_n,
        "cache_n": cache_n,
        "ttft_ms": ttft,
        "prompt_ms": prompt_ms,
        "predicted_ms": predicted_ms,
        "member": member,
        "error": error,
    }


def test_hit_ratio_ideal_and_spread():
    assert F.hit_ratio(300, 100) == 0.75
    assert F.hit_ratio(0, 0) is None
    turns = [_turn(0, 0, 100, 0, 1), _turn(0, 1, 40, 110, 1), _turn(1, 0, 90, 0, 1)]
    assert F.ideal_tokens(turns, 2) is None  # conversation 1 never reached its final turn
    turns.append(_turn(1, 1, 120, 10, 1))
    assert F.ideal_tokens(turns, 2) == 150 + 130
    assert F.load_spread([6, 6, 6]) == 1.0
    assert F.load_spread([9, 6, 3]) == 1.5
    assert F.load_spread([]) is None and F.load_spread([0, 0]) is None


def test_percentiles_are_nearest_rank():
    xs = list(range(1, 101))
    assert (F.pct(xs, 50), F.pct(xs, 99), F.pct(xs, 100)) == (50, 99, 100)
    assert F.pct([20, 10], 50) == 10
    assert F.pct([], 50) is None


def test_moves_count_follow_ups_served_elsewhere():
    turns = [
        _turn(0, 0, 1, 0, 1, "m1"),
        _turn(0, 1, 1, 0, 1, "m1"),
        _turn(0, 2, 1, 0, 1, "m2"),
        _turn(1, 2, 1, 0, 1, "m2"),
        _turn(1, 0, 1, 0, 1, "m2"),
        _turn(1, 1, 1, 0, 1, "m3"),
        _turn(2, 0, 1, 0, 1, None),
        _turn(2, 1, 1, 0, 1, "m1"),
    ]
    assert F.moves(turns) == 3


def test_figures_of_a_run():
    turns = [
        _turn(0, 0, 1000, 0, 500.0),
        _turn(0, 1, 200, 1016, 100.0, prompt_ms=80.0, predicted_ms=20.0),
        _turn(1, 0, 1000, 0, 600.0, member="m2"),
        _turn(1, 1, 1216, 0, 300.0, member="m3", prompt_ms=150.0),
        _turn(2, 0, None, None, None, error="HTTP 503"),
    ]
    f = F.figures(turns, 2, [2, 1, 1])
    assert (f["requests"], f["errors"], f["processed"], f["cached"]) == (5, 1, 3416, 1016)
    assert f["ideal"] is None  # conversation 2 failed
    assert f["hit_ratio"] == 1016 / 4432
    assert (f["ttft_p50_ms"], f["ttft_p99_ms"], f["first_ttft_p50_ms"]) == (100.0, 300.0, 500.0)
    assert (f["prompt_ms_p50"], f["prefill_share_p50"]) == (80.0, 0.5)
    # TTFT less prefill: 100 - 80 and 300 - 150
    assert (f["rest_p50_ms"], f["rest_min_ms"]) == (20.0, 20.0)
    assert (f["load_spread"], f["moves"], f["follow_ups"]) == (1.5, 1, 2)
    nameless = [{**t, "member": None} for t in turns]
    assert F.figures(nameless, 2, [2, 1, 1])["moves"] is None
    f = F.figures(turns[:4], 2, [2, 1, 1])
    # each prefix once: 1216 + 1216 tokens; read: 1000 + 200 + 1000 + 1216
    assert (f["ideal"], f["over_ideal"]) == (2432, 3416 / 2432)


def _decision(heavy_p50):
    every = {"p50": 10.0, "p99": 200.0}
    return {
        "replay": {"heavy_us": {"p50": heavy_p50}, "decision_us": every},
        "real_size": {"heavy_us": {"p50": heavy_p50 + 1}, "decision_us": every},
    }


def test_goals_met_missed_and_pending():
    med = {
        "onebox": {"hit_ratio": 0.80},
        "nginx": {"ttft_p50_ms": 900.0},
        "relay_affinity": {"hit_ratio": 0.73, "ttft_p50_ms": 300.0, "load_spread": 1.5},
    }
    assert [g.ok for g in F.goals(med, _decision(48.0))] == [True] * 5
    assert [g.ok for g in F.goals(med, _decision(49.0))] == [True, True, True, True, False]
    med["relay_affinity"] = {"hit_ratio": 0.71, "ttft_p50_ms": 301.0, "load_spread": 1.51}
    assert [g.ok for g in F.goals(med, _decision(50.0))] == [False] * 5
    del med["relay_affinity"]
    assert [g.ok for g in F.goals(med, None)] == [None] * 5
    # Each affinity target is judged on its own figures.
    med["relay_affinity_fixed"] = {"hit_ratio": 0.75, "ttft_p50_ms": 300.0, "load_spread": 1.0}
    judged = F.goals(med, _decision(10.0), "relay_affinity_fixed")
    assert [g.ok for g in judged] == [True] * 5
    assert judged[0].name.startswith("relay_affinity_fixed hit ratio")
    assert [g.ok for g in F.goals(med, _decision(10.0))][:3] == [None] * 3


def test_decision_cost_times_every_body_of_every_pass():
    convs = F.make_conversations(F.Shape(3, 2, 100, 200, 4), 1.0)
    bodies = [json.dumps(c.body(k, ["r"] * k, 4)).encode() for k in range(2) for c in convs]
    d = F.decision_cost(bodies, passes=2, heavy=3)
    assert (d["bodies"], d["samples"], d["heavy"]) == (6, 12, 3)
    # per conversation: the head (unit 0) once, shared by none, and one unit per message
    assert d["table_entries"] == 3 * 4
    assert 0 < d["decision_us"]["p50"] <= d["decision_us"]["p99"] <= d["decision_us"]["max"]


def test_metrics_text_to_values():
    text = '# HELP x\nllamacpp:prompt_tokens_total 12925\nllamacpp:x{a="b"} 1\nother 2.5\n'
    assert F.parse_metrics(text) == {"prompt_tokens_total": 12925.0, "other": 2.5}


def test_haproxy_balances_by_least_connections_over_every_member():
    conf = F.haproxy_conf("127.0.0.1", 9000, [("127.0.0.1", 1), ("127.0.0.1", 2)])
    assert "balance leastconn" in conf and "bind 127.0.0.1:9000" in conf
    assert "server m1 127.0.0.1:1\n    server m2 127.0.0.1:2" in conf


def test_relay_config_is_one_pool_and_takes_the_users_keys(tmp_path: Path):
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    user = tmp_path / "user.toml"
    user.write_text('[balance]\nepsilon = 0.5\n[[upstream]]\nqueue = 8\nurl = "http://x"\n')
    conf = F.relay_config(urls, F.BALANCE["relay_affinity"], 9000, tmp_path / "r.db", str(user))
    back = tomllib.loads(relay_conf.dumps(conf))
    assert back["server"]["port"] == 9000
    assert back["balance"] == {
        "affinity": True,
        "epsilon": 0.5,
        "affinity_wait_s": 0.5,
        "home_wait_s": "auto",
    }
    assert [
        (u["name"], u["url"], u["models"], u["parallel"], u["queue"]) for u in back["upstream"]
    ] == [
        ("m1", urls[0], ["tiny"], 2, 8),
        ("m2", urls[1], ["tiny"], 2, 8),
        ("m3", urls[2], ["tiny"], 2, 8),
    ]
    least = F.relay_config(urls, F.BALANCE["relay_least"], 9000, tmp_path / "r.db")
    assert least["balance"] == {
        "affinity": False,
        "epsilon": 0.25,
        "affinity_wait_s": 0.5,
        "home_wait_s": "auto",
    }
    fixed = F.relay_config(urls, F.BALANCE["relay_affinity_fixed"], 9000, tmp_path / "r.db")
    assert fixed["balance"] == {
        "affinity": True,
        "epsilon": 0.25,
        "affinity_wait_s": 0.5,
        "home_wait_s": 0.5,
    }
    # Every relay target's config is one the relay accepts.
    for target in F.RELAY_TARGETS:
        path = tmp_path / f"{target}.toml"
        conf = F.relay_config(urls, F.BALANCE[target], 9000, tmp_path / "r.db")
        path.write_text(relay_conf.dumps(conf))
        assert parse_config(load_config(str(path))).balance.affinity is (target != "relay_least")


def test_rescaled_bodies_keep_the_order_and_the_replies():
    shape = F.Shape(2, 2, 100, 200, 4)
    sent = [(1, 0, b""), (0, 0, b""), (1, 1, b"")]
    turns = [
        {"conv": 1, "turn": 0, "reply": "r10"},
        {"conv": 0, "turn": 0, "reply": "r00"},
        {"conv": 1, "turn": 1, "reply": "r11"},
    ]
    out = [json.loads(b) for b in F.rescaled_bodies(sent, turns, shape, 2.0)]
    convs = F.make_conversations(shape, 2.0)
    assert [len(b["messages"]) for b in out] == [2, 2, 4]
    assert out[0]["messages"][0]["content"] == convs[1].system
    assert out[2]["messages"][2] == {"role": "assistant", "content": "r10"}
    # system: 100 - 10 - 16 = 74 tokens at 2 characters a token
    assert len(out[1]["messages"][0]["content"]) == 148


def test_synthetic_replay_sends_every_turn_in_order_with_replies_as_long_as_max_tokens():
    shape = F.Shape(3, 2, 100, 200, 4)
    sent, turns = F.synthetic_replay(shape, 2.0)
    assert [(c, k) for c, k, _ in sent] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert [(t["conv"], t["turn"]) for t in turns] == [(c, k) for c, k, _ in sent]
    assert all(len(t["reply"]) == 8 for t in turns)
    later = json.loads(sent[4][2])
    convs = F.make_conversations(shape, 2.0)
    assert later["messages"] == convs[1].messages(1, [turns[1]["reply"]])
    # Seeded: the same replay every time.
    assert F.synthetic_replay(shape, 2.0) == (sent, turns)
