"""How an exchange with an upstream can end, and the ways it can fail before its head."""

DONE = "done"
DROPPED = "upstream_dropped"
BAD_FRAMING = "upstream_bad_framing"
CLIENT_GONE = "client_closed"
CLIENT_SLOW = "client_write_timeout"
ERROR_EVENT = "upstream_error_event"
STALL = "stall"
SHUTDOWN = "shutdown"


class UpstreamGone(Exception):
    """The upstream closed before a whole response head; `silent` if not one byte came."""

    def __init__(self, silent: bool) -> None:
        super().__init__("upstream closed the connection before a response head")
        self.silent = silent


class UpstreamBadHead(Exception):
    pass


class ClientGone(Exception):
    pass


class RelayShutdown(Exception):
    """The relay stopped while this request still waited for its upstream head."""
