"""Capture the pinned llama-server's Anthropic Messages and OpenAI Responses exchanges.

    python -m tests.e2e.capture_apis                 # writes tests/support/captures/*.http
    python -m tests.e2e.capture_apis --out DIR       # elsewhere
    python -m tests.e2e.capture_apis --only NAME ... # some of them

It starts the reference build (``build_llama_server``: the cached pinned llama.cpp, or
``$LLAMA_SERVER_BIN``) twice on the tiny deterministic model (``tiny_gguf``), from a temp dir
holding ``models/tiny.gguf`` (so the server reports ``"model":"models/tiny.gguf"`` as in the
chat/completions captures), with the e2e suite's arguments ``-c 4096 -np 2 -t 1 --metrics``:

* ``plain``: the model's own ChatML template (jinja is on by default in this build), for the
  text streams, the non-streamed bodies, the token counters and the errors;
* ``tools``: ``--chat-template-file tool_template.jinja``, a Hermes/Qwen-style template with
  ``<tool_call>`` (``TOOL_TEMPLATE`` below), so llama-server parses tool calls. The tiny model
  cannot write one, so the request prefills the assistant turn with the call and sets a stop
  word (``Hello``) that the model's first token holds: the generated text is empty, and the
  server's parser, which reads the prefill as part of the output, turns the prefill into a
  real ``tool_use`` block / ``function_call`` item.

Each exchange goes over a fresh connection and is written as the chat/completions captures are: the
request as sent, a line ``======== RESPONSE (raw bytes) ========``, the response exactly as
read from the socket (chunked framing included): a Content-Length body up to its length, a
stream up to the server's close.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .build_llama_server import SDIST
from .llama_server import DEFAULT_ARGS, builds, free_port
from .tiny_gguf import write_tiny_model

OUT = Path(__file__).resolve().parents[1] / "support" / "captures"
SEP = b"======== RESPONSE (raw bytes) ========\n"
IO_TIMEOUT = 15.0

TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{{- 'You are a helpful assistant.' }}"
    '{{- "\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools>'
    ' XML tags:\\n<tools>" }}{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}'
    '{%- endfor %}{{- "\\n</tools>\\n\\nFor each function call, return a json object with '
    "function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
    '<|im_end|>\\n" }}{%- endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}"
    "{%- endif %}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    '{%- endif %}{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' }}"
    "{{- message.content }}{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

HI = [{"role": "user", "content": "Hi there"}]
WEATHER_Q = "What is the weather in Paris?"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
A_TOOLS = [{"name": "get_weather", "description": "Get the weather", "input_schema": SCHEMA}]
R_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": SCHEMA,
    }
]


def _a_call(text: str = "") -> dict:
    """A Messages request whose prefilled assistant turn is a tool call (see the docstring)."""
    return {
        "model": "tiny",
        "max_tokens": 8,
        "stop_sequences": ["Hello"],
        "tools": A_TOOLS,
        "messages": [
            {"role": "user", "content": WEATHER_Q},
            {"role": "assistant", "content": text + CALL},
        ],
    }


def _r_call(text: str = "") -> dict:
    return {
        "model": "tiny",
        "max_output_tokens": 8,
        "stop": ["Hello"],
        "tools": R_TOOLS,
        "input": [
            {"type": "message", "role": "user", "content": WEATHER_Q},
            {"type": "message", "role": "assistant", "content": text + CALL},
        ],
    }


# name -> (server, path, body: dict, or bytes sent as they are)
CASES: dict[str, tuple[str, str, dict | bytes]] = {
    # -- Anthropic Messages
    "messages_stream": ("plain", "/v1/messages", {"model": "tiny", "max_tokens": 8, "stream": True, "messages": HI}),
    "messages_stream_stop_sequence": (
        "plain", "/v1/messages",
        {"model": "tiny", "max_tokens": 8, "stream": True, "stop_sequences": ["."], "messages": HI},
    ),
    "messages_stream_tools_text": (
        "plain", "/v1/messages",
        {"model": "tiny", "max_tokens": 8, "stream": True, "tools": A_TOOLS,
         "messages": [{"role": "user", "content": WEATHER_Q}]},
    ),
    "messages_stream_empty": (
        "plain", "/v1/messages",
        {"model": "tiny", "max_tokens": 8, "stream": True, "stop_sequences": ["Hello"], "messages": HI},
    ),
    "messages_nonstream": ("plain", "/v1/messages", {"model": "tiny", "max_tokens": 8, "messages": HI}),
    "messages_count_tokens": ("plain", "/v1/messages/count_tokens", {"model": "tiny", "messages": HI}),
    "messages_stream_tool_use": ("tools", "/v1/messages", {**_a_call(), "stream": True}),
    "messages_stream_text_then_tool_use": (
        "tools", "/v1/messages", {**_a_call("Let me check.\n"), "stream": True},
    ),
    "messages_nonstream_tool_use": ("tools", "/v1/messages", _a_call()),
    "messages_nonstream_text_then_tool_use": ("tools", "/v1/messages", _a_call("Let me check.\n")),
    "err_messages_invalid_json": ("plain", "/v1/messages", b'{"messages": ['),
    "err_messages_bad_field": (
        "plain", "/v1/messages", {"model": "tiny", "max_tokens": "8", "stream": True, "messages": HI},
    ),
    "err_messages_no_messages": ("plain", "/v1/messages", {"model": "tiny", "max_tokens": 8, "stream": True}),
    # -- OpenAI Responses
    "responses_stream": (
        "plain", "/v1/responses",
        {"model": "tiny", "input": "Hi there", "max_output_tokens": 4, "stream": True},
    ),
    "responses_stream_tools_text": (
        "plain", "/v1/responses",
        {"model": "tiny", "input": WEATHER_Q, "max_output_tokens": 4, "stream": True, "tools": R_TOOLS},
    ),
    "responses_stream_stop": (
        "plain", "/v1/responses",
        {"model": "tiny", "input": "Hi there", "max_output_tokens": 8, "stream": True, "stop": ["."]},
    ),
    "responses_stream_empty": (
        "plain", "/v1/responses",
        {"model": "tiny", "input": "Hi there", "max_output_tokens": 8, "stream": True, "stop": ["Hello"]},
    ),
    "responses_nonstream": ("plain", "/v1/responses", {"model": "tiny", "input": "Hi there", "max_output_tokens": 4}),
    "responses_input_tokens": ("plain", "/v1/responses/input_tokens", {"model": "tiny", "input": "Hi there"}),
    "responses_stream_function_call": ("tools", "/v1/responses", {**_r_call(), "stream": True}),
    "responses_stream_text_then_function_call": (
        "tools", "/v1/responses", {**_r_call("Let me check.\n"), "stream": True},
    ),
    "responses_nonstream_function_call": ("tools", "/v1/responses", _r_call()),
    "responses_nonstream_text_then_function_call": (
        "tools", "/v1/responses", _r_call("Let me check.\n"),
    ),
    "err_responses_invalid_json": ("plain", "/v1/responses", b'{"input": ['),
    "err_responses_bad_field": (
        "plain", "/v1/responses",
        {"model": "tiny", "input": "Hi there", "max_output_tokens": "4", "stream": True},
    ),
    "err_responses_no_input": ("plain", "/v1/responses", {"model": "tiny", "stream": True}),
    "err_responses_previous_response_id": (
        "plain", "/v1/responses",
        {"model": "tiny", "input": "Hi there", "stream": True, "previous_response_id": "resp_x"},
    ),
}  # fmt: skip


def request_bytes(port: int, path: str, body: dict | bytes) -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "User-Agent: raw-capture/1",
        "Accept: */*",
        "Content-Type: application/json",
        f"Content-Length: {len(raw)}",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + raw


def exchange(port: int, req: bytes) -> bytes:
    """Send ``req`` on a fresh connection; the response as read (see the module docstring)."""
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT) as s:
        s.sendall(req)
        data = b""
        while b"\r\n\r\n" not in data:
            got = s.recv(65536)
            if not got:
                raise RuntimeError(f"closed before the head: {data!r}")
            data += got
        head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
        length = next(
            (int(ln.split(":", 1)[1]) for ln in head.split("\r\n") if ln.startswith("content-length:")),
            None,
        )  # fmt: skip
        end = len(head) + 4 + length if length is not None else None
        while end is None or len(data) < end:
            got = s.recv(65536)
            if not got:
                break
            data += got
        if end is None and not data.endswith(b"\r\n0\r\n\r\n"):
            raise RuntimeError(f"a stream that does not end with the last chunk: {data[-40:]!r}")
        return data


class Server:
    """The reference llama-server on the tiny model, from a temp dir (see the docstring)."""

    def __init__(self, binary: Path, extra: tuple[str, ...], workdir: Path) -> None:
        self.port = free_port()
        self.args = (
            "-m", "models/tiny.gguf", "--host", "127.0.0.1", "--port", str(self.port),
            *DEFAULT_ARGS, *extra,
        )  # fmt: skip
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(binary.parent)] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else [])
        )
        self.log = open(workdir / f"llama-server-{self.port}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(binary), *self.args], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if s.recv(64).startswith(b"HTTP/1.1 200"):
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("llama-server: /health not 200 within 60 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--only", nargs="*", default=None, help="capture only these names")
    args = ap.parse_args(argv)
    binary = builds()[0].binary
    if binary is None:
        print("no reference llama-server: python -m tests.e2e.build_llama_server", file=sys.stderr)
        return 1
    names = args.only or list(CASES)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-capture-") as tmp:
        work = Path(tmp)
        (work / "models").mkdir()
        write_tiny_model(work / "models" / "tiny.gguf")
        (work / "tool_template.jinja").write_text(TOOL_TEMPLATE)
        servers: dict[str, Server] = {}
        try:
            for name in names:
                kind, path, body = CASES[name]
                if kind not in servers:
                    extra = (
                        ("--chat-template-file", "tool_template.jinja") if kind == "tools" else ()
                    )
                    servers[kind] = Server(binary, extra, work)
                    print(f"# {kind}: llama-server {' '.join(servers[kind].args)}", flush=True)
                port = servers[kind].port
                req = request_bytes(port, path, body)
                resp = exchange(port, req)
                (args.out / f"{name}.http").write_bytes(req + b"\n" + SEP + resp)
                status = resp.split(b"\r\n", 1)[0].decode()
                print(f"{name}: {status} ({len(resp)} bytes)", flush=True)
        finally:
            for srv in servers.values():
                srv.stop()
    print(f"# reference: {SDIST} ({binary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
