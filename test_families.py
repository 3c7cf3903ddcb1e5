"""Each hook name means TransformerLens's tensor on every family the records describe: the records, the sites each
family offers and refuses, the tiny models' norms, the decoders TransformerLens and vLLM share, and every family's
hooks and edits (both flavours) against TransformerLens 4.3's bridge on the same weights.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import tl_vllm_hooks as tlh
import tl_vllm_hooks_tools as tools
from conftest import (  # the shared engines, oracles and helpers
    BATCH, CLASSIC_SITES, FAMILIES, HERE, LOOSER_FROM, Model, NO_ENGINE, PLACED_HERE, PROMPT, PerRow, READ_ONLY,
    ROUTER_TIE, TRANSFORMERS_TAPS, TransformersReference, VISION_TEXT_FAMILIES, assert_matches, assert_routing_ties,
    capture, check_batched, check_every_site_edit, check_every_site_edit_per_request, check_logit_lens,
    check_per_request, edited_layers, engine_routes, family_tolerance, generate, hook_row_errors, hook_shapes,
    read_only, record_followed, relative_error, site_edits, site_of, transformers_sites,
)


# --- multimodal checkpoints ----------------------------------------------------------------
# First in the file: the longest unit of work (about 12 minutes of one engine at a time), which pytest-xdist's
# loadscope then hands a worker first, beside the rest.


@pytest.fixture(scope="session")
def vision_python():
    """The python of an environment where torchvision imports (vLLM's native multimodal classes import it; no CPU
    build for this torch exists, see scripts/vision_env.sh): $TL_VLLM_HOOKS_VISION_PYTHON (CI builds it first), else
    what scripts/vision_env.sh builds from this python (once, ~30 s)."""
    python = os.environ.get("TL_VLLM_HOOKS_VISION_PYTHON")
    if not python:
        built = subprocess.run(
            ["bash", str(HERE / "scripts" / "vision_env.sh")], capture_output=True, text=True,
            env={**os.environ, "PYTHON": sys.executable},
        )
        assert built.returncode == 0, f"scripts/vision_env.sh failed:\n{built.stderr[-3000:]}"
        python = built.stdout.split()[-1]
    return python


DECODERS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


REFUSED_SITE_FAMILIES = tuple(family for family in FAMILIES + PLACED_HERE if tlh.FAMILIES[family].refused)


def check_refusal(model: Model, site: str, reason: str, cache) -> None:
    """That the record's reason for refusing ``site`` holds, each kind of reason shown as it says: the bridge fires
    no such hook, its hook holds another tensor, hooking it raises, or vLLM's model hands the attention no keys."""
    names = [name for name in cache if site_of(name) == site]
    tokens = torch.tensor([PROMPT[:8]])
    if "runs no hook_normalized or hook_scale" in reason or "with no hook_rot_q or hook_rot_k" in reason:
        assert not names, f"{model.family}: the bridge fires {names}"
    elif "fires hook_attn_scores with the softmax's output" in reason:
        assert names and all(torch.equal(cache[name], cache[name.replace("hook_attn_scores", "hook_pattern")])
                             for name in names), f"{model.family}: the bridge's scores are not its pattern"
    elif "fails on a hook at OLMo's weightless norms" in reason:
        assert names, f"{model.family}: the bridge fires no {site}"
        with pytest.raises(AttributeError, match="has no attribute 'weight'"):
            model.bridge.run_with_hooks(tokens, fwd_hooks=[(names[0], lambda rows, hook: rows * 2)])
    elif "interleaves q, k and v per head" in reason:
        fused = {}
        module = model.hf.gpt_neox.layers[0].attention.query_key_value
        handle = module.register_forward_hook(lambda _module, _inputs, output: fused.setdefault("qkv", output[0]))
        with torch.no_grad():
            model.hf(tokens)
        handle.remove()
        part = {"attn_q": 0, "attn_k": 1, "attn_v": 2}[site]
        name = f"blocks.0.{tlh.SITES[site].split('.', 2)[2]}"
        heads, width = cache[name].shape[-2:]
        per_head = fused["qkv"].view(8, heads, 3, width)[:, :, part]
        thirds = fused["qkv"].view(8, 3, heads, width)[:, part]  # (what a split into q, k, v columns would read)
        assert torch.allclose(cache[name][0], per_head, atol=1e-6), "the bridge's is each head's part"
        assert relative_error(thirds, cache[name][0]) > 0.1, "a split into thirds would read other numbers"
    elif "inputs of its q/k norms" in reason:
        normed = {}
        attention = model.hf.model.layers[0].self_attn
        norm = attention.query_layernorm if site == "attn_rot_q" else attention.key_layernorm
        handle = norm.register_forward_pre_hook(lambda _module, inputs: normed.setdefault("in", inputs[0]))
        with torch.no_grad():
            model.hf(tokens)
        handle.remove()
        name = f"blocks.0.{tlh.SITES[site].split('.', 2)[2]}"
        assert normed["in"].shape[1:3] == (cache[name].shape[2], 8), "the norm takes [heads, tokens, d_head]"
        assert torch.allclose(cache[name][0], normed["in"][0].transpose(0, 1), atol=1e-6)
    elif "holds the image features at an image's" in reason:  # (the image positions: the vision file's image prompts)
        assert torch.allclose(cache["hook_embed"], cache["blocks.0.hook_resid_pre"], rtol=1e-6, atol=0), (
            f"{model.family}: the bridge's blocks.0.hook_resid_pre is not its hook_embed at text positions"
        )
    elif "handed as None" in reason:
        import vllm.model_executor.models.gemma4 as vllm_gemma4

        assert tools.tiny_config(model.family).get_text_config().num_kv_shared_layers > 0
        assert "self.attn(q, None, None)" in inspect.getsource(vllm_gemma4.Gemma4Attention.forward)
    else:
        pytest.fail(f"{model.family}: no check for the reason {reason!r}")


