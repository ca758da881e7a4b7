"""Self-distillation data: the batched generation loop gives each prompt its own greedy answer."""
from __future__ import annotations

import torch

from offline.datagen import generate_batch, load_train_prompts


def test_batched_greedy_equals_one_by_one_generate(base_fp32):
    """Left padding, positions and rows leaving the batch at EOS must not change any answer (fp32)."""
    prompts = ["Say yes.", "List three prime numbers, then explain what a prime number is.", "Hi"]
    answers = generate_batch(base_fp32, prompts, 24, sample=False)
    assert len(answers) == len(prompts)
    for prompt, answer in zip(prompts, answers):
        ids = base_fp32.chat_ids(prompt)
        with torch.inference_mode():
            out = base_fp32.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                           eos_token_id=sorted(base_fp32.eos_token_ids))
        expected = out[0, len(ids):].tolist()
        assert answer == expected
        ended = [i for i, t in enumerate(answer) if t in base_fp32.eos_token_ids]
        assert not ended or ended == [len(answer) - 1]  # cut right after the first EOS
    assert any(a[-1] in base_fp32.eos_token_ids for a in answers), "a short answer should end early"


def test_train_prompts_cover_every_source_evenly():
    picked = load_train_prompts(40, seed=0)
    assert len(picked) == 40 and len({p["id"] for p in picked}) == 40
    families = {p["source"].split("/")[0] + "/" + p["source"].split("/")[1].split("_")[0] for p in picked}
    assert len(families) == 5
