"""Magpie-style self-synthesis: the target writes a user turn from its bare chat-template prefix, then
answers it, so the data is exactly what the target itself would say.

Questions are sampled (their variety is the data's variety), each continuing one of the configured
openers ("" is free Magpie; "Translate", "Solve" or "Write a Python function" steer it toward a task).
Answers are generated with the configured generation settings (greedy by default), by our decode loop or by vLLM
(`data.generation.backend`; the engine samples questions with its own random draws). Empty, too-short
and duplicate questions are rejected; attempts continue until enough unique conversations exist, with
a cap on attempts. A share of the conversations then works over a document: one of the target's own
long answers, placed in a document prompt (summarise, rewrite, translate, answer from it), so the
head also learns the copying from context that summarisation and retrieval workloads are made of.
Optionally, some of its translations into another language come back to be translated again (back
translations), so prompts also hold foreign text, as translation workloads do.
Every batch is cached, so a killed run resumes without generating anything twice, and a run that asks
for more conversations than an earlier one reuses every question and answer it made: where the earlier
run needed only the first questions of an attempt, only the rest are answered (the document tasks are
drawn anew from the larger pool of answers).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import re
from dataclasses import asdict, dataclass, field

from specdistill.cache import ResultCache, content_key
from specdistill.config import DocumentsConfig, GenerationConfig, SynthConfig
from specdistill.data.documents import document_tasks
from specdistill.data.generate import LocalGenerator
from specdistill.data.rejects import RejectLog, RowError
from specdistill.data.template import ChatFormat
from specdistill.data.vllm_generate import VllmGenerator

log = logging.getLogger(__name__)

MAX_ATTEMPTS_PER_NEEDED = 4  # cap: at most 4x the attempts that would do without any reject, plus 2
# Settings that decide only how many conversations are made or which texts are answered (which the batches'
# keys hold): they stay out of the cache keys, so a grown data set reuses every batch a smaller one made.
COUNT_OR_TEXT_SETTINGS = ("num_conversations", "back_translation")


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


def synthesize(generator: LocalGenerator | VllmGenerator, chat: ChatFormat, synth: SynthConfig, documents: DocumentsConfig,
               generation: GenerationConfig, cache: ResultCache, target_name: str,
               seed: int) -> tuple[list[dict], RejectLog]:
    """`synth.num_conversations` conversations ({messages, provenance}), unique by question, and the rejects."""
    run = _Synthesis(generator, chat, synth, documents, generation, cache, target_name, seed)
    num_documents = round(synth.num_conversations * documents.share)
    conversations = run.question_conversations(synth.num_conversations - num_documents)
    if num_documents:
        documents = run.document_conversations(conversations, num_documents)
        conversations += documents + run.back_translation_conversations(documents)
    return conversations, run.rejects


@dataclass
class _Synthesis:
    """What every synthesis step shares: the generator, the formats and settings, the cache and the rejects."""

    generator: LocalGenerator | VllmGenerator  # our decode loop or the engine's (data.generation.backend)
    chat: ChatFormat
    synth: SynthConfig
    documents: DocumentsConfig
    generation: GenerationConfig
    cache: ResultCache
    target_name: str
    seed: int
    rejects: RejectLog = field(default_factory=RejectLog)

    @property
    def params(self) -> dict:
        """The settings that change what a batch generates from its inputs (part of every cache key)."""
        g = self.generation
        synth = {k: v for k, v in asdict(self.synth).items() if not k.startswith(COUNT_OR_TEXT_SETTINGS)}
        return {"synth": synth, "temperature": g.temperature, "top_p": g.top_p, "backend": g.backend}

    def question_conversations(self, wanted: int) -> list[dict]:
        conversations: list[dict] = []
        seen: set[str] = set()
        # An attempt samples eight batches of questions and answers the new ones still needed in one
        # continuously batched call (each call ends by draining its batch, so fewer calls waste fewer decode
        # steps). Questions and answers are cached by attempt (`_answer_attempt`).
        chunk = 8 * self.synth.batch_size
        max_attempts = MAX_ATTEMPTS_PER_NEEDED * math.ceil(wanted / chunk) + 2
        for attempt in range(max_attempts):
            needed = wanted - len(conversations)
            if needed <= 0:
                break
            items = self._new_questions(attempt, chunk, needed, seen)
            seen.update(normalized(text) for _, text, _ in items)
            conversations += self._answer_attempt(attempt, items)
            log.info("synthesis attempt %d: %d of %d conversations", attempt, len(conversations), wanted)
        if len(conversations) < wanted:
            log.warning("synthesis stopped after %d attempts with %d of %d conversations (rejects: %s)",
                        max_attempts, len(conversations), wanted, self.rejects.by_reason())
        return conversations

    def document_conversations(self, conversations: list[dict], wanted: int) -> list[dict]:
        """`wanted` conversations over documents made of the answers among `conversations` (`document_tasks`)."""
        answers = [(c["provenance"]["row"], c["messages"][1]["content"]) for c in conversations]
        return self._answer_all("documents", document_tasks(answers, wanted, self.documents, self.seed))

    def back_translation_conversations(self, documents: list[dict]) -> list[dict]:
        """`synth.back_translations` conversations, each the answer of one `back_translation_source` document
        task (the target's own translation) put in `back_translation_prompt`."""
        synth = self.synth
        if not synth.back_translations:
            return []
        sources = [c for c in documents if c["provenance"]["document_prompt"] == synth.back_translation_source]
        if len(sources) < synth.back_translations:
            log.warning("only %d document tasks asked %r: %d back translations instead of %d (raise "
                        "data.documents.share)", len(sources), synth.back_translation_source[:40], len(sources),
                        synth.back_translations)
        prompt = synth.back_translation_prompt
        items = [(f"back translation {i}", prompt.replace("{document}", c["messages"][1]["content"]),
                  {"back_translation_of": c["provenance"]["row"], "back_translation_prompt": prompt})
                 for i, c in enumerate(sources[: synth.back_translations])]
        return self._answer_all("back-translations", items)

    def _answer_all(self, kind: str, items: list[tuple[str, str, dict]]) -> list[dict]:
        """The target answers the items in cached chunks of eight batches; the key holds the chunk's texts."""
        out: list[dict] = []
        chunk = 8 * self.synth.batch_size
        for start in range(0, len(items), chunk):
            out += self._answer_cached(kind, items[start : start + chunk], self.seed + start,
                                       f"{kind} {start // chunk}")
            log.info("%s: %d of %d conversations", kind, len(out), len(items))
        return out

    def _answer_cached(self, kind: str, items: list[tuple[str, str, dict]], seed: int, desc: str) -> list[dict]:
        """`_answer(items)`'s conversations, from the cache where these texts were answered before; the
        rejects join `self.rejects`."""
        key = content_key(f"synth-{kind}", self.target_name, self.params, self.seed, seed,
                          [text for _, text, _ in items])
        batch = self.cache.get(key)
        if batch is None:
            batch = self._answer(items, seed, desc)
            self.cache.put(key, batch)
        self._add_rejects(batch["rejects"])
        return batch["conversations"]

    def _answer_attempt(self, attempt: int, items: list[tuple[str, str, dict]]) -> list[dict]:
        """The conversations of an attempt's accepted questions, in order. The answers are cached in parts,
        each holding its question texts: a run that needs more of an attempt than an earlier run answered
        reads the earlier parts and answers only the rest, as one more part."""
        texts = [text for _, text, _ in items]
        parts, answered = [], 0
        for part in itertools.count():
            if answered >= len(texts):
                break
            key = content_key("synth-attempt-answers", self.target_name, self.params, self.seed, attempt, part)
            cached = self.cache.get(key)
            overlap = 0 if cached is None else min(len(cached["texts"]), len(texts) - answered)
            if cached is None or cached["texts"][:overlap] != texts[answered : answered + overlap]:
                break
            parts.append(cached)
            answered += len(cached["texts"])
        if answered < len(texts):
            fresh = {"texts": texts[answered:], **self._answer(items[answered:], self.seed + attempt,
                                                               f"answers {attempt}")}
            self.cache.put(key, fresh)
            parts.append(fresh)
        positions = {position for position, _, _ in items}  # a larger earlier run answered more of the attempt
        self._add_rejects([r for part in parts for r in part["rejects"] if r["position"] in positions])
        return [c for part in parts for c in part["conversations"] if c["provenance"]["row"] in positions]

    def _add_rejects(self, rejected: list[dict]) -> None:
        for r in rejected:
            self.rejects.add("synth", r["position"], RowError(r["reason"], r["detail"]))

    def _new_questions(self, attempt: int, asked: int, needed: int, seen: set[str]) -> list[tuple[str, str, dict]]:
        """Up to `needed` of the attempt's `asked` sampled questions (cached) as (position, text, provenance),
        in order; the empty, short and already seen ones before them go to the rejects."""
        synth = self.synth
        key = content_key("synth-questions", self.target_name, self.params, self.seed, attempt, asked)
        sampled = self.cache.get(key)
        if sampled is None:
            sampled = self._sample_questions(attempt, asked)
            self.cache.put(key, sampled)
        batch_seen = set(seen)
        accepted = []
        for row, q in enumerate(sampled["questions"]):
            if len(accepted) == needed:
                break
            position = f"attempt {attempt} row {row}"
            try:
                check_question(q["text"], synth.min_question_chars, batch_seen)
            except RowError as err:
                self.rejects.add("synth", position, err)
                continue
            batch_seen.add(normalized(q["text"]))
            accepted.append((position, q["text"],
                             {"opener": q["opener"], "question_finished": q["finished"],
                              "question_sampling": {"temperature": synth.question_temperature,
                                                    "top_p": synth.question_top_p,
                                                    "max_tokens": synth.question_max_tokens}}))
        return accepted

    def _sample_questions(self, attempt: int, asked: int) -> dict:
        """`asked` user turns the target writes after the template's user prefix and a drawn opener."""
        synth, tokenizer = self.synth, self.chat.tokenizer
        pick = random.Random(self.seed * 1_000_003 + attempt)
        openers = [pick.choice(synth.openers).strip() for _ in range(asked)]
        prefix_ids = self.chat.user_prefix_ids()
        prompts = [prefix_ids + (tokenizer.encode(o, add_special_tokens=False) if o else []) for o in openers]
        questions = self.generator.generate(prompts, synth.question_max_tokens,
                                            temperature=synth.question_temperature, top_p=synth.question_top_p,
                                            seed=self.seed * 1_000_003 + attempt, desc=f"questions {attempt}")
        return {"questions": [{"opener": opener, "finished": q.finished,
                               "text": (opener + tokenizer.decode(q.token_ids, skip_special_tokens=True)).strip()}
                              for opener, q in zip(openers, questions)]}

    def _answer(self, items: list[tuple[str, str, dict]], seed: int, desc: str) -> dict:
        """The target answers each (position, user text, provenance) item; empty answers are rejects."""
        g, tokenizer = self.generation, self.chat.tokenizer
        prompts = [self.chat.prompt_ids([{"role": "user", "content": text}]) for _, text, _ in items]
        answers = self.generator.generate(prompts, self.synth.answer_max_tokens, temperature=g.temperature,
                                          top_p=g.top_p, seed=seed, desc=desc)
        conversations, rejects = [], []
        for (position, text, provenance), answer in zip(items, answers):
            reply = tokenizer.decode(answer.token_ids, skip_special_tokens=True).strip()
            if not reply:
                rejects.append({"position": position, "reason": "empty_answer",
                                "detail": "the target's answer is empty"})
                continue
            conversations.append({
                "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": reply}],
                "provenance": {"source": "synth", "row": position, "target": self.target_name, **provenance,
                               "answer_finished": answer.finished,
                               "answer_sampling": {"temperature": g.temperature, "top_p": g.top_p,
                                                   "max_tokens": self.synth.answer_max_tokens}},
            })
        return {"conversations": conversations, "rejects": rejects}