# One family of each tolerance class family_tolerance gives: TOLERANCE, each of LOOSER_FROM's, BF16_ALONE_ON_CPU, and
# linear attention's output beside it.
TOLERANCE_CLASSES = ("llama", *LOOSER_FROM, "deepseek_v3", "qwen3_5")


def class_default_switches(family: str) -> dict[str, bool]:
    """{config attribute: its config class's default} of the switches (bools) the family's tiny config sets otherwise,
    less those its record requires (settings): a config with transformers' defaults there."""
    text = tools.tiny_config(family).get_text_config()
    default = type(text)()
    settings = tlh.FAMILIES[family].settings
    return {
        key: getattr(default, key) for key, value in text.to_dict().items()
        if isinstance(value, bool) and isinstance(getattr(default, key, None), bool)
        and getattr(default, key) != value and key not in settings
    }


class TestMultimodalCheckpoints:
    """The multimodal records (MULTIMODAL), in test_tl_vllm_hooks_vision.py."""

    def test_multimodal_checkpoints_in_the_vision_environment(self, vision_python, tmp_path):
        """test_tl_vllm_hooks_vision.py, run where torchvision imports: every multimodal record's text model and
        VISION_TEXT_FAMILIES (TestFamilies' checks, and TestFamiliesOnePromptFlavour's on those among
        ONE_PROMPT_FAMILIES), every record's placement, and a LLaVA image prompt at every position; fails with the
        inner run's output."""
        environment = {key: value for key, value in os.environ.items()
                       if key != "VLLM_ENABLE_V1_MULTIPROCESSING" and not key.startswith("PYTEST_")}
        ran = subprocess.run(
            [vision_python, "-m", "pytest", "-q", "test_tl_vllm_hooks_vision.py", "-p", "no:cacheprovider",
             "--basetemp", str(tmp_path / "vision"), "-W", "ignore::DeprecationWarning"],
            cwd=HERE, env=environment, capture_output=True, text=True, timeout=3000,
        )
        assert ran.returncode == 0, (
            f"test_tl_vllm_hooks_vision.py failed:\n{ran.stdout[-12000:]}\n{ran.stderr[-3000:]}"
        )
        print(f"\ntest_tl_vllm_hooks_vision.py: {ran.stdout.strip().splitlines()[-1]}")


