"""The OpenAI-compatible client against a real HTTP server on loopback: answers, server errors that
are retried, slow replies that time out and are retried, requests that are refused, broken replies."""

import base64
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specdistill.config import GenerationConfig
from specdistill.data.openai_client import OpenAIBackend
from specdistill.data.rejects import RejectLog, RowError


class Handler(BaseHTTPRequestHandler):
    calls: Counter = Counter()
    bodies: list = []
    requests: list = []  # (path with its query, Authorization header)

    def log_message(self, *args):
        pass

    def _send(self, code, payload: bytes):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.bodies.append(body)
        Handler.requests.append((self.path, self.headers.get("Authorization")))
        ask = body["messages"][-1]["content"]
        Handler.calls[ask] += 1
        n = Handler.calls[ask]
        if self.path.split("?")[0] != "/v1/chat/completions":
            return self._send(404, b'{"error": "no such route"}')
        if ask == "echo auth":  # a server that quotes the request back in its error
            echo = {"error": "forbidden", "url": f"http://{self.headers['Host']}{self.path}",
                    "headers": {"Authorization": self.headers.get("Authorization")}}
            return self._send(403, json.dumps(echo).encode())
        if ask == "flaky" and n <= 2:
            return self._send(503, b'{"error": "overloaded"}')
        if ask == "slow" and n == 1:
            time.sleep(1.5)
        if ask == "always down":
            return self._send(500, b'{"error": "down"}')
        if ask == "bad request":
            return self._send(400, b'{"error": "context too long"}')
        if ask == "garbage":
            return self._send(200, b"<html>not json</html>")
        reply = {"choices": [{"message": {"role": "assistant", "content": f"answer to {ask} ({len(body['messages'])})"}}]}
        return self._send(200, json.dumps(reply).encode())


@pytest.fixture()
def server():
    Handler.calls, Handler.bodies, Handler.requests = Counter(), [], []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def backend(url, **kw):
    cfg = GenerationConfig(backend="openai", server_url=url, server_model="served", timeout_s=0.5, max_retries=2,
                           retry_backoff_s=0.01, concurrency=4, temperature=0.0, max_new_tokens=7, **kw)
    return OpenAIBackend(cfg, model="ignored")


def ask(text):
    return [{"role": "user", "content": text}]


def test_answers_and_request_fields(server):
    replies = backend(server).reply([ask("a"), ask("b"), [*ask("a"), {"role": "assistant", "content": "x"},
                                                            *ask("c")]])
    assert replies == ["answer to a (1)", "answer to b (1)", "answer to c (3)"]
    body = Handler.bodies[0]
    assert body["model"] == "served" and body["max_tokens"] == 7 and body["temperature"] == 0.0


def test_server_errors_and_slow_replies_are_retried(server):
    assert backend(server).reply([ask("flaky"), ask("slow")]) == ["answer to flaky (1)", "answer to slow (1)"]
    assert Handler.calls["flaky"] == 3 and Handler.calls["slow"] == 2


def test_failures_become_row_errors(server):
    down, refused, garbage = backend(server).reply([ask("always down"), ask("bad request"), ask("garbage")])
    assert isinstance(down, RowError) and down.reason == "server_unavailable" and "3 attempts" in down.detail
    assert Handler.calls["always down"] == 3
    assert isinstance(refused, RowError) and refused.reason == "server_rejected" and "HTTP 400" in refused.detail
    assert Handler.calls["bad request"] == 1  # a refused request is not retried
    assert isinstance(garbage, RowError) and garbage.reason == "bad_server_reply"


def test_unreachable_server(server):
    dead = server.rsplit(":", 1)[0] + ":9/v1"  # the discard port: nothing listens on loopback
    (reply,) = backend(dead).reply([ask("anyone?")])
    assert isinstance(reply, RowError) and reply.reason == "server_unavailable"


def test_credentials_in_the_url_reach_the_server_and_are_never_stored(server, tmp_path):
    """user:password@ becomes basic auth, the query string stays on the request URL (it was cut into the path),
    and neither, nor an Authorization header the server echoes, lands in a reject."""
    url = server.replace("http://", "http://alice:s3cret-pass@") + "?api-key=sk-query-123"
    reply, echoed = backend(url).reply([ask("a"), ask("echo auth")])
    assert reply == "answer to a (1)"
    basic = base64.b64encode(b"alice:s3cret-pass").decode()
    assert Handler.requests[0] == ("/v1/chat/completions?api-key=sk-query-123", f"Basic {basic}")
    assert isinstance(echoed, RowError) and echoed.reason == "server_rejected" and "HTTP 403" in echoed.detail
    rejects = RejectLog()
    rejects.add("chats.jsonl", 0, echoed)
    rejects.write(tmp_path / "rejects.jsonl")
    stored = (tmp_path / "rejects.jsonl").read_text()
    assert "forbidden" in stored and "/v1/chat/completions?api-key=***" in stored
    for secret in ("s3cret-pass", "sk-query-123", basic):
        assert secret not in stored


def test_an_echoed_api_key_is_redacted(server, monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env-98765")
    (echoed,) = backend(server).reply([ask("echo auth")])
    assert Handler.requests[0][1] == "Bearer sk-env-98765"
    assert "sk-env-98765" not in echoed.detail and "forbidden" in echoed.detail
