"""Attention patterns and scores (rebuilt from each query and key, exactly TransformerLens's) and logits (unembed, the
logit lens kept in the step), and the attention engines vLLM's CPU cannot hook, refused.
"""

from __future__ import annotations

import itertools
import re
import socket
import warnings

import numpy as np
import pytest
import torch

import tl_vllm_hooks as tlh
from conftest import (  # the shared engines, oracles and helpers
    AMX_MLA, ATTENTION, BATCH, BF16_ALONE_ON_CPU, FAMILIES, NO_ENGINE, PLACED_HERE, PROMPT, assert_matches,
    check_per_request, comparable, engine, family_engine_arguments, generate, hook_row_errors, row_errors,
)


@NO_ENGINE
def test_attention_patterns_keep_each_query_and_key_and_refuse_what_they_cannot_rebuild(tmp_path):
    """attn.hook_attn_scores and hook_pattern keep each token's query and key heads ([n_heads + n_kv_heads, d_head]);
    they are read-only, a request on an engine reading them keeps its rows from its first position to the last it
    asks for (a read hands over those it asked for), and they are never written to a sink."""
    from transformers import LlamaConfig

    llama = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=96)
    llama.architectures = ["LlamaForCausalLM"]
    specs = tlh.capture_specs(llama, sites=("attn_scores", "pattern"), layers=-1)
    assert specs == {"blocks.1.attn.hook_attn_scores": (6, 16), "blocks.1.attn.hook_pattern": (6, 16)}
    config = tlh.configure(specs, 64, enable_batching=True)
    for name in specs:
        with pytest.raises(ValueError, match=re.escape(f"{name!r} is read-only: vLLM's attention kernels never hold")):
            tlh.request_args(config, "all", {name: {"op": "suppress"}})
    positions = np.arange(12)
    for capture, kept, asked in [("all", (0, 2**63 - 1), None), ("prompt", (0, 9), None),
                                 ("last_prompt_token", (0, 9), [9]), ([3, 7], (0, 7), [3, 7]), ("none", (0, -1), None)]:
        options = tlh._parse_options(tlh.request_args(config, capture)["tl_vllm_hooks"], config)
        assert options.kept_range(10) == kept and options.asked(lambda: positions[: kept[1] + 1], 10) == asked, capture
    with pytest.raises(ValueError, match="sink_dir: blocks.1.attn.hook_attn_scores is rebuilt when read_batched"):
        tlh.configure(specs, 64, enable_batching=True, sink_dir=str(tmp_path))
    name = "blocks.1.attn.hook_pattern"
    for heads, why in [([], "a non-empty list"), ([1, 1], "distinct"), ([-1], ">= 0"), ([True], ">= 0"),
                       ([0.0], ">= 0"), (2, "a non-empty list")]:
        with pytest.raises(ValueError, match=re.escape(f"attention_heads[{name!r}]: expected ") + f".*{why}.*got"):
            tlh.configure(specs, 64, attention_heads={name: heads})
    with pytest.raises(ValueError, match=re.escape("attention_heads: 'blocks.0.attn.hook_pattern' is not an "
                       f"attn_scores or pattern hook in capture_specs; those are {list(specs)}")):
        tlh.configure(specs, 64, attention_heads={"blocks.0.attn.hook_pattern": [0]})
    with pytest.raises(ValueError, match=r"attention_heads: expected a dict \{attn_scores or pattern hook"):
        tlh.configure(specs, 64, attention_heads=[0])
    config = tlh.configure(specs, 64, attention_heads={name: [3, 0]})
    assert tlh.CaptureConfig.from_json(config.to_json()).attention_heads == {name: (3, 0)}
    # Chosen heads are those of every head's matrices, in the order chosen: with 2 query heads a key head (GQA),
    # a sink and an ALiBi slope per head, a sliding window, on 9 positions, queries 2, 5 and 8.
    facts = {"heads": 4, "kv_heads": 2, "head_size": 16, "scale": 0.25, "softcap": 0.0, "window": 4, "chunk": 0,
             "sinks": [0.5, -1.0, 2.0, 0.0], "alibi": [0.1, 0.2, 0.3, 0.4]}
    rows = torch.randn(9, 6, 16, generator=torch.Generator().manual_seed(0))
    for site in ATTENTION:
        every = tlh._attention_rows(site, rows[None], {**facts, "chosen": None}, [2, 5, 8])[0]
        chosen = tlh._attention_rows(site, rows[None], {**facts, "chosen": [3, 0]}, [2, 5, 8])[0]
        assert every.shape == (4, 3, 9) and torch.equal(chosen, every[[3, 0]]), site
    # A worker rebuilds requests of the same rows and queries together: each as it would be alone.
    batch = torch.randn(3, 9, 6, 16, generator=torch.Generator().manual_seed(1))
    for site, queries, chosen in itertools.product(ATTENTION, [None, [2, 5, 8]], [None, [3, 0]]):
        together = tlh._attention_rows(site, batch, {**facts, "chosen": chosen}, queries)
        alone = [tlh._attention_rows(site, one[None], {**facts, "chosen": chosen}, queries)[0] for one in batch]
        torch.testing.assert_close(together, torch.stack(alone), rtol=1e-6, atol=1e-6)
    tap = tlh._layer_sites(tlh.FAMILIES["llama"], llama, 1)["pattern"].tap  # a worker's placement, under tensor parallelism
    with pytest.raises(ValueError, match="splits across ranks; read them with tensor_parallel_size=1"):
        tlh._tensor_parallel_share(torch.nn.Identity(), tap, 96, tlh._Ranks(0, 2, 0))


