"""Magpie-style self-synthesis: the target writes a user turn from its bare chat-template prefix, then
answers it, so the data is exactly what the target itself would say.

Questions are sampled (their variety is the data's variety), each continuing one of the configured
openers ("" is free Magpie; "Translate", "Solve" or "Write a Python function" steer it toward a task).
Answers are generated with the configured generation settings (greedy by default). Empty, too-short
and duplicate questions are rejected; attempts continue until enough unique conversations exist, with
a cap on attempts. A share of the conversations then works over a document: one of the target's own
long answers, placed in a document prompt (summarise, rewrite, translate, answer from it), so the
head also learns the copying from context that summarisation and retrieval workloads are made of.
Every batch is cached, so a killed run resumes without generating anything twice.
"""

from __future__ import annotations

import logging
import math
import random
import re
from dataclasses import asdict
from functools import partial

from specdistill.config import GenerationConfig, SynthConfig
from specdistill.data.cache import ConversationCache, content_key
from specdistill.data.generate import LocalGenerator
from specdistill.data.rejects import RejectLog, RowError
from specdistill.data.template import ChatFormat

log = logging.getLogger(__name__)

MAX_ATTEMPTS_PER_NEEDED = 4  # cap: at most 4x the attempts that would do without any reject, plus 2


def normalized(text: str) -> str:
    """Lower-cased words only: near-identical questions count as duplicates."""
    return " ".join(re.findall(r"\w+", text.lower()))


def check_question(question: str, min_chars: int, seen: set[str]) -> None:
    if not question:
        raise RowError("empty_question", "the sampled user turn is empty")
    if len(question) < min_chars:
        raise RowError("short_question", f"{len(question)} chars < data.synth.min_question_chars={min_chars}")
    if normalized(question) in seen:
        raise RowError("duplicate_question", f"already have {question[:80]!r}")


def synthesize(generator: LocalGenerator, chat: ChatFormat, synth: SynthConfig, generation: GenerationConfig,
               cache: ConversationCache, target_name: str, seed: int) -> tuple[list[dict], RejectLog]:
    """`synth.num_conversations` conversations ({messages, provenance}), unique by question, and the rejects."""
    num_documents = round(synth.num_conversations * synth.document_share)
    params = {"synth": asdict(synth), "temperature": generation.temperature, "top_p": generation.top_p}
    rejects = RejectLog()
    conversations = _question_conversations(generator, chat, synth, generation, cache, target_name, seed,
                                            synth.num_conversations - num_documents, params, rejects)
    if num_documents:
        conversations += _document_conversations(generator, chat, synth, generation, cache, target_name, seed,
                                                 conversations, num_documents, params, rejects)
    return conversations, rejects


