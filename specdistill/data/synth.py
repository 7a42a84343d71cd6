"""Magpie-style self-synthesis: the target writes a user turn from its bare chat-template prefix, then
answers it, so the data is exactly what the target itself would say.

Questions are sampled (their variety is the data's variety), answers are generated with the
configured generation settings (greedy by default). Empty, too-short and duplicate questions are
rejected; attempts continue until enough unique conversations exist, with a cap on attempts.
Every attempt is cached, so a killed run resumes without generating anything twice.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict

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
    """`synth.num_conversations` unique conversations ({messages, provenance}) and the rejects."""
    prefix_ids = chat.user_prefix_ids()
    params = {"synth": asdict(synth), "temperature": generation.temperature, "top_p": generation.top_p}
    conversations: list[dict] = []
    rejects = RejectLog()
    seen: set[str] = set()
    # An attempt samples a little more questions than needed (for rejects), up to eight batches, and answers
    # them in one continuously batched call (each call ends by draining its batch, so fewer calls waste
    # fewer decode steps); each attempt is one cache entry.
    chunk = 8 * synth.batch_size
    max_attempts = MAX_ATTEMPTS_PER_NEEDED * math.ceil(synth.num_conversations / chunk) + 2
    for attempt in range(max_attempts):
        needed = synth.num_conversations - len(conversations)
        if needed <= 0:
            break
        asked = min(chunk, needed + needed // 8 + 1)
        key = content_key("synth", target_name, params, seed, attempt, asked, needed)
        batch = cache.get(key)
        if batch is None:
            batch = _synth_batch(generator, chat, prefix_ids, synth, generation, target_name, seed, attempt,
                                 asked, needed, seen)
            cache.put(key, batch)
        for kept in batch["conversations"]:
            seen.add(normalized(kept["messages"][0]["content"]))
            conversations.append(kept)
        for rejected in batch["rejects"]:
            rejects.add("synth", rejected["position"], RowError(rejected["reason"], rejected["detail"]))
        log.info("synthesis attempt %d: %d of %d conversations", attempt, len(conversations),
                 synth.num_conversations)
    if len(conversations) < synth.num_conversations:
        log.warning("synthesis stopped after %d attempts with %d of %d conversations (rejects: %s)", max_attempts,
                    len(conversations), synth.num_conversations, rejects.by_reason())
    return conversations, rejects


def _synth_batch(generator, chat, prefix_ids, synth, generation, target_name, seed, attempt, asked, needed,
                 seen) -> dict:
    """One attempt: sample `asked` questions, filter them, answer up to `needed` of them."""
    tokenizer = chat.tokenizer
    questions = generator.generate([prefix_ids] * asked, synth.question_max_tokens,
                                   temperature=synth.question_temperature, top_p=synth.question_top_p,
                                   seed=seed * 1_000_003 + attempt, desc=f"questions {attempt}")
    batch_seen = set(seen)
    accepted, rejects = [], []
    for row, q in enumerate(questions):
        text = tokenizer.decode(q.token_ids, skip_special_tokens=True).strip()
        try:
            check_question(text, synth.min_question_chars, batch_seen)
        except RowError as err:
            rejects.append({"position": f"attempt {attempt} row {row}", "reason": err.reason, "detail": err.detail})
            continue
        batch_seen.add(normalized(text))
        accepted.append((row, text, q.finished))
    accepted = accepted[:needed]
    prompts = [chat.prompt_ids([{"role": "user", "content": text}]) for _, text, _ in accepted]
    answers = generator.generate(prompts, synth.answer_max_tokens, temperature=generation.temperature,
                                 top_p=generation.top_p, seed=seed + attempt, desc=f"answers {attempt}")
    conversations = []
    for (row, text, q_finished), answer in zip(accepted, answers):
        reply = tokenizer.decode(answer.token_ids, skip_special_tokens=True).strip()
        if not reply:
            rejects.append({"position": f"attempt {attempt} row {row}", "reason": "empty_answer",
                            "detail": "the target's answer is empty"})
            continue
        conversations.append({
            "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": reply}],
            "provenance": {"source": "synth", "row": f"attempt {attempt} row {row}", "target": target_name,
                           "question_finished": q_finished, "answer_finished": answer.finished,
                           "question_sampling": {"temperature": synth.question_temperature,
                                                 "top_p": synth.question_top_p,
                                                 "max_tokens": synth.question_max_tokens},
                           "answer_sampling": {"temperature": generation.temperature, "top_p": generation.top_p,
                                               "max_tokens": synth.answer_max_tokens}},
        })
    return {"conversations": conversations, "rejects": rejects}
