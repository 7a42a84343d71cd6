"""Chat-template tokenization with an assistant-only loss mask, learned by rendering the template.

Nothing here knows a model family: the text around each turn is found by rendering the tokenizer's
own template with sentinel messages and with growing prefixes of the conversation. An assistant
turn's loss span is what the template adds for that message after the generation prompt: its
content and the end-of-turn marker (the rendered tail after the content, cut after its first special
token, so ChatML's trailing newline is not trained). Templates with `{% generation %}` markers say
the span themselves, and their markers are used as is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jinja2 import TemplateError

from specdistill.data.rejects import RowError

SENTINEL_USER = "\u2063SPECDISTILL_USER_SENTINEL\u2063"
SENTINEL_ASSISTANT = "\u2063SPECDISTILL_ASSISTANT_SENTINEL\u2063"
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class TokenizedChat:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of ones: one run per assistant turn."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


class ChatFormat:
    """What a tokenizer's chat template puts around turns, and tokenization with loss masks."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template; set one on the target")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast tokenizer is needed (character offsets map the loss mask onto tokens)")
        self.tokenizer = tokenizer
        self.has_generation_markers = bool(GENERATION_MARKER.search(tokenizer.chat_template))
        self.special_texts = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special},
                                    key=len, reverse=True)
        self.user_tail = self._tail_after(SENTINEL_USER, [{"role": "user", "content": SENTINEL_USER}])
        self.assistant_tail = self._tail_after(
            SENTINEL_ASSISTANT,
            [{"role": "user", "content": SENTINEL_USER}, {"role": "assistant", "content": SENTINEL_ASSISTANT}],
        )
        self.end_of_turn = self._end_of_turn(self.assistant_tail)

    # ------------------------------------------------------------ learned from the template

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except TemplateError as err:
            raise RowError("template_error", f"the chat template refused the conversation: {err}") from err

    def _tail_after(self, sentinel: str, messages: list[dict]) -> str:
        text = self.render(messages, add_generation_prompt=False)
        return text[text.index(sentinel) + len(sentinel):]

    def _end_of_turn(self, tail: str) -> str:
        """The tail up to and including its first special token (or the tail without trailing space)."""
        hits = [(tail.find(t), t) for t in self.special_texts if t in tail]
        if not hits:
            return tail.rstrip()
        pos, text = min(hits)
        return tail[: pos + len(text)]

    def stop_token_ids(self) -> list[int]:
        """Tokens that end a generated turn: each role's end-of-turn special token and EOS."""
        ids = set()
        for tail in (self.user_tail, self.assistant_tail):
            eot = self.tokenizer.encode(self._end_of_turn(tail), add_special_tokens=False)
            if eot and eot[-1] in self.tokenizer.all_special_ids:
                ids.add(eot[-1])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    def user_prefix_ids(self) -> list[int]:
        """Everything the template renders before a first user message's content (Magpie's prompt)."""
        text = self.render([{"role": "user", "content": SENTINEL_USER}], add_generation_prompt=False)
        return self.tokenizer.encode(text[: text.index(SENTINEL_USER)], add_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation so far plus the assistant generation prompt, as the target sees it."""
        return self.tokenizer.encode(self.render(messages, add_generation_prompt=True), add_special_tokens=False)

    # ------------------------------------------------------------ tokenization with loss masks

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The full rendered text and the character span [start, end) of each assistant turn."""
        text = self.render(messages, add_generation_prompt=False)
        spans, cursor = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1], add_generation_prompt=False)
            start = len(prompt) if upto.startswith(prompt) else _common_prefix_len(prompt, upto)
            if self.assistant_tail and upto.endswith(self.assistant_tail):
                end = len(upto) - len(self.assistant_tail) + len(self.end_of_turn)
            else:
                end = len(upto.rstrip())
            if text.startswith(upto[:end]):
                spans.append((start, end))
            else:  # the template renders earlier turns differently once later ones follow
                found = text.find(upto[start:end], cursor)
                if found < 0:
                    raise RowError("template_mismatch", f"assistant turn {i} is not found in the rendered chat")
                spans.append((found, found + end - start))
            cursor = spans[-1][1]
        return text, spans

    def tokenize(self, messages: list[dict], max_length: int | None = None, overlong: str = "truncate",
                 last_turn_only: bool = False) -> TokenizedChat:
        """Token ids and a 0/1 loss mask over exactly the assistant tokens (content + end of turn)."""
        if not any(m["role"] == "assistant" for m in messages):
            raise RowError("no_assistant_turn", "the conversation has no assistant message")
        if self.has_generation_markers:
            out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        else:
            text, spans = self.assistant_spans(messages)
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            mask = [int(e > s and any(a <= s < b for a, b in spans)) for s, e in enc["offset_mapping"]]
        if last_turn_only:
            runs = mask_runs(mask)
            mask = [0] * len(mask)
            if runs:
                a, b = runs[-1]
                mask[a:b] = [1] * (b - a)
        if not any(mask):
            raise RowError("empty_assistant", "the assistant turns render to no tokens")
        truncated = max_length is not None and len(ids) > max_length
        if truncated:
            if overlong == "drop":
                raise RowError("overlong", f"{len(ids)} tokens > data.max_length={max_length}")
            ids, mask = ids[:max_length], mask[:max_length]
            if not any(mask):
                raise RowError("no_loss_after_truncation",
                               f"no assistant token within the first {max_length} tokens")
        return TokenizedChat(input_ids=ids, loss_mask=mask, truncated=truncated)
