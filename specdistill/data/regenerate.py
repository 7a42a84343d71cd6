"""Regeneration: the target rewrites every assistant turn, turn by turn, seeing its own earlier answers.

User (and leading system) messages are kept; the original assistant messages are dropped. Rows are
processed in chunks; within a chunk, turn k of every row is generated in one batched call, then turn
k + 1 with those answers in the context. A finished row goes into the conversation cache under a
hash of its source messages, the sampling settings and the target, so a restarted run skips it.
With torch.distributed initialised, rank r takes rows r, r + world, ... (by source order), so ranks
never overlap and together cover every row. With the vLLM backend every rank starts an engine of its own: one
per GPU on a GPU node, while on a CPU the engines share (and fight over) the same cores.
"""

from __future__ import annotations

import logging
from typing import Protocol

from specdistill.cache import ResultCache, content_key
from specdistill.config import GenerationConfig
from specdistill.data.generate import LocalGenerator
from specdistill.data.rejects import RejectLog, RowError
from specdistill.data.sources import SourceRow
from specdistill.data.template import ChatFormat
from specdistill.data.vllm_generate import VllmGenerator

log = logging.getLogger(__name__)


class Backend(Protocol):
    def reply(self, conversations: list[list[dict]], desc: str = ...) -> list[str | RowError]: ...


class LocalBackend:
    """Replies from the target on this machine, batched through `LocalGenerator` (our decode loop) or
    `VllmGenerator` (vLLM's offline engine): either way the prompts are our chat template's token ids and the
    answers are decoded by our tokenizer. A prompt of `max_prompt_tokens` or more is rejected before generation:
    it leaves no room for an answer in the samples, and one huge prompt in a batch would take the memory of the
    whole job."""

    def __init__(self, generator: LocalGenerator | VllmGenerator, chat: ChatFormat, generation: GenerationConfig,
                 seed: int, max_prompt_tokens: int | None = None):
        self.generator, self.chat, self.generation, self.seed = generator, chat, generation, seed
        self.max_prompt_tokens = max_prompt_tokens

    def reply(self, conversations: list[list[dict]], desc: str = "regenerate") -> list[str | RowError]:
        prompts, results = [], []
        for messages in conversations:
            try:
                ids = self.chat.prompt_ids(messages)
                if self.max_prompt_tokens is not None and len(ids) >= self.max_prompt_tokens:
                    raise RowError("overlong_prompt", f"the prompt has {len(ids)} tokens, no room for an answer "
                                                      f"within data.max_length={self.max_prompt_tokens}")
                prompts.append(ids)
                results.append(None)
            except RowError as err:
                results.append(err)
        g = self.generation
        outs = iter(self.generator.generate(prompts, g.max_new_tokens, g.temperature, g.top_p, self.seed, desc))
        tokenizer = self.chat.tokenizer
        return [r if r is not None else tokenizer.decode(next(outs).token_ids, skip_special_tokens=True).strip()
                for r in results]


def sampling_params(generation: GenerationConfig, backend: str) -> dict:
    return {"backend": backend, "temperature": generation.temperature, "top_p": generation.top_p,
            "max_new_tokens": generation.max_new_tokens}


def row_key(messages: list[dict], params: dict, target_name: str) -> str:
    return content_key("regenerate", messages, params, target_name)


def user_turns(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """(leading system messages, user messages) of a conversation."""
    system = []
    for m in messages:
        if m["role"] != "system":
            break
        system.append(m)
    return system, [m for m in messages if m["role"] == "user"]


def regenerate_rows(rows: list[SourceRow], backend: Backend, cache: ResultCache, params: dict,
                    target_name: str, chunk_rows: int, rank: int = 0, world: int = 1) -> RejectLog:
    """Regenerate this rank's share of `rows` that the cache lacks; returns the rows that failed."""
    mine = [r for i, r in enumerate(rows) if i % world == rank]
    todo = [r for r in mine if row_key(r.row["messages"], params, target_name) not in cache]
    log.info("regeneration (rank %d/%d): %d rows, %d cached, %d to generate", rank, world, len(mine),
             len(mine) - len(todo), len(todo))
    rejects = RejectLog()
    for start in range(0, len(todo), chunk_rows):
        chunk = todo[start: start + chunk_rows]
        starts, asks = zip(*(user_turns(r.row["messages"]) for r in chunk))
        conversations = [list(s) for s in starts]
        failed: dict[int, RowError] = {}
        for turn in range(max(len(a) for a in asks)):
            active = [i for i in range(len(chunk)) if turn < len(asks[i]) and i not in failed]
            replies = backend.reply([conversations[i] + [asks[i][turn]] for i in active],
                                    desc=f"regenerate turn {turn + 1}")
            for i, reply in zip(active, replies):
                if isinstance(reply, RowError):
                    failed[i] = reply
                elif not reply:
                    failed[i] = RowError("empty_answer", f"the regenerated answer to user turn {turn} is empty")
                else:
                    conversations[i] += [asks[i][turn], {"role": "assistant", "content": reply}]
        for i, row in enumerate(chunk):
            if i in failed:
                rejects.add(row.source, row.position, failed[i])
            else:
                cache.put(row_key(row.row["messages"], params, target_name), {"messages": conversations[i]})
        log.info("regenerated %d of %d rows", min(start + chunk_rows, len(todo)), len(todo))
    return rejects
