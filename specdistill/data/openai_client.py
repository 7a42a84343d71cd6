"""Regeneration through any OpenAI-compatible chat server (vLLM or SGLang `serve`, ...).

Requests run `concurrency` at a time; each has a timeout, and connection errors, timeouts, HTTP 408,
429 and 5xx are retried with exponential backoff. Other HTTP errors and malformed replies are not
retried: they say something about the request, so the row is rejected with the server's message.
An API key, if needed, is read from OPENAI_API_KEY, or from the server URL (`https://user:key@host/v1`, sent as
HTTP basic auth, or a `?api-key=...` query, kept on the request URL); neither is ever logged or stored: every
URL and server message is redacted first.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from tqdm.auto import tqdm

from specdistill.config import GenerationConfig
from specdistill.data.rejects import RowError
from specdistill.redact import redact_text, redact_url

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 429}


class OpenAIBackend:
    """`reply(conversations)`: the server's assistant reply to each conversation, or a RowError."""

    def __init__(self, generation: GenerationConfig, model: str):
        if not generation.server_url:
            raise ValueError("config field `data.generation.server_url` is required for backend=openai")
        self.url, self.basic_auth = chat_completions_url(generation.server_url)
        self.shown_url = redact_url(self.url)  # the only form of the URL that is logged or stored
        self.model = generation.server_model or model
        self.generation = generation
        self.api_key = os.environ.get("OPENAI_API_KEY")
        query = urlsplit(generation.server_url).query
        self.secrets = (self.api_key, self.basic_auth, *(value for _, value in parse_qsl(query)))

    def reply(self, conversations: list[list[dict]], desc: str = "regenerate") -> list[str | RowError]:
        with ThreadPoolExecutor(max_workers=self.generation.concurrency) as pool:
            return list(tqdm(pool.map(self._complete, conversations), total=len(conversations), desc=desc,
                             unit="req", leave=False))

    def _request(self, messages: list[dict]) -> str:
        g = self.generation
        body = json.dumps({"model": self.model, "messages": messages, "temperature": g.temperature,
                           "top_p": g.top_p, "max_tokens": g.max_new_tokens}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        elif self.basic_auth:
            headers["Authorization"] = f"Basic {self.basic_auth}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=g.timeout_s) as response:
            payload = response.read()
        try:
            content = json.loads(payload)["choices"][0]["message"]["content"]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
            raise RowError("bad_server_reply", self._redacted(f"{self.shown_url} replied {payload[:200]!r}: {err}")) from err
        if not isinstance(content, str):
            raise RowError("bad_server_reply", f"{self.shown_url} replied content of type {type(content).__name__}")
        return content

    def _complete(self, messages: list[dict]) -> str | RowError:
        g = self.generation
        last = ""
        for attempt in range(g.max_retries + 1):
            try:
                return self._request(messages)
            except RowError as err:
                return err
            except urllib.error.HTTPError as err:
                detail = self._redacted(err.read()[:200].decode(errors="replace"))
                if err.code not in RETRY_STATUS and err.code < 500:
                    return RowError("server_rejected", f"{self.shown_url}: HTTP {err.code}: {detail}")
                last = f"HTTP {err.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                last = self._redacted(f"{type(err).__name__}: {err}")
            if attempt < g.max_retries:
                delay = g.retry_backoff_s * 2**attempt
                log.debug("request to %s failed (%s); retry %d in %.1fs", self.shown_url, last, attempt + 1, delay)
                time.sleep(delay)
        return RowError("server_unavailable", f"{self.shown_url}: {g.max_retries + 1} attempts failed; last: {last}")

    def _redacted(self, text: str) -> str:
        """A server's message without this client's key, URL credentials or an echoed Authorization header."""
        return redact_text(text, self.secrets)


def chat_completions_url(server_url: str) -> tuple[str, str | None]:
    """(`<server_url>/chat/completions` with the query string kept and the user:password taken out, that
    user:password base64-encoded for HTTP basic auth or None)."""
    parts = urlsplit(server_url)
    credentials = None
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        credentials = base64.b64encode(unquote(userinfo).encode()).decode()
    path = parts.path.rstrip("/") + "/chat/completions"
    return urlunsplit((parts.scheme, netloc, path, parts.query, parts.fragment)), credentials
