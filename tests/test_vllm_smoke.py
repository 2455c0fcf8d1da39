"""vLLM itself runs here: greedy answers of vLLM (CPU, enforce_eager) equal transformers' token for token,
both in this CPU's engine dtype (nelssa.cpu.cpu_dtype(): bf16 with native bf16, else fp32)."""

import pytest

PROMPTS = ["What is the capital of France?", "Write a short poem about the sea."]


@pytest.mark.engine
def test_vllm_greedy_matches_transformers(model_dir):
    from vllm import LLM, SamplingParams

    from nelssa.cpu import cpu_dtype
    from nelssa.models import greedy_answer

    dtype = cpu_dtype()
    # short chat prompts: 512-token steps (vLLM's CPU warm-up runs one forward of this size; 4096 by default)
    llm = LLM(model=model_dir, enforce_eager=True, max_model_len=2048, max_num_batched_tokens=512, dtype=dtype, seed=0)
    tok = llm.get_tokenizer()
    try:
        for prompt in PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=16))
            got = list(out[0].outputs[0].token_ids)
            ids_hf, want, text = greedy_answer(model_dir, prompt, max_new_tokens=16, dtype=dtype)
            assert ids_hf == ids
            assert got == want, (prompt, got, want, text)
        assert len(got) == 16  # the poem runs past 16 tokens: all 16 compared
    finally:
        del llm