def _question_conversations(generator, chat, synth, generation, cache, target_name, seed, wanted, params,
                            rejects) -> list[dict]:
    prefix_ids = chat.user_prefix_ids()
    conversations: list[dict] = []
    seen: set[str] = set()
    # An attempt samples a little more questions than needed (for rejects), up to eight batches, and answers
    # them in one continuously batched call (each call ends by draining its batch, so fewer calls waste
    # fewer decode steps); each attempt is one cache entry.
    chunk = 8 * synth.batch_size
    max_attempts = MAX_ATTEMPTS_PER_NEEDED * math.ceil(wanted / chunk) + 2
    for attempt in range(max_attempts):
        needed = wanted - len(conversations)
        if needed <= 0:
            break
        asked = min(chunk, needed + needed // 8 + 1)
        key = content_key("synth", target_name, params, seed, attempt, asked, needed)
        batch = _cached(cache, key, rejects, partial(_synth_batch, generator, chat, prefix_ids, synth, generation,
                                                     target_name, seed, attempt, asked, needed, seen))
        for kept in batch:
            seen.add(normalized(kept["messages"][0]["content"]))
            conversations.append(kept)
        log.info("synthesis attempt %d: %d of %d conversations", attempt, len(conversations), wanted)
    if len(conversations) < wanted:
        log.warning("synthesis stopped after %d attempts with %d of %d conversations (rejects: %s)", max_attempts,
                    len(conversations), wanted, rejects.by_reason())
    return conversations


def _cached(cache: ConversationCache, key: str, rejects: RejectLog, make) -> list[dict]:
    """A batch's conversations, made by `make() -> {conversations, rejects}` unless already cached; its
    rejects are added to `rejects`."""
    batch = cache.get(key)
    if batch is None:
        batch = make()
        cache.put(key, batch)
    for rejected in batch["rejects"]:
        rejects.add("synth", rejected["position"], RowError(rejected["reason"], rejected["detail"]))
    return batch["conversations"]


def _synth_batch(generator, chat, prefix_ids, synth, generation, target_name, seed, attempt, asked, needed,
                 seen) -> dict:
    """One attempt: sample `asked` questions, filter them, answer up to `needed` of them."""
    tokenizer = chat.tokenizer
    pick = random.Random(seed * 1_000_003 + attempt)
    openers = [pick.choice(synth.openers).strip() for _ in range(asked)]
    prompts = [prefix_ids + (tokenizer.encode(o, add_special_tokens=False) if o else []) for o in openers]
    questions = generator.generate(prompts, synth.question_max_tokens, temperature=synth.question_temperature,
                                   top_p=synth.question_top_p, seed=seed * 1_000_003 + attempt,
                                   desc=f"questions {attempt}")
    batch_seen = set(seen)
    accepted, rejects = [], []
    for row, (opener, q) in enumerate(zip(openers, questions)):
        text = (opener + tokenizer.decode(q.token_ids, skip_special_tokens=True)).strip()
        try:
            check_question(text, synth.min_question_chars, batch_seen)
        except RowError as err:
            rejects.append({"position": f"attempt {attempt} row {row}", "reason": err.reason, "detail": err.detail})
            continue
        batch_seen.add(normalized(text))
        accepted.append((f"attempt {attempt} row {row}", text,
                         {"opener": opener, "question_finished": q.finished,
                          "question_sampling": {"temperature": synth.question_temperature,
                                                "top_p": synth.question_top_p,
                                                "max_tokens": synth.question_max_tokens}}))
    answered = _answer(generator, chat, synth, generation, target_name, seed + attempt, accepted[:needed],
                       f"answers {attempt}")
    return {"conversations": answered["conversations"], "rejects": rejects + answered["rejects"]}


def _document_conversations(generator, chat, synth, generation, cache, target_name, seed, conversations, wanted,
                            params, rejects) -> list[dict]:
    """`wanted` conversations over documents: the long answers among `conversations`, each in a document
    prompt. Pairs are drawn in a seeded order; a document is reused (with another prompt) only when there
    are too few, and never twice with the same prompt."""
    documents = [(c["provenance"]["row"], c["messages"][1]["content"]) for c in conversations
                 if len(c["messages"][1]["content"]) >= synth.document_min_chars]
    if not documents:
        log.warning("no answer has data.synth.document_min_chars=%d characters: no document conversations",
                    synth.document_min_chars)
        return []
    templates = synth.document_prompts
    if wanted > len(documents) * len(templates):
        log.warning("only %d documents x %d document prompts: %d document conversations instead of %d",
                    len(documents), len(templates), len(documents) * len(templates), wanted)
        wanted = len(documents) * len(templates)
    order = random.Random(seed + 7)
    order.shuffle(documents)
    first_template = [order.randrange(len(templates)) for _ in documents]
    items = []
    for i in range(wanted):
        d, reuse = i % len(documents), i // len(documents)
        source_row, document = documents[d]
        template = templates[(first_template[d] + reuse) % len(templates)]
        items.append((f"document {i}", template.replace("{document}", document),
                      {"document_of": source_row, "document_prompt": template}))
    out: list[dict] = []
    chunk = 8 * synth.batch_size
    for start in range(0, wanted, chunk):
        part = items[start : start + chunk]
        key = content_key("synth-documents", target_name, params, seed, [text for _, text, _ in part])
        out += _cached(cache, key, rejects, partial(_answer, generator, chat, synth, generation, target_name,
                                                    seed + start, part, f"documents {start // chunk}"))
        log.info("document tasks: %d of %d conversations", len(out), wanted)
    return out


def _answer(generator, chat, synth, generation, target_name, seed, items, desc) -> dict:
    """The target answers each (position, user text, provenance) item; empty answers are rejects."""
    tokenizer = chat.tokenizer
    prompts = [chat.prompt_ids([{"role": "user", "content": text}]) for _, text, _ in items]
    answers = generator.generate(prompts, synth.answer_max_tokens, temperature=generation.temperature,
                                 top_p=generation.top_p, seed=seed, desc=desc)
    conversations, rejects = [], []
    for (position, text, provenance), answer in zip(items, answers):
        reply = tokenizer.decode(answer.token_ids, skip_special_tokens=True).strip()
        if not reply:
            rejects.append({"position": position, "reason": "empty_answer", "detail": "the target's answer is empty"})
            continue
        conversations.append({
            "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": reply}],
            "provenance": {"source": "synth", "row": position, "target": target_name, **provenance,
                           "answer_finished": answer.finished,
                           "answer_sampling": {"temperature": generation.temperature, "top_p": generation.top_p,
                                               "max_tokens": synth.answer_max_tokens}},
        })
    return {"conversations": conversations, "rejects": rejects}
