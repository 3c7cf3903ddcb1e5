"""The batched read path on a GPU, without TransformerLens: rows through shared memory equal rows through the RPC.

    python3 scripts/gpu_read_path.py OUT_DIR   # writes OUT_DIR/read_path.json, prints it

A tiny random Llama in bf16, the batched flavour compiled with CUDA graphs, vLLM's separate processes. The same
greedy batch runs twice; the first is read through the worker's row files (pinned, mapped by this driver), the second
through vLLM's RPC as bytes (this driver claiming another host name), and every row must be equal bit for bit. Then
three more rounds, each round's rows dropped before the next read, must fill the same row files again (no file made
after the first of them), and reset_batched must leave none.
"""

import gc
import glob
import json
import os
import socket
import sys
import tempfile
import time

import torch
from vllm import LLM, SamplingParams

import tl_vllm_hooks as tlh

import tl_vllm_hooks_tools as tools

if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    model = tempfile.mkdtemp(prefix="tiny_llama_")
    tools.tiny_model(model)
    from transformers import AutoConfig

    config = tlh.configure(
        tlh.capture_specs(AutoConfig.from_pretrained(model), sites=("resid_post", "attn_z", "mlp_post")),
        enable_batching=True,
        dtype=torch.bfloat16,
    )
    others = set(glob.glob("/dev/shm/tl_vllm_hooks-*"))  # other engines' on this host
    llm = LLM(model, dtype="bfloat16", skip_tokenizer_init=True, gpu_memory_utilization=0.2, **config.llm_kwargs)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * r) % 500 + 1 for i in range(16 + 13 * r)]} for r in range(24)]
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)

    def run():
        return [output.request_id for output in llm.generate(prompts, params, use_tqdm=False)]

    result = {}
    started = time.perf_counter()
    shared = tlh.read_batched(llm, run())
    result["shared_read_seconds"] = time.perf_counter() - started
    real_hostname = socket.gethostname
    socket.gethostname = lambda: "another-host"  # this driver's, as the workers see it
    try:
        through_rpc = tlh.read_batched(llm, run())
    finally:
        socket.gethostname = real_hostname
    first, second = (sorted(rows, key=lambda r: int(r.split("-")[0])) for rows in (shared, through_rpc))
    pairs = list(zip(first, second))
    result["requests"] = len(pairs)
    result["rows_equal"] = all(
        set(shared[a]) == set(through_rpc[b]) and all(torch.equal(shared[a][n], through_rpc[b][n]) for n in shared[a])
        for a, b in pairs
    )
    result["max_difference"] = max(
        (shared[a][n].float() - through_rpc[b][n].float()).abs().max().item() for a, b in pairs for n in shared[a]
    )
    result["rows_per_request"] = {n: list(t.shape) for n, t in shared[pairs[0][0]].items()}
    del shared, through_rpc
    gc.collect()

    def row_files():  # (held, made so far) by the worker, and its row files in /dev/shm (not the drivers' tokens)
        (held,) = tlh.status(llm)["row_files"]
        in_shm = {f for f in glob.glob("/dev/shm/tl_vllm_hooks-*") if "#" not in f} - others
        return held["files"], held["created"], len(in_shm)

    result["row_files_after_first_reads"] = row_files()
    rounds = []
    for _round in range(3):
        rows = tlh.read_batched(llm, run())
        rounds.append(row_files())
        del rows
        gc.collect()
    result["row_files_per_round"] = rounds
    tlh.reset_batched(llm)
    result["row_files_after_reset"] = row_files()
    made = {created for _held, created, _in_shm in rounds}
    result["ok"] = result["rows_equal"] and made == {rounds[0][1]} and result["row_files_after_reset"][::2] == (0, 0)
    text = json.dumps(result, indent=1)
    print(text)
    with open(os.path.join(out, "read_path.json"), "w") as file:
        file.write(text)
    sys.exit(0 if result["ok"] else 1)