@NO_ENGINE
def test_capture_specs_names_follow_transformer_lens():
    from transformers import GPT2Config, LlamaConfig

    llama = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96)
    llama.architectures = ["LlamaForCausalLM"]
    specs = tlh.capture_specs(llama, sites=CLASSIC_SITES[:1] + CLASSIC_SITES[2:])
    assert list(specs) == [
        "hook_embed",
        *(f"blocks.{i}.{hook}" for i in range(2) for hook in (
            "hook_resid_pre", "attn.hook_z", "hook_attn_out", "hook_resid_mid", "mlp.hook_post", "hook_mlp_out",
            "hook_resid_post",
        )),
        "ln_final.hook_normalized",
    ], "every hook, in the order a forward reaches them"
    assert specs["blocks.1.attn.hook_z"] == (4, 16) and specs["blocks.0.mlp.hook_post"] == (96,)
    assert specs["blocks.1.hook_resid_post"] == specs["hook_embed"] == (64,)
    llama.num_key_value_heads = 2
    attention = tlh.capture_specs(
        llama, sites=("ln1", "attn_q", "attn_k", "attn_v", "attn_rot_q", "attn_rot_k", "ln2", "mlp_pre"), layers=[0]
    )
    assert attention == {
        "blocks.0.ln1.hook_normalized": (64,),
        "blocks.0.attn.hook_q": (4, 16),
        "blocks.0.attn.hook_k": (2, 16),
        "blocks.0.attn.hook_v": (2, 16),
        "blocks.0.attn.hook_rot_q": (4, 16),
        "blocks.0.attn.hook_rot_k": (2, 16),
        "blocks.0.ln2.hook_normalized": (64,),
        "blocks.0.mlp.hook_pre": (96,),
    }, "q heads, then key-value heads"
    gpt2 = GPT2Config(n_embd=64, n_layer=1, n_head=2)
    gpt2.architectures = ["GPT2LMHeadModel"]
    assert tlh.capture_specs(gpt2, sites=("pos_embed", "mlp_post")) == {"hook_pos_embed": (64,), "blocks.0.mlp.hook_post": (256,)}
    with pytest.raises(ValueError, match="of those LlamaForCausalLM has:"):
        tlh.capture_specs(llama, sites=("resid",))


@NO_ENGINE
def test_a_misspelt_site_gets_close_matches_among_its_familys_sites_alone():
    from transformers import LlamaConfig

    llama = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2)
    llama.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError) as refused:
        tlh.capture_specs(llama, sites=("resid_psot", "attn_out"))
    message = str(refused.value)
    assert "'resid_psot': did you mean resid_post" in message, message
    offered = message.rpartition("LlamaForCausalLM has: ")[2]
    assert eval(offered) == tlh.model_sites(llama), message  # the family's sites, in forward order, and no others
    assert "mixer_in_proj" not in message and "expert_indices" not in message, message


@NO_ENGINE
def test_capture_specs_take_one_site_one_layer_and_layers_from_the_end():
    """A str is one site and an int one layer; negative layers count from the end, as in TransformerLens."""
    from transformers import LlamaConfig

    llama = LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, intermediate_size=96)
    llama.architectures = ["LlamaForCausalLM"]
    assert tlh.capture_specs(llama, sites="resid_post", layers=1) == {"blocks.1.hook_resid_post": (64,)}
    assert list(tlh.capture_specs(llama, sites=["mlp_out"], layers=[-1, 0, 2])) == [
        "blocks.0.hook_mlp_out", "blocks.2.hook_mlp_out"
    ], "-1 is layer 2, in forward order, once"
    for layers in ([3], [-4], True, [False], 1.0, ["1"], "1"):
        with pytest.raises(ValueError, match=r"layers .*: expected ints in \[-3, 3\) \(-1: the last\)"):
            tlh.capture_specs(llama, layers=layers)
    for sites in (1, None, [("resid_post",)]):
        with pytest.raises(ValueError, match=r"unknown sites .*; one site or a list of them, of those LlamaForCausalLM has: \['embed'"):
            tlh.capture_specs(llama, sites=sites)


@NO_ENGINE
def test_a_mamba_mixers_split_tensors_are_refused_under_tensor_parallelism():
    """Falcon-H1's mixer under tensor parallelism: each rank's input projection holds its part of each of z, x, B, C
    and dt, and its gated norm its heads' part of y and z, which a read does not join: refused where the hooks are
    placed (a worker's placement, with modules of vLLM's class names); its output, reduced across ranks, is whole."""
    config = tools.tiny_config("falcon_h1")
    taps = {site: placed.tap for site, placed in tlh._layer_sites(tlh.FAMILIES["falcon_h1"], config, 1).items()}
    modules = {"mamba_in_proj": "MergedColumnParallelLinear", "mamba_norm_in": "Mixer2RMSNormGated",
               "mamba_norm_gate": "Mixer2RMSNormGated"}
    for site, class_name in modules.items():
        module = type(class_name, (torch.nn.Module,), {})()
        with pytest.raises(ValueError, match=re.escape(taps[site].module) + ": under tensor parallelism each rank "
                           r"holds its heads' and groups' part .* tensor_parallel_size=1"):
            tlh._tensor_parallel_share(module, taps[site], 584, tlh._Ranks(0, 2, 0))
    assert tlh._tensor_parallel_share(torch.nn.Identity(), taps["mamba_out"], 128, tlh._Ranks(0, 2, 0)) is None


