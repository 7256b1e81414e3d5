"""relay: a pure-asyncio HTTP/1.1 relay for Server-Sent-Event LLM traffic.

The package's version is written here and nowhere else: pyproject.toml reads it
(`[tool.setuptools.dynamic]`), and so does `relay --version`. CHANGELOG.md says what each
version holds.
"""

__version__ = "0.1.0"
