"""Config file for the relay under test, generated in the temp dir.

The relay admits at most ``parallel`` streams per upstream (a llama-server
``-np`` slot count; default 1) and answers 503 past its queue, but the
simulator has no slot limit: so the benchmark gives its one upstream
``parallel = 4096``.  Its request store goes to the temp dir.  ``--relay-config
FILE`` (TOML) is merged over this: its tables' keys win, and the keys of its
first ``[[upstream]]`` are merged into the benchmark's upstream (whose ``url``
always stays the benchmark upstream).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path


def build(up_url: str, tmp: Path, user_file: str | None = None, ca_file: str | None = None) -> dict:
    conf: dict = {
        "upstream": [{"name": "bench", "url": up_url, "parallel": 4096}],
        "store": {"path": str(tmp / "relay.db")},
    }
    if ca_file:  # a TLS upstream with the bench's private CA (bench/tls.py)
        conf["upstream"][0]["ca_file"] = ca_file
    if user_file:
        with open(user_file, "rb") as f:
            user = tomllib.load(f)
        for key, val in user.items():
            if key == "upstream" and val:
                conf["upstream"][0].update({k: v for k, v in val[0].items() if k != "url"})
            elif isinstance(val, dict):
                conf.setdefault(key, {}).update(val)
            else:
                conf[key] = val
    return conf


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def dumps(conf: dict) -> str:
    """Enough TOML for the relay's config: scalars, tables, arrays of tables."""
    top = [
        f"{k} = {_value(v)}"
        for k, v in conf.items()
        if not isinstance(v, (dict, list))
        or (isinstance(v, list) and not (v and isinstance(v[0], dict)))
    ]
    out = top + [""] if top else []
    for k, v in conf.items():
        if isinstance(v, dict):
            out += [f"[{k}]"] + [f"{kk} = {_value(vv)}" for kk, vv in v.items()] + [""]
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                out += [f"[[{k}]]"] + [f"{kk} = {_value(vv)}" for kk, vv in item.items()] + [""]
    return "\n".join(out)


def write(up_url: str, tmp: Path, user_file: str | None = None, ca_file: str | None = None) -> Path:
    for suffix in ("", "-wal", "-shm"):  # every relay starts with an empty store
        (tmp / f"relay.db{suffix}").unlink(missing_ok=True)
    path = tmp / "relay.toml"
    path.write_text(dumps(build(up_url, tmp, user_file, ca_file)))
    return path