@NO_ENGINE
def test_latent_attentions_head_hooks_are_refused_under_tensor_parallelism():
    """DeepSeek V3's attention hooks on what its MLAAttention receives are refused under tensor parallelism, where
    the hooks are placed (a worker's placement); its latents, each rank's whole, are placed."""
    config = tools.tiny_config("deepseek_v3")
    taps = {site: placed.tap for site, placed in tlh._layer_sites(tlh.FAMILIES["deepseek_v3"], config, 1).items()}
    for site in ("attn_q", "attn_k", "attn_v", "attn_rot_q", "attn_rot_k", "attn_scores", "pattern"):
        with pytest.raises(ValueError, match=re.escape(taps[site].module) + ": multi-head latent attention's .* "
                           "tensor_parallel_size=1"):
            tlh._tensor_parallel_share(torch.nn.Identity(), taps[site], 192, tlh._Ranks(0, 2, 0))
    for site in ("attn_q_latent", "attn_kv_latent"):
        assert tlh._tensor_parallel_share(torch.nn.Identity(), taps[site], 64, tlh._Ranks(0, 2, 0)) is None


@NO_ENGINE
@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision imports here")
def test_the_vision_environments_text_families_are_those_vllm_needs_it_for():
    """VISION_TEXT_FAMILIES are exactly the text families whose vLLM module does not import without torchvision."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    needing = []
    for family in FAMILIES:
        record = tlh.FAMILIES[family]
        module, _class = _VLLM_MODELS.get(record.architecture) or _VLLM_MODELS[record.vllm_class]
        try:
            importlib.import_module(f"vllm.model_executor.models.{module}")
        except ModuleNotFoundError as error:
            assert error.name == "torchvision", f"{family}: {error}"
            needing.append(family)
    assert tuple(needing) == VISION_TEXT_FAMILIES


@NO_ENGINE
def test_capture_specs_name_a_config_that_is_not_the_checkpoints():
    """A path where the config goes, and the text part of a multimodal checkpoint's config, say what to pass."""
    for path in ("tiny", Path("tiny")):
        with pytest.raises(ValueError, match=re.escape("expected a transformers config, got ") + ".*"
                           + re.escape("pass AutoConfig.from_pretrained(path)")):
            tlh.capture_specs(path)
    llava = tools.tiny_config("llava")
    assert list(tlh.capture_specs(llava, layers=0)) == ["blocks.0.hook_resid_post"]
    with pytest.raises(ValueError, match=r"LlamaConfig \(model_type 'llama'\) names no architecture.* the text part "
                       r"of a multimodal checkpoint's config .* pass the whole checkpoint's config"):
        tlh.capture_specs(llava.get_text_config())


@NO_ENGINE
def test_every_decoder_transformer_lens_and_vllm_share_is_supported_or_refused_with_its_reason():
    """The architectures that TransformerLens 4.3's bridge adapts and vLLM's registry runs, found
    from both rather than listed: each is described by a record or refused with the reason
    measured here, and neither table names an architecture outside them."""
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES
    from vllm import ModelRegistry

    shared = {
        architecture
        for architecture in set(SUPPORTED_ARCHITECTURES) & set(ModelRegistry.get_supported_archs())
        if architecture.endswith(DECODERS)
    }
    supported = {family.architecture for family in tlh.FAMILIES.values()}
    refused = set(tlh.REFUSED)
    assert not supported & refused, f"both supported and refused: {sorted(supported & refused)}"
    assert not shared - supported - refused, f"neither supported nor refused: {sorted(shared - supported - refused)}"
    assert not (supported | refused) - shared, f"not in both registries: {sorted((supported | refused) - shared)}"
    for architecture, reason in tlh.REFUSED.items():
        config = types.SimpleNamespace(architectures=[architecture], get_text_config=lambda: None)
        with pytest.raises(ValueError, match=re.escape(f"{architecture}: refused: {reason}")):
            tlh.capture_specs(config)
    print(f"\n{len(shared)} decoders in both: {len(supported)} supported, {len(refused)} refused")


@NO_ENGINE
@pytest.mark.parametrize("page, detail", [("README.md", False), ("docs/families.md", True)])
def test_the_readmes_family_tables_are_the_records(page, detail):
    """README.md's supported and refused tables are what `python3 -m tl_vllm_hooks_tools families` prints from the
    records, word for word, and docs/families.md's what `families --detail` prints (its links made relative)."""
    text = (HERE / page).read_text()
    tables = re.search(r"<!-- families -->\n(.*?)\n<!-- /families -->", text, re.DOTALL)
    assert tables, f"{page} has no <!-- families --> ... <!-- /families --> section"
    made = tools.families_markdown(detail)
    assert tables.group(1) == (made.replace("](docs/", "](") if detail else made), (
        f"{page}'s family tables differ from the records: paste `python3 -m tl_vllm_hooks_tools families"
        f"{' --detail' if detail else ''}` between the markers"
    )


