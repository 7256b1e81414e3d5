"""`[store].url`: a PostgreSQL URL checked before anything connects, and how it connects.

The password never sits in the file: a URL carrying one (`user:secret@host` or
`?password=`) is refused, and `[store].password_env` names the environment variable that
holds it. Everything else is libpq's (host, port, dbname, sslmode, ... and the PG*
environment variables), since psycopg hands the URL to libpq as it is.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, urlsplit

SCHEMES = ("postgresql", "postgres")


class PgUrlError(ValueError):
    pass


def is_url(text: str | None) -> bool:
    return bool(text) and text.split("://", 1)[0].lower() in SCHEMES and "://" in text


def check_url(url: str) -> None:
    """PgUrlError unless `url` is a postgresql:// URL without a password in it."""
    if not is_url(url):
        raise PgUrlError("must be a postgresql:// (or postgres://) URL")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a bad port raises here
    except ValueError as exc:
        raise PgUrlError(f"not a valid URL ({exc})") from None
    netloc = parts.netloc.rpartition("@")[0]
    if ":" in netloc:
        raise PgUrlError("must not carry a password: name an environment variable in "
                         "store.password_env instead")
    if any(k.lower() == "password" for k, _ in parse_qsl(parts.query)):
        raise PgUrlError("must not carry password=: name an environment variable in "
                         "store.password_env instead")


def connect_kwargs(url: str, password_env: str | None, environ=os.environ) -> dict:
    """psycopg.connect(**kwargs): the URL, and the password read from the environment.
    KeyError naming the variable if it is not set."""
    kw: dict = {"conninfo": url}
    if password_env:
        if password_env not in environ:
            raise KeyError(password_env)
        kw["password"] = environ[password_env]
    return kw
