"""Each family x hook: the worst relative error of vLLM's captures against TransformerLens.

    python scripts/hook_errors.py [--families llama,gemma2] [--out errors.json]

For every family a record describes: a random fp32 model, TransformerLens
4.3's TransformerBridge on the same weights, and two vLLM engines in separate
processes (the one-prompt flavour in a compiled engine, the batched flavour in an
eager one). Each captures every hook of the family on all layers, unedited and
under an edit at each site of layer 1 (a vector added; one forward per edit in
the one-prompt flavour, one request per edit in the batched one), and is compared
with run_with_hooks under the same edit. Prints the worst relative L2 error per
site (over layers, edits and flavours) and the table as markdown. Needs
transformer-lens (the test extra).
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tl_vllm_hooks as tlh  # noqa: E402
from conftest import PROMPT, Model  # noqa: E402  (the tests' prompt and TransformerLens reference)

FAMILIES = tuple(tlh.FAMILIES)  # every family a record describes


def vllm_rows(family_dir, specs, batching, all_edits):
    """[(edits, {hook: rows})] for no edit and each edit of all_edits, from one engine."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config = tlh.configure(specs, 128, torch.float32, enable_batching=batching)
    llm = LLM(family_dir, dtype="float32", max_model_len=512, max_num_seqs=16, enforce_eager=batching,
              skip_tokenizer_init=True, gpu_memory_utilization=0.05, **config.llm_kwargs)
    cases = [{}] + [{name: {"op": "add", "value": value}} for name, value in all_edits.items()]
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    results = []
    if batching:
        requests = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                   extra_args=tlh.request_args(config, "prompt", case or None)) for case in cases]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * len(cases), requests, use_tqdm=False)
        read = tlh.read_batched(llm, [output.request_id for output in outputs])
        results = [(case, read[output.request_id]) for case, output in zip(cases, outputs)]
    else:
        for case in cases:
            tlh.set_edits(llm, case)
            tlh.open_capture(llm)
            llm.generate(TokensPrompt(prompt_token_ids=PROMPT), params, use_tqdm=False)
            results.append((case, tlh.read_captures(llm, len(PROMPT))))
        tlh.reset_edits(llm)
    llm.llm_engine.engine_core.shutdown()
    return results


def placed(hf_config, site):
    """Whether the module's table places `site` on this architecture (it refuses the others)."""
    try:
        tlh.capture_specs(hf_config, sites=(site,))
    except ValueError:
        return False
    return True


def family_errors(family, directory):
    model = Model(family, Path(directory))
    hf_model = model.hf
    sites = [site for site in tlh.SITES if placed(hf_model.config, site)]
    specs = tlh.capture_specs(hf_model.config, sites=sites)
    edits = {name: torch.linspace(-0.5, 0.5, int(torch.Size(shape).numel())).reshape(shape)
             for name, shape in tlh.capture_specs(hf_model.config, sites=sites, layers=[1]).items()}
    site_of = {tlh.SITES[site].format(i=i): site for site in sites for i in range(hf_model.config.num_hidden_layers)}
    worst = {}
    for batching in (False, True):
        for case, rows in vllm_rows(directory, specs, batching, edits):
            expected = model.reference(PROMPT, list(specs), case)
            for name in specs:
                error = float((rows[name].double() - expected[name].double()).norm() / expected[name].double().norm())
                worst[site_of[name]] = max(worst.get(site_of[name], 0.0), error)
    return worst


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", help="also write the errors as JSON")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    families = args.families.split(",")
    table = {}
    for family in families:
        table[family] = family_errors(family, tempfile.mkdtemp(prefix=f"tiny_{family}_"))
        print(f"{family}: " + ", ".join(f"{site} {error:.1e}" for site, error in table[family].items()), flush=True)
    print("\n| hook | " + " | ".join(families) + " |")
    print("|---|" + "---|" * len(families))
    for site, template in tlh.SITES.items():
        cells = [f"{table[f][site]:.1e}" if site in table[f] else "-" for f in families]
        print(f"| `{template}` | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(table, out, indent=1)