@NO_ENGINE
def test_every_record_has_one_tiny_model():
    """The companion's table of tiny test models (a dict: one entry a name) names every record, and no other."""
    missing = sorted(set(tlh.FAMILIES) - set(tools._TINY_MODELS))
    unknown = sorted(set(tools._TINY_MODELS) - set(tlh.FAMILIES))
    assert not missing and not unknown, f"records without a tiny model: {missing}; tiny models of no record: {unknown}"


@NO_ENGINE
def test_capture_specs_refuse_what_the_architecture_lacks():
    from transformers import GPTNeoXConfig, MixtralConfig, OPTConfig

    neox = GPTNeoXConfig(num_hidden_layers=2)
    neox.architectures = ["GPTNeoXForCausalLM"]
    with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM has no \['blocks.{i}.hook_resid_mid'\] \(attention and MLP"):
        tlh.capture_specs(neox, sites=("resid_post", "resid_mid"))
    unknown = GPTNeoXConfig(num_hidden_layers=2)
    unknown.architectures = ["ToyForCausalLM"]
    with pytest.raises(ValueError, match=r"architecture ToyForCausalLM: .* no record for it; supported: \['AfmoeForCausalLM'"):
        tlh.capture_specs(unknown)
    opt = OPTConfig(num_hidden_layers=2, do_layer_norm_before=False)
    opt.architectures = ["OPTForCausalLM"]
    with pytest.raises(ValueError, match=r"OPTForCausalLM with do_layer_norm_before=False: .* describes OPTForCausalLM with do_layer_norm_before=True"):
        tlh.capture_specs(opt)
    mamba2 = tools.tiny_config("mamba2")
    mamba2.n_groups = 2  # (released Mamba-2 checkpoints have 8)
    with pytest.raises(ValueError, match=r"Mamba2ForCausalLM with n_groups=2: .* describes Mamba2ForCausalLM with "
                       r"n_groups=1 only: .* TransformerLens's bridge computes them otherwise than vLLM"):
        tlh.capture_specs(mamba2)
    deepseek_v3 = tools.tiny_config("deepseek_v3")
    del deepseek_v3.scoring_func  # (vLLM then routes by softmax, without the correction bias transformers adds)
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM with scoring_func=None: .* describes "
                       r"DeepseekV3ForCausalLM with scoring_func='sigmoid' only"):
        tlh.capture_specs(deepseek_v3)
    zamba2 = tools.tiny_config("zamba2")  # a Mamba-2 layer, a hybrid one (the stream alone), a Mamba-2 layer
    no_mixer = re.escape("Zamba2ForCausalLM has no ['blocks.{i}.mixer.hook_out'] (layers [1])")
    with pytest.raises(ValueError, match=no_mixer):
        tlh.capture_specs(zamba2, sites=("mixer_out",), layers=1)
    assert list(tlh.capture_specs(zamba2, sites=("mixer_out", "resid_post"))) == [
        "blocks.0.mixer.hook_out", "blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "blocks.2.mixer.hook_out",
        "blocks.2.hook_resid_post"]
    zamba2.layers_block_type = ["linear_attention", "attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"Zamba2ForCausalLM: layer 1 is of kind 'attention' \(layers_block_type\); "
                       r"this module's record knows \['hybrid', 'linear_attention'\]"):
        tlh.capture_specs(zamba2)
    nemotron_h = tools.tiny_config("nemotron_h")  # Mamba-2, attention, MLP, Mamba-2: the mixer's ends alone on 1 and 2
    assert list(tlh.capture_specs(nemotron_h, sites=("mixer_in", "mixer_in_proj", "mixer_out"), layers=[0, 1, 2])) == [
        "blocks.0.mixer.hook_in", "blocks.0.mixer.hook_in_proj", "blocks.0.mixer.hook_out", "blocks.1.mixer.hook_in",
        "blocks.1.mixer.hook_out", "blocks.2.mixer.hook_in", "blocks.2.mixer.hook_out"]
    nemotron_h.layers_block_type = ["linear_attention", "full_attention", "moe", "linear_attention"]
    with pytest.raises(ValueError, match=r"NemotronHForCausalLM: layer 2 is of kind 'moe' \(layers_block_type\); "
                       r"this module's record knows \['full_attention', 'linear_attention', 'mlp'\]"):
        tlh.capture_specs(nemotron_h)
    mixtral = MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96)
    mixtral.architectures = ["MixtralForCausalLM"]
    assert tlh.capture_specs(mixtral, sites=("mlp_pre", "mlp_post"), layers=[1]) == {
        "blocks.1.mlp.hook_pre": (64,), "blocks.1.mlp.hook_post": (64,)
    }, "a mixture of experts: the block's input and output"