@NO_ENGINE
def test_attention_score_rows_are_held_to_their_own_length(models):
    """Each query's row of attention scores is held against its own norm, floored at a quarter of a typical row's of
    its length (see TYPICAL_ROWS): scores 1.25 times too large (a missed attention scale such as yarn's mscale) fail
    the bf16 per-row bound at every query, the first, which sees one key, included; against the mean row's norm the
    first queries' rows would pass it."""
    model = models["llama"]
    with torch.no_grad():
        _logits, cache = model.bridge.run_with_cache(torch.tensor([PROMPT[:64]]))
    name = "blocks.1.attn.hook_attn_scores"
    right = cache[name][0]
    rows = comparable(name, right * 1.25, right)
    assert float(hook_row_errors(name, *rows).min()) > BF16_ALONE_ON_CPU
    assert float(row_errors(*rows, floor="typical")[:3].max()) < BF16_ALONE_ON_CPU, "the mean row's norm held them"
    assert float(hook_row_errors(name, *comparable(name, right.clone(), right)).max()) == 0


@NO_ENGINE
@pytest.mark.parametrize("family", FAMILIES + PLACED_HERE)
def test_attention_scores_are_refused_exactly_where_transformer_lens_gives_the_pattern_there(models, family):
    """Some of TransformerLens 4.3's adapters fire blocks.L.attn.hook_attn_scores with the softmax's output (what
    hook_pattern holds): those records refuse it, saying so, and every other family's bridge gives scores there."""
    with torch.no_grad():
        _logits, cache = models[family].bridge.run_with_cache(torch.tensor([PROMPT[:8]]))
    names = [name for name in cache.keys() if name.endswith(ATTENTION[0])]
    if not tlh.FAMILIES[family].attention:  # no attention (Mamba-2): nor any attention hook in the bridge
        assert not [name for name in cache.keys() if ".attn." in name], f"{family}: the bridge runs attention hooks"
        return
    assert names, f"{family}: the bridge runs no hook_attn_scores"
    pattern_there = all(torch.equal(cache[name], cache[name.replace(*ATTENTION)]) for name in names)
    refused = tlh.FAMILIES[family].refused
    says_pattern = refused.get("attn_scores", "").startswith("TransformerLens 4.3's adapter fires hook_attn_scores with")
    if "attn_scores" in refused and not says_pattern:  # refused for another reason, with hook_pattern (Gemma 4)
        assert refused["pattern"] == refused["attn_scores"]
        return
    assert pattern_there == says_pattern, (
        f"{family}: the bridge's hook_attn_scores {'is' if pattern_there else 'is not'} its hook_pattern; refused: "
        f"{refused.get('attn_scores')!r}"
    )


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "separate"])
def test_the_logit_lens_kept_in_the_step_is_the_models_logits_and_unembeds(models, tmp_path, in_process):
    """configure(..., logit_lens={hook: k}): each kept row's top k logits, made in the step: the last layer's are
    TransformerLens's logits' top k, an earlier layer's what unembed makes of the rows read (itself checked against
    TransformerLens), per request, in a read and in a sink."""
    model, k = models["llama"], 5
    last = model.hf.config.num_hidden_layers - 1
    lens = {"blocks.1.hook_resid_post": k, f"blocks.{last}.hook_resid_post": k}
    prompts = [PROMPT[:40], PROMPT[5:17]]
    with engine(model, sites=("resid_post",), in_process=in_process, eager=True, batching=True, logit_lens=lens) as llm:
        outputs = generate(llm, prompts, 3, [tlh.request_args(llm.config, "prompt")] * 2)
        rows = tlh.read_batched(llm, [output.request_id for output in outputs])
        for prompt, output in zip(prompts, outputs):
            got = rows[output.request_id]
            assert got[f"blocks.{last}.hook_resid_post.logits.values"].dtype == torch.float32
            assert got[f"blocks.{last}.hook_resid_post.logits.indices"].dtype == torch.int64
            with torch.no_grad():
                logits = model.bridge.run_with_cache(torch.tensor([prompt]), names_filter=[])[0][0]
            best = logits.topk(k)
            assert torch.equal(got[f"blocks.{last}.hook_resid_post.logits.indices"], best.indices)
            assert_matches({"values": got[f"blocks.{last}.hook_resid_post.logits.values"]}, {"values": best.values})
            unembedded = tlh.unembed(llm, got["blocks.1.hook_resid_post"], top_k=k)
            assert torch.equal(got["blocks.1.hook_resid_post.logits.indices"], unembedded.indices)
            assert_matches({"values": got["blocks.1.hook_resid_post.logits.values"]}, {"values": unembedded.values})
    with engine(model, sites=("resid_post",), in_process=in_process, eager=True, batching=True, logit_lens=lens,
                sink_dir=str(tmp_path / "acts")) as llm:
        sunk = generate(llm, prompts, 3, [tlh.request_args(llm.config, "prompt")] * 2)
        dataset = tlh.flush_sink(llm)
        for output, read in zip(sunk, outputs):
            written, held = dataset[output.request_id], rows[read.request_id]
            assert set(written) == set(held)
            assert all(torch.equal(written[name], held[name]) for name in held), "the sink's are the read's"


