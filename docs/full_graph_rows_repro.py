"""Standalone reproducer, for vLLM bug reports: with cudagraph_mode=FULL, vLLM 0.24.0
computes some rows wrong (H200, bf16), in Model Runner V2 rows of mixed prefill batches, in
V1 rows of generated tokens.

Needs only torch, transformers and vLLM (no tl_vllm_hooks). A random 3-layer Llama
(width 128, 2 query heads and 1 KV head, so head size 64, vocabulary 512; made here with a
fixed seed); max_num_seqs=8 and 128 tokens a step so that steps mix prefill chunks and
decodes of many requests. Prompts (--prompts): "many", 40 prompts of 1, 3, ..., 79 tokens,
4 tokens generated; "batch", prompts of 9, 300 and 57 tokens, 5 generated. Every generated
token's logprobs (top 20) are set against transformers' on the prompt and the tokens
generated before it (the same weights rounded to bf16, as vLLM loads them, computed in
fp32); bf16 rounding keeps every token within ~0.08, so a request more than 0.3 off is a
wrong row. Prints the wrong requests of each generate and how many generates had one.
    python3 docs/full_graph_rows_repro.py [--cudagraph-mode FULL] [--runner v2] [--generates 24]
        [--prompts many] [--num-prompts 40]
        [--compilation-config '{"cudagraph_capture_sizes": [16, 32, 64, 128]}']
On a CPU, ``--runner v1 --cudagraph-mode NONE`` runs it end to end. What it found on the
H200, and the likely cause: docs/full-cudagraph-rows.md.
"""
import argparse
import json
import os
import tempfile

_WRONG = 0.3
_TOP = 20


def _prompts(name, num_prompts):
    """(prompts, tokens to generate)."""
    if name == "many":
        return [[(31 * i + 7 * r) % 512 for i in range(1 + 2 * r)] for r in range(num_prompts)], 4
    return [[(5 * i + 1) % 512 for i in range(9)], [(11 * i + 2) % 512 for i in range(300)],
            [(3 * i + 7) % 512 for i in range(57)]][:num_prompts], 5


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cudagraph-mode", default="FULL")
    parser.add_argument("--runner", choices=("v1", "v2"), default="v2")
    parser.add_argument("--generates", type=int, default=24)
    parser.add_argument("--prompts", choices=("many", "batch"), default="many")
    parser.add_argument("--num-prompts", type=int, default=40, help="the first N of the prompts")
    parser.add_argument("--compilation-config", default="{}", help="JSON, merged under cudagraph_mode")
    args = parser.parse_args()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, for vLLM's CPU build; ignored on GPUs
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # a forked engine cannot use CUDA
    import torch
    import transformers
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, max_tokens = _prompts(args.prompts, args.num_prompts)
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=1024, initializer_range=0.1, tie_word_embeddings=False,
        )
        hf_model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
        hf_model.save_pretrained(model_dir)
        with torch.no_grad():
            for parameter in hf_model.parameters():
                parameter.copy_(parameter.to(torch.bfloat16).to(torch.float32))
        expected = {}  # token sequence -> transformers' log-probabilities for each of its rows

        def reference(sequence):
            if sequence not in expected:
                with torch.no_grad():
                    expected[sequence] = torch.log_softmax(hf_model(torch.tensor([sequence])).logits[0].double(), -1)
            return expected[sequence]

        llm = LLM(model_dir, dtype="bfloat16", max_model_len=1024, max_num_batched_tokens=128, max_num_seqs=8,
                  enable_prefix_caching=False, skip_tokenizer_init=True, gpu_memory_utilization=0.05, seed=0,
                  compilation_config=dict(json.loads(args.compilation_config), cudagraph_mode=args.cudagraph_mode))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=_TOP)
        generates_with_a_wrong_row = 0
        for index in range(args.generates):
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            wrong, largest = {}, 0.0
            for r, (prompt, output) in enumerate(zip(prompts, outputs)):
                generated = list(output.outputs[0].token_ids)
                logprobs = reference(tuple(prompt) + tuple(generated[:-1]))
                # Generated token j comes from row len(prompt) - 1 + j.
                errors = [max(abs(lp.logprob - float(logprobs[len(prompt) - 1 + j, token])) for token, lp in top.items())
                          for j, top in enumerate(output.outputs[0].logprobs)]
                largest = max(largest, *errors)
                if max(errors) > _WRONG:
                    worst = errors.index(max(errors))
                    wrong[r] = f"{errors[worst]:.3f} at generated token {worst}"
            generates_with_a_wrong_row += bool(wrong)
            print(f"generate {index}: largest error {largest:.3f}; wrong requests (index: error) {wrong}", flush=True)
        print(f"{args.runner} {args.cudagraph_mode}: a wrong row in {generates_with_a_wrong_row} of "
              f"{args.generates} generates", flush=True)


if __name__ == "__main__":
    main()
