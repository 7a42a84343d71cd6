"""Loss masks token by token for each template family; expected masks are built by hand from the text
segments the template must produce, with a byte-level tokenizer (one token per byte, specials whole)."""

import pytest

from specdistill.data.rejects import RowError
from specdistill.data.template import ChatFormat
from specdistill.target import CHATML_TEMPLATE, byte_tokenizer

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SYSTEM_DEFAULT_TEMPLATE = (  # SmolLM2's: a default system prompt when the chat has none
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok?"}, {"role": "assistant", "content": "sure"}]


def tokenizer_with(template, specials=(), bos=None):
    tok = byte_tokenizer()
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    if bos:
        tok.bos_token = bos
    tok.chat_template = template
    return tok


def expected(tok, segments):
    """Concatenate (text, trained) segments: ids of each segment, mask 1 where trained."""
    ids, mask = [], []
    for text, trained in segments:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [int(trained)] * len(piece)
    return ids, mask


def check(tok, messages, segments, **kwargs):
    out = ChatFormat(tok).tokenize(messages, **kwargs)
    ids, mask = expected(tok, segments)
    assert out.input_ids == ids
    assert out.loss_mask == mask
    return out


def test_chatml_two_turns():
    tok = tokenizer_with(CHATML_TEMPLATE)
    out = check(tok, CHAT, [
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0), ("yo<|im_end|>", 1),
        ("\n<|im_start|>user\nok?<|im_end|>\n<|im_start|>assistant\n", 0), ("sure<|im_end|>", 1), ("\n", 0),
    ])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    # Literally: 'y', 'o', <|im_end|> are the first trained tokens, the newline after them is not.
    first = out.loss_mask.index(1)
    assert out.input_ids[first + 2] == im_end and out.loss_mask[first: first + 4] == [1, 1, 1, 0]
    assert sum(out.loss_mask) == 3 + 5


def test_llama3_trims_content_and_trains_eot():
    tok = tokenizer_with(LLAMA3_TEMPLATE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                           "<|eot_id|>"], bos="<|begin_of_text|>")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "  yo \n"}, {"role": "user", "content": "more"},
                {"role": "assistant", "content": "ok"}]
    check(tok, messages, [
        ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
         "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("yo<|eot_id|>", 1),
        ("<|start_header_id|>user<|end_header_id|>\n\nmore<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("ok<|eot_id|>", 1),
    ])
    assert ChatFormat(tok).end_of_turn == "<|eot_id|>"


def test_default_system_prompt_is_not_trained_and_starts_the_magpie_prefix():
    tok = tokenizer_with(SYSTEM_DEFAULT_TEMPLATE)
    check(tok, CHAT[:2], [
        ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("yo<|im_end|>", 1), ("\n", 0),
    ])
    chat = ChatFormat(tok)
    assert tok.decode(chat.user_prefix_ids()) == "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n"
    assert chat.stop_token_ids() == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_generation_markers_decide_the_mask():
    tok = tokenizer_with(GENERATION_TEMPLATE)
    assert ChatFormat(tok).has_generation_markers
    check(tok, CHAT, [
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0), ("yo<|im_end|>", 1),
        ("\n<|im_start|>user\nok?<|im_end|>\n<|im_start|>assistant\n", 0), ("sure<|im_end|>", 1), ("\n", 0),
    ])


def test_multibyte_content_is_fully_trained():
    tok = tokenizer_with(CHATML_TEMPLATE)
    check(tok, [{"role": "user", "content": "é?"}, {"role": "assistant", "content": "日本"}], [
        ("<|im_start|>user\né?<|im_end|>\n<|im_start|>assistant\n", 0), ("日本<|im_end|>", 1), ("\n", 0),
    ])


def test_last_turn_only():
    tok = tokenizer_with(CHATML_TEMPLATE)
    check(tok, CHAT, [
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>"
         "\n<|im_start|>user\nok?<|im_end|>\n<|im_start|>assistant\n", 0), ("sure<|im_end|>", 1), ("\n", 0),
    ], last_turn_only=True)


def test_truncate_and_drop():
    tok = tokenizer_with(CHATML_TEMPLATE)
    chat = ChatFormat(tok)
    full = chat.tokenize(CHAT)
    cut = chat.tokenize(CHAT, max_length=40)
    assert cut.truncated and cut.input_ids == full.input_ids[:40] and cut.loss_mask == full.loss_mask[:40]
    with pytest.raises(RowError) as err:
        chat.tokenize(CHAT, max_length=40, overlong="drop")
    assert err.value.reason == "overlong"
    with pytest.raises(RowError) as err:
        chat.tokenize(CHAT, max_length=10)  # no assistant token survives the cut
    assert err.value.reason == "no_loss_after_truncation"


def test_no_assistant_turn_is_a_row_error():
    with pytest.raises(RowError) as err:
        ChatFormat(tokenizer_with(CHATML_TEMPLATE)).tokenize(CHAT[:1])
    assert err.value.reason == "no_assistant_turn"


def test_a_template_that_refuses_a_chat_is_a_row_error():
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}" + CHATML_TEMPLATE
    with pytest.raises(RowError) as err:
        ChatFormat(tokenizer_with(strict)).tokenize([{"role": "assistant", "content": "x"}])
    assert err.value.reason == "template_error" and "must start with user" in err.value.detail