class TestAttentionPatterns:
    """attn.hook_attn_scores and hook_pattern read through vLLM's separate processes (the default layout), each
    request against its own TransformerLens run: a 300-token prompt kept as "prompt" (chunked prefill over three
    forwards), requests with decode steps, one editing the keys (the pattern follows the edited keys), and requests
    keeping some positions, whose queries are those, over every key up to the last (the 300-token prompt's last
    token; a generated token; a position never reached). Two hooks rebuild chosen heads: one, and both reordered."""

    HEADS = {"blocks.1.attn.hook_pattern": [1], "blocks.2.attn.hook_attn_scores": [1, 0]}

    @pytest.fixture(scope="class")
    def llm(self, models):
        sites = ("attn_rot_k", "attn_scores", "pattern", "resid_post")
        with engine(models["llama"], sites=sites, in_process=False, eager=True, batching=True,
                    attention_heads=self.HEADS) as llm:
            yield llm

    def test_each_requests_attention_matches_its_own_transformer_lens_run(self, llm, models):
        keys = {"blocks.1.attn.hook_rot_k": {"op": "scale", "value": 3.0, "positions": [2, 5]}}
        requests = [(BATCH[1], "prompt", None), (BATCH[2], "all", keys), (BATCH[0], None, None),
                    (BATCH[1], "last_prompt_token", None), (BATCH[2], [4, 30, 58], keys), (BATCH[0], [3, 11], None)]
        _outputs, worst = check_per_request(llm, models["llama"], requests, max_tokens=4)
        print(f"\nworst relative error {worst:.2e}")

    @pytest.mark.parametrize("driver_host", ["this host", "another host"])
    def test_requests_alike_are_rebuilt_together_in_the_worker_each_as_its_own(self, llm, models, monkeypatch,
                                                                                driver_host):
        """Requests of as many rows and the same queries have their matrices rebuilt together, in the worker: each
        still matches its own TransformerLens run, under its own edit of the keys or none. A driver on this host
        gets them as places in a row file; one on another host, encoded through vLLM's RPC."""
        (output,) = generate(llm, [BATCH[0]], max_tokens=2)
        host = socket.gethostname() if driver_host == "this host" else "another-host"
        (reply,) = llm.collective_rpc("tl_call", args=("read_batched", [output.request_id], host))
        matrices = reply["result"]["rows"][output.request_id]["attention"]
        assert sorted(matrices) == sorted(name for name in llm.hook_names if name.endswith(ATTENTION)), matrices
        kind = list if driver_host == "this host" else dict  # [file, element offset, shape], or encoded
        assert all(isinstance(m, kind) for m in matrices.values()), f"{matrices!r:.300}"
        sent = [name for name, _shape, _dtype in reply["result"]["hooks"]]
        assert "blocks.1.hook_resid_post" in sent and not set(matrices) & set(sent), "query and key rows stay there"
        if driver_host == "another host":
            monkeypatch.setattr(socket, "gethostname", lambda: "another-host")  # the driver's
        keys = {"blocks.1.attn.hook_rot_k": {"op": "scale", "value": 3.0, "positions": [2, 5]}}
        requests = [(BATCH[2], "prompt", None), (BATCH[2], "prompt", keys), (BATCH[2], "all", keys),
                    (BATCH[2], [3, 11], None), (BATCH[2], [3, 11], keys)]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "read_batched: rows come through vLLM's RPC")
            check_per_request(llm, models["llama"], requests, max_tokens=4)

    def test_a_request_whose_attention_could_outgrow_a_read_is_refused_before_it_runs(self, llm, monkeypatch):
        """Six hooks' float32 scores and patterns, bounded by [n_heads + n_kv_heads (3), n, n] each, or by the heads
        chosen (1 and 2): 11 MiB for the 300-token prompt and 3 generated tokens, 0.02 MiB for 9 and 3, 500 bytes for
        the first kept up to position 4."""
        monkeypatch.setattr(tlh, "ATTENTION_READ_BYTES", 1 << 20)
        with pytest.raises(ValueError, match=r"\(6 hooks, 303 positions\) could take 11 MiB, past the 1 MiB"):
            generate(llm, [BATCH[1]], max_tokens=4)
        few = tlh.request_args(llm.config, [4])
        outputs = generate(llm, [BATCH[1], BATCH[0]], max_tokens=4, extra_args=[few, None])
        rows = tlh.read_batched(llm, [output.request_id for output in outputs])
        assert [rows[o.request_id]["blocks.2.attn.hook_pattern"].shape for o in outputs] == [(2, 1, 5), (2, 12, 12)]
        assert [rows[o.request_id]["blocks.1.attn.hook_pattern"].shape for o in outputs] == [(1, 1, 5), (1, 12, 12)]