class TestFamilies:
    """Every family, batched flavour, every site TransformerLens's bridge runs on it (on
    every layer): each request's rows equal its own TransformerLens run, unedited (a
    300-token prompt chunked over three steps among them) and under an edit at each site,
    one request per site."""

    def test_every_hook_matches_transformer_lens(self, family_llm, request):
        llm = family_llm
        worst = check_batched(llm, llm.model, tolerance=llm.unedited_tolerance)
        print(f"\n{request.node.name}: {len(llm.hook_names)} hooks, worst relative error {worst:.2e}")

    def test_an_edit_at_each_site_matches_transformer_lens(self, family_llm, request):
        llm = family_llm
        worst = check_every_site_edit_per_request(llm, llm.model, tolerance=llm.tolerance)
        print(f"\n{request.node.name}: worst relative error under an edit at each site {worst:.2e}")
        for name in [name for name in llm.hook_names if read_only(name, llm.model.family)]:  # refused before it runs
            with pytest.raises(ValueError, match=re.escape(name) + ".*read-only"):
                generate(llm, [PROMPT], extra_args=[tlh.request_args(llm.config, "all", {name: {"op": "suppress"}})])
            with pytest.raises(ValueError, match=re.escape(name) + ".*read-only"):
                tlh.set_edits(llm, {name: {"op": "suppress"}})

    def test_edits_of_one_layers_sites_compose_as_in_transformer_lens(self, family_llm):
        """A request per kind of layer (layer_kinds) editing every editable site of that kind's first layer at once:
        each edit sees the ones before it (hook_resid_mid and ln2.hook_normalized share one norm)."""
        llm, family = family_llm, family_llm.model.family
        requests = []
        for layer in sorted(edited_layers(hook_shapes(llm), family)):
            edits = {
                name: {"op": "add", "value": 0.25 * torch.ones(shape)} if n % 2 else {"op": "scale", "value": 1.5}
                for n, (name, shape) in enumerate(hook_shapes(llm).items())
                if name.startswith(f"blocks.{layer}.") and not read_only(name, family)
            }
            requests.append((BATCH[2], "all", edits))
        check_per_request(llm, llm.model, requests, tolerance=llm.tolerance)

    def test_logits_and_the_logit_lens_match_transformer_lens(self, family_llm):
        check_logit_lens(family_llm, family_llm.model, BATCH[1], family_llm.tolerance)


class TestFamiliesOnePromptFlavour:
    """The one-prompt flavour (one prompt's rows per capture, edit tables of one row per hook) on
    ONE_PROMPT_FAMILIES, every site TransformerLens runs on each: unedited, then an edit at each
    site alone, whose own rows must move."""

    def test_every_site_unedited_and_edited_matches_transformer_lens(self, one_prompt_flavour_llm):
        llm = one_prompt_flavour_llm
        baseline = capture(llm, PROMPT)
        routes = engine_routes(llm.model, baseline, list(range(len(PROMPT))), len(PROMPT))
        assert_matches(baseline, llm.model.reference(PROMPT, llm.hook_names, **routes), llm.model.family, llm.tolerance)
        check_every_site_edit(llm, llm.model, baseline, tolerance=llm.tolerance)

    def test_top_k_logits_taken_in_chunks_match_the_whole_logits(self, one_prompt_flavour_llm, monkeypatch):
        """unembed's top k, which a worker takes over chunks of at most _UNEMBED_CHUNK_BYTES of logits (set here, in
        the engine's own process, to 2 rows a chunk: 5 rows in 3 chunks), against the top k of the whole logits."""
        llm = one_prompt_flavour_llm
        rows = next(t for name, t in capture(llm, PROMPT).items() if name.endswith("hook_resid_post"))[:5]
        whole = tlh.unembed(llm, rows)
        monkeypatch.setattr(tlh, "_UNEMBED_CHUNK_BYTES", 4 * whole.shape[-1] * 2)
        best, expected = tlh.unembed(llm, rows, top_k=3), whole.topk(3)
        assert torch.equal(best.indices, expected.indices)
        assert_matches({"top 3": best.values}, {"top 3": expected.values}, llm.model.family)


@NO_ENGINE
@pytest.mark.parametrize("family", FAMILIES + PLACED_HERE)
def test_each_familys_norms_have_random_weights_and_biases(models, family):
    """The tiny models (built by the module's companion) must have norm weights and biases that are not constant:
    with a constant weight (transformers' 1, or Gemma's 0 of 1 + w) a hook on the wrong side of a norm's weight
    would pass every comparison. Each is drawn around its start with a standard deviation of 0.1."""
    norms = {name: module for name, module in models[family].hf.named_modules() if "norm" in type(module).__name__.lower()}
    assert norms, f"{family}: no norm module found"
    for name, module in norms.items():
        for kind in ("weight", "bias"):
            parameter = getattr(module, kind, None)
            if isinstance(parameter, torch.nn.Parameter):
                assert parameter.float().std() > 0.05, f"{family}: {name}.{kind} is (nearly) constant"


