"""relay: a pure-asyncio HTTP/1.1 relay for Server-Sent-Event LLM traffic."""

__version__ = "0.1.0"
