"""The local decode loop gives what `model.generate` gives (greedy), also when rows stop early."""

import torch

from specdistill.config import TargetConfig
from specdistill.data.generate import LocalGenerator, sample_next
from specdistill.target import load_target


def _reference(model, prompt, max_new_tokens, stop, pad):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop, pad_token_id=pad)
    ids = out[0, len(prompt):].tolist()
    return (ids[: ids.index(stop[0])], True) if stop[0] in ids else (ids, False)


def test_greedy_matches_model_generate_with_early_stops():
    target = load_target(TargetConfig(name="random"))
    tok, model = target.tokenizer, target.model
    texts = ["hello there", "a", "the quick brown fox", "xyz!", "one more prompt", "0123456789", "zz"]
    prompts = [tok.encode(s, add_special_tokens=False) for s in texts]
    free = LocalGenerator(model, tok.pad_token_id, [tok.eos_token_id], batch_size=4).generate(prompts, 12)
    # A token some rows emit mid-way becomes the stop token: rows end at different steps, leave the batch,
    # and waiting prompts join the running batch (continuous batching).
    stop = [free[0].token_ids[5]]
    gen = LocalGenerator(model, tok.pad_token_id, stop, batch_size=3)
    outs = gen.generate(prompts, 12)
    assert 0 < sum(o.finished for o in outs) < len(outs)
    for prompt, out in zip(prompts, outs):
        ids, finished = _reference(model, prompt, 12, stop, tok.pad_token_id)
        assert out.token_ids == ids and out.finished == finished


def test_num_tokens_masks_padded_embedding_rows():
    target = load_target(TargetConfig(name="random"))
    n = len(target.tokenizer)
    gen = LocalGenerator(target.model, target.tokenizer.pad_token_id, [], batch_size=8, num_tokens=n)
    outs = gen.generate([[65, 66, 67]] * 8, 10, temperature=1.5, seed=1)
    assert all(max(o.token_ids) < n for o in outs)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    drawn = {int(sample_next(logits, 1.0, 0.7, g)) for _ in range(200)}
    assert drawn == {0, 1}
    assert int(sample_next(logits, 0.0, 1.0, None)) == 0


def test_top_p_is_exact_when_the_nucleus_is_wider_than_the_candidates():
    logits = torch.zeros(1, 1000)  # flat: top_p=0.9 needs 900 tokens, more than the top-k candidates
    g = torch.Generator().manual_seed(0)
    drawn = {int(sample_next(logits, 1.0, 0.9, g)) for _ in range(400)}
    assert len(drawn) > 256 and max(drawn) < 1000