def test_an_eager_engine_running_the_cpu_rotary_kernel_on_3d_queries_is_refused(models):
    """LFM2 without compilation_config={'custom_ops': ['-rotary_embedding']}: vLLM's CPU rotary kernel would rotate its
    per-head q and k as if each head were a token (every row from its first attention layer on ~0.3 off); and with it,
    in a process where an earlier engine built that kernel's rotary module."""
    with pytest.raises(Exception, match=r"Lfm2ForCausalLM: vLLM hands its rotary embedding q and k of \[tokens, heads"
                       r".*compilation_config=\{'custom_ops': \['-rotary_embedding'\]\}"):
        with engine(models["lfm2"], sites=("resid_post",), in_process=True, eager=True):
            pass
    # Asked for, but handed the rotary module that engine built (vLLM's get_rope keeps it for the process): refused,
    # naming the cache, where the message above would send the user to the custom_ops they already gave.
    with pytest.raises(Exception, match=r"Lfm2ForCausalLM: vLLM hands its rotary embedding q and k of \[tokens, heads"
                       r".*This engine's custom_ops ask for vLLM's rotary in torch, but .*an earlier engine in this "
                       r"process built this one with the kernel.*_ROPE_DICT"):
        with engine(models["lfm2"], sites=("resid_post",), in_process=True, eager=True, earlier_rotary=True,
                    **family_engine_arguments("lfm2")):
            pass


@pytest.mark.skipif(not AMX_MLA, reason="vLLM's CPU picks its AMX_MLA backend only on a CPU with AMX tiles")
def test_latent_keys_on_vllms_amx_mla_backend_are_refused(models):
    """GLM-4.7-Flash's latent attention where vLLM's CPU picks its AMX_MLA backend (a CPU with AMX tiles), which
    releases kv_b_proj's weight after packing it: the per-head key, projected up from the latent by it, is refused,
    naming attention_config={'backend': 'CPU_MLA'} (which the other tests pass there)."""
    arguments = {k: v for k, v in family_engine_arguments("glm4_moe_lite").items() if k != "attention_config"}
    with pytest.raises(Exception, match=r"attn\.hook_k: vLLM released .*kv_b_proj's weight after packing it for its "
                       r"AMX_MLA backend.*attention_config=\{'backend': 'CPU_MLA'\}"):
        with engine(models["glm4_moe_lite"], sites=("attn_k",), in_process=True, eager=True, **arguments):
            pass


def test_attention_heads_past_the_models_are_refused_where_the_hooks_are_placed(models):
    with pytest.raises(Exception, match=re.escape("attention_heads['blocks.1.attn.hook_pattern']: head 2, but ")
                       + r"model\.layers\.1\.self_attn.* has 2 heads \(0 to 1\)"):
        with engine(models["llama"], sites=("pattern",), in_process=True, eager=True,
                    attention_heads={"blocks.1.attn.hook_pattern": [0, 2]}):
            pass