@NO_ENGINE
@pytest.mark.parametrize("family", FAMILIES + PLACED_HERE)
def test_each_family_places_exactly_the_hooks_transformer_lens_runs(models, family):
    """No engine: capture_specs of every site gives exactly the hooks the bridge runs on every
    layer, with TransformerLens's row shapes and in forward order, less those the record refuses,
    each of which is refused by name with its reason; every other site is refused by name (for a
    multimodal checkpoint, the bridge booted on it, text prompts)."""
    model = models[family]
    record = tlh.FAMILIES[family]
    assert tlh.capture_specs(model.hf.config, sites=model.sites) == model.expected
    for site, reason in record.refused.items():
        with pytest.raises(ValueError, match=re.escape(tlh.SITES[site]) + ".*" + re.escape(reason[:40])):
            tlh.capture_specs(model.hf.config, sites=(site,))
    for site in tlh.SITES:
        if site not in model.sites and site not in record.refused:  # the bridge runs it on no layer
            with pytest.raises(ValueError, match=re.escape(tlh.SITES[site])):
                tlh.capture_specs(model.hf.config, sites=(site,))
    specs = model.expected
    for name in specs:
        if name.endswith(READ_ONLY):
            with pytest.raises(ValueError, match="read-only"):
                tlh.request_args(tlh.configure(specs, 64, enable_batching=True), "all", {name: {"op": "suppress"}})


@NO_ENGINE
@pytest.mark.parametrize("family", REFUSED_SITE_FAMILIES)
def test_each_refused_site_is_refused_for_the_reason_its_record_gives(models, family):
    """Every site a record refuses, with the reason checked as it says (check_refusal): not an assertion over the
    sites the oracle keeps, from which the refused ones are removed first."""
    model = models[family]
    with torch.no_grad():
        _logits, cache = model.bridge.run_with_cache(torch.tensor([PROMPT[:8]]))
    for site, reason in tlh.FAMILIES[family].refused.items():
        check_refusal(model, site, reason, cache)


@NO_ENGINE
@pytest.mark.parametrize("family", TOLERANCE_CLASSES)
def test_a_hook_on_the_wrong_side_of_a_norms_weight_fails_its_familys_tolerance(models, family):
    """The bounds separate meaning from noise: the final norm's rows after its weight and bias (the norm's output),
    read as ln_final.hook_normalized, fail the family's tolerance (a per-row one on every row), and the right rows
    pass it. (Gemma 4's bridge hooks no norm: there the last hook_resid_post, scaled by the final norm's weight.)"""
    model, tolerance = models[family], family_tolerance(family)
    with torch.no_grad():
        _logits, cache = model.bridge.run_with_cache(torch.tensor([PROMPT[:16]]))
    name = "ln_final.hook_normalized"
    if name in cache:
        right, wrong = cache[name][0], cache["ln_final.hook_out"][0]
    else:
        name = f"blocks.{model.hf.config.get_text_config().num_hidden_layers - 1}.hook_resid_post"
        right = cache[name][0]
        wrong = right * model.hf.get_decoder().norm.weight.detach()
    assert_matches({name: right.clone()}, {name: right}, family, tolerance)
    with pytest.raises(AssertionError, match="relative error past tolerance"):
        assert_matches({name: wrong}, {name: right}, family, tolerance)
    if isinstance(tolerance(name) if callable(tolerance) else tolerance, PerRow):
        errors = hook_row_errors(name, wrong, right)
        limit = tolerance(name) if callable(tolerance) else tolerance
        assert float(errors.min()) > limit, f"{family}: a row of the misplaced hook within {limit}: {errors}"


