"""Document tasks: one of the target's own answers (or several joined) put into a document prompt.

Both data makers use them: self-synthesis over its synthesised answers, and the sources over the answers the
target regenerated. The target then answers each task like any other user turn.
"""

from __future__ import annotations

import itertools
import logging
import random

from specdistill.config import DocumentsConfig

log = logging.getLogger(__name__)


def document_tasks(answers: list[tuple[str, str]], wanted: int, docs: DocumentsConfig,
                   seed: int) -> list[tuple[str, str, dict]]:
    """`wanted` tasks as (position, user text, provenance) from `answers` [(their row's position, text)]: each
    document joins the next count of `docs.parts` (in rotation) of the answers with at least `docs.min_chars`
    characters, drawn in a seeded order, and goes into one of `docs.prompts`. A document is reused (with another
    prompt) only when there are too few, and never twice with the same prompt."""
    long_enough = [(row, text) for row, text in answers if len(text) >= docs.min_chars]
    order = random.Random(seed + 7)
    order.shuffle(long_enough)
    documents, start = [], 0
    for k in itertools.cycle(docs.parts):
        part = long_enough[start : start + k]
        if len(part) < k:
            break
        documents.append(([row for row, _ in part], "\n\n".join(text for _, text in part)))
        start += k
    if not documents:
        log.warning("fewer than data.documents.parts[0]=%d answers have data.documents.min_chars=%d characters: "
                    "no document conversations", docs.parts[0], docs.min_chars)
        return []
    templates = docs.prompts
    if wanted > len(documents) * len(templates):
        log.warning("only %d documents x %d document prompts: %d document conversations instead of %d",
                    len(documents), len(templates), len(documents) * len(templates), wanted)
        wanted = len(documents) * len(templates)
    first_template = [order.randrange(len(templates)) for _ in documents]
    tasks = []
    for i in range(wanted):
        d, reuse = i % len(documents), i // len(documents)
        rows, document = documents[d]
        template = templates[(first_template[d] + reuse) % len(templates)]
        tasks.append((f"document {i}", template.replace("{document}", document),
                      {"document_of": rows, "document_prompt": template}))
    return tasks


def documents_wanted(docs: DocumentsConfig, others: int) -> int:
    """How many document tasks join `others` conversations so that they are `docs.share` of all."""
    return round(others * docs.share / (1 - docs.share))


def answers_needed(docs: DocumentsConfig, wanted: int) -> int:
    """Answers enough for `wanted` documents, each used once."""
    rotation = list(itertools.islice(itertools.cycle(docs.parts), wanted))
    return sum(rotation)
