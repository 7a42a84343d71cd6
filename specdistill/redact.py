"""Secrets kept out of everything stored or logged (config.json, W&B, rejects.jsonl, logs).

A server URL may carry a key (`https://user:key@host/v1`, `...?api-key=...`) and a server's error body may
echo the request's Authorization header; both are rewritten here before they are written anywhere.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit, urlunsplit

HIDDEN = "***"
URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
# a header or field that carries a credential: its value (an optional scheme word, then one token) is hidden
AUTH_HEADER = re.compile(r"(?i)\b(authorization|proxy-authorization|x-api-key|api[-_]key)(['\"]?\s*[:=]\s*['\"]?)"
                         r"(?:[A-Za-z]+ +)?[^\s'\",;&}]+")
# a bearer token outside a header line (with a digit, so that prose such as "Bearer bonds" stays)
AUTH_SCHEME = re.compile(r"\b(Bearer) +(?=[A-Za-z._~+/=-]*[0-9])[A-Za-z0-9._~+/=-]{8,}")


def redact_url(url: str) -> str:
    """`url` with its user:password and every query value hidden (the host, path and query keys stay readable)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{HIDDEN}@{netloc.rsplit('@', 1)[1]}"
    query = "&".join(f"{key}={HIDDEN}" for key, _ in parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_urls(text: str) -> str:
    """`text` with every URL in it redacted (`redact_url`), the rest untouched."""
    return URL.sub(lambda m: redact_url(m.group(0)), text)


def redact_text(text: str, secrets: tuple[str | None, ...] = ()) -> str:
    """`text` (a server's or a library's message) with the given secret values, URL credentials and
    authorization headers or tokens hidden."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, HIDDEN)
    text = redact_urls(text)
    text = AUTH_HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}{HIDDEN}", text)
    return AUTH_SCHEME.sub(lambda m: f"{m.group(1)} {HIDDEN}", text)


SECRET_FIELD = re.compile(r"(^|_)(token|api_key|key|secret|password)$", re.IGNORECASE)


def scrub_secrets(node):
    """A copy with every secret-looking field (`hf_token`, `api_key`, ...) blanked and every URL's
    user:password and query values hidden (`data.generation.server_url` may carry a key)."""
    if isinstance(node, dict):
        return {k: (HIDDEN if SECRET_FIELD.search(str(k)) and v else scrub_secrets(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [scrub_secrets(v) for v in node]
    if isinstance(node, str):
        return redact_urls(node)
    return node


def redacted(cfg) -> dict:
    """The config (a RunConfig) as a plain dict, secrets blanked: what is saved in the run dir and sent to W&B."""
    from omegaconf import OmegaConf

    return scrub_secrets(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