@pytest.mark.parametrize("family", [family for family in FAMILIES if class_default_switches(family)])
def test_every_site_offered_on_a_config_of_transformers_defaults_fires_in_transformer_lens(tmp_path, family):
    """The tiny configs' switches set back to transformers' defaults (mamba_rms_norm False for Falcon-H1, untied
    embeddings, biases, ...): every site the module offers on that config is one the bridge fires, with its row
    shapes, and every one the bridge fires is offered or refused with its reason. (Falcon-H1 offered
    mamba.inner_norm.hook_in where its mixer has no norm, which the bridge accepts and never fires.)"""
    import transformers

    config = tools.tiny_config(family)
    for key, value in class_default_switches(family).items():
        setattr(config.get_text_config(), key, value)
    torch.manual_seed(0)
    record = tlh.FAMILIES[family]
    hf = getattr(transformers, record.hf_class or record.architecture)(config).eval()
    hf.save_pretrained(tmp_path)
    hf.config.architectures = [record.architecture]  # as checkpoints name it, not as the class that saved it does
    hf.config.save_pretrained(tmp_path)
    tools._tiny_tokenizer(family).save_pretrained(tmp_path)
    model = Model(family, tmp_path, hf)
    offered = tlh.model_sites(config)
    assert set(offered) == set(model.sites), (
        f"{family} with {class_default_switches(family)}: offered, not fired: {set(offered) - set(model.sites)}; "
        f"fired, not offered: {set(model.sites) - set(offered)}"
    )
    assert tlh.capture_specs(config, sites=model.sites) == model.expected


@NO_ENGINE
@pytest.mark.parametrize("family", tuple(TRANSFORMERS_TAPS))
def test_transformers_taps_read_what_transformer_lens_reads(models, family):
    """The GPU classes' reference (transformers' modules at TRANSFORMERS_TAPS) places every site the bridge runs for
    the family, and gives TransformerLens's tensors there, unedited and under an edit at each site."""
    model = models[family]
    assert transformers_sites(family) == model.sites, "TRANSFORMERS_TAPS must place every site the bridge runs"
    names = list(model.expected)
    transformers_reference = TransformersReference(family, model.hf)
    for hook, edit in [(None, None), *site_edits(model.expected, family).items()]:
        edits = {hook: edit} if hook else {}
        expected = model.reference(PROMPT, names, edits)
        assert_matches(transformers_reference.reference(PROMPT, names, edits), expected, f"{family} {hook} {edit}")


@NO_ENGINE
def test_tokens_with_the_same_router_logits_are_one_routing_choice():
    """An edit that sets or zeroes a layer's stream gives every token the same router logits, so an engine that routes
    one of them otherwise at a near-tie routes them all so: one choice, followed once, not one per token (which would
    hold ROUTER_TIE_SHARE to correlated tokens as if each were a near-tie of its own)."""
    routing = {"choices": 0, "followed": 0, "gap": 0.0}
    logits = torch.tensor([[1.0, 0.98, 0.1, 0.0]] * 5 + [[0.0, 1.0, 0.5, 0.2], [0.3, 0.9, 0.8, 0.1]])
    own = torch.tensor([[0, 1]] * 5 + [[1, 2], [1, 2]])
    engine = torch.tensor([[1, 0]] * 5 + [[1, 2], [1, 2]])  # the five same tokens' two experts in the other order
    record_followed(routing, logits, own, engine, (own != engine).any(-1), torch.ones(7, dtype=torch.bool))
    assert (routing["choices"], routing["followed"]) == (3, 1), routing
    assert routing["gap"] == pytest.approx(0.02), routing


@NO_ENGINE
def test_both_references_follow_an_engines_other_routing_and_report_it(models):
    """Where an engine routes a token otherwise (here: token 5's two experts at layer 1 swapped, as a bf16 engine
    might at a near-tie), both references take its indices in its order, count the token, and keep the router-logit
    gap between the swapped experts, which assert_routing_ties holds to ROUTER_TIE (a swap of experts whose logits are
    far apart fails it). The other tokens' rows, and the swapped token's MLP output (the same experts, the same
    weights), stay as they were."""
    model = models["mixtral"]
    indices, weights, out = "blocks.1.mlp.hook_expert_indices", "blocks.1.mlp.hook_expert_weights", "blocks.1.hook_mlp_out"
    for reference in (TransformersReference("mixtral", model.hf), Model("mixtral", model.path, hf_model=model.hf)):
        plain = reference.reference(PROMPT, [indices, weights, out])
        engine = plain[indices].long().clone()
        engine[5] = engine[5].flip(0)
        if isinstance(reference, Model):
            followed = reference.reference(PROMPT, [indices, out], routes={1: (engine, plain[weights])})
        else:
            followed = reference.reference(PROMPT, [indices, out], routes={indices: engine})
        assert torch.equal(followed[indices].long(), engine), type(reference).__name__
        assert torch.allclose(followed[out], plain[out], rtol=1e-5, atol=1e-6), type(reference).__name__
        routing = reference.routing
        assert (routing["choices"], routing["followed"]) == (len(PROMPT), 1), routing
        assert routing["gap"] > ROUTER_TIE, f"token 5's two experts are a near-tie here: choose another token {routing}"
        with pytest.raises(AssertionError, match="wider than a near-tie"):
            assert_routing_ties(reference, "swapped")
