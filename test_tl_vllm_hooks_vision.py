"""Multimodal checkpoints (a text model beside vision or audio towers) against TransformerLens, as
test_tl_vllm_hooks.py compares the text families, with its helpers.

Runs in the environment scripts/vision_env.sh builds, where torchvision imports: vLLM's native
multimodal classes import transformers' image processors, which import torchvision, and
TransformerLens 4.3's Qwen-VL adapters require it (test_tl_vllm_hooks.py runs this file there,
test_multimodal_checkpoints_in_the_vision_environment). For every multimodal record, in the
batched flavour (in the one-prompt flavour too where it is among base.ONE_PROMPT_FAMILIES): every
hook of its text model on text prompts (vLLM with language_model_only=True, the towers not built),
unedited and under an edit at each site, a 300-token prompt chunked among them; and one LLaVA
image prompt through the towers.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import test_tl_vllm_hooks as base
import tl_vllm_hooks as tlh

assert importlib.util.find_spec("torchvision") is not None, (
    "test_tl_vllm_hooks_vision.py runs where torchvision imports: the python that scripts/vision_env.sh prints"
)

MULTIMODAL = base.MULTIMODAL
# vLLM runs the text model alone (no tower is built) and reads the checkpoint's tokenizer.
TEXT_ONLY = dict(language_model_only=True, skip_tokenizer_init=False)
# Each record shares its text family's engine arguments and tolerances (see test_tl_vllm_hooks.py).
TEXT_FAMILY = {"gemma4_mm": "gemma4", "gemma4_unified": "gemma4", "llama4_mm": "llama4"}


def engine_arguments(family: str) -> dict:
    text_only = TEXT_ONLY if family in MULTIMODAL else {}
    return {**text_only, **base.family_engine_arguments(TEXT_FAMILY.get(family, family))}


def tolerance(family: str):
    return base.family_tolerance(TEXT_FAMILY.get(family, family))


def unedited_tolerance(family: str):
    return base.unedited_tolerance(TEXT_FAMILY.get(family, family))


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    return base.Models(tmp_path_factory.mktemp("models"))


# The multimodal records, and the text families whose vLLM class needs torchvision (base.VISION_TEXT_FAMILIES).
HERE_FAMILIES = MULTIMODAL + base.VISION_TEXT_FAMILIES


@pytest.fixture(scope="class", params=HERE_FAMILIES)
def family_llm(request, models):
    model = models[request.param]
    with base.engine(model, sites=model.sites, in_process=True, eager=True, batching=True,
                     **engine_arguments(request.param)) as llm:
        llm.model = model
        llm.tolerance, llm.unedited_tolerance = tolerance(request.param), unedited_tolerance(request.param)
        yield llm


class TestMultimodalFamilies(base.TestFamilies):
    """TestFamilies on each multimodal checkpoint's text model: batched flavour, every site the
    bridge runs, unedited (a 300-token prompt chunked over three steps among the requests) and
    under an edit at each site, one request per site, and one layer's edits composed."""


@pytest.fixture(scope="class", params=[family for family in base.ONE_PROMPT_FAMILIES if family in HERE_FAMILIES])
def one_prompt_flavour_llm(request, models):
    model = models[request.param]
    with base.engine(model, sites=model.sites, in_process=True, eager=True, **engine_arguments(request.param)) as llm:
        llm.model = model
        llm.tolerance = tolerance(request.param)
        yield llm


class TestMultimodalFamiliesOnePromptFlavour(base.TestFamiliesOnePromptFlavour):
    """TestFamiliesOnePromptFlavour on the multimodal records among base.ONE_PROMPT_FAMILIES."""


@base.NO_ENGINE
@pytest.mark.parametrize("family", MULTIMODAL)
def test_each_multimodal_checkpoint_places_exactly_the_hooks_transformer_lens_runs(models, family):
    """test_each_family_places_exactly_the_hooks_transformer_lens_runs, for every multimodal record
    (test_tl_vllm_hooks.py checks those whose checkpoint and bridge need no torchvision): the bridge
    booted on the multimodal checkpoint, text prompts."""
    base.test_each_family_places_exactly_the_hooks_transformer_lens_runs(models, family)


@base.NO_ENGINE
@pytest.mark.parametrize("family", MULTIMODAL)
def test_each_multimodal_checkpoint_refuses_attention_scores_exactly_where_transformer_lens_gives_the_pattern(
    models, family
):
    """test_attention_scores_are_refused_exactly_where_transformer_lens_gives_the_pattern_there, for every multimodal
    record."""
    base.test_attention_scores_are_refused_exactly_where_transformer_lens_gives_the_pattern_there(models, family)


IMAGE_TEXT = "t5 t6 {} t7 t8"


def image():
    from PIL import Image

    return Image.fromarray((np.random.RandomState(0).rand(56, 56, 3) * 255).astype("uint8"))


def test_an_image_prompt_matches_transformer_lens_at_every_position(models):
    """LLaVA with its towers (vLLM's native class, without language_model_only), one prompt of
    text around an image: vLLM's prompt ids are the processor's, and the text model's rows at
    every position, image positions included, equal TransformerLens's bridge run on the same
    input_ids and pixel_values from the same processor (E measured logprobs within 3.8e-6).

    At image positions hook_embed is the embedding of the image placeholder token (in vLLM as in
    TransformerLens: the image features replace it after the embedding), so the text model's input
    there, the image features, is blocks.0.hook_resid_pre, not hook_embed."""
    from transformers import AutoProcessor
    from vllm import SamplingParams

    model = models["llava"]
    processor = AutoProcessor.from_pretrained(str(model.path))
    text = IMAGE_TEXT.format(processor.image_token)
    inputs = processor(images=image(), text=text, return_tensors="pt")
    token_ids = inputs["input_ids"][0].tolist()
    image_positions = [p for p, t in enumerate(token_ids) if t == model.hf.config.image_token_index]
    assert image_positions, f"no image token in {token_ids}"
    with base.engine(model, sites=model.sites, in_process=True, eager=True, skip_tokenizer_init=False) as llm:
        tlh.open_capture(llm)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
        outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": image()}}], params, use_tqdm=False)
        assert list(outputs[0].prompt_token_ids) == token_ids, "vLLM's prompt ids are not the processor's"
        captured = tlh.read_captures(llm, len(token_ids))
    expected = model.reference(
        token_ids, llm.hook_names, pixel_values=inputs["pixel_values"], attention_mask=inputs["attention_mask"]
    )
    worst = base.assert_matches(captured, expected, "image prompt")
    embedded = model.hf.get_input_embeddings().weight[model.hf.config.image_token_index]
    assert torch.allclose(captured["hook_embed"][image_positions], embedded.expand(len(image_positions), -1))
    text_input = captured["blocks.0.hook_resid_pre"][image_positions]
    assert base.relative_error(text_input, captured["hook_embed"][image_positions]) > 0.1, "no image features"
    print(f"\nimage prompt: {len(token_ids)} positions ({len(image_positions)} image), worst relative error {worst:.2e}")


sae_lens_python = base.sae_lens_python  # (the fixture, here too)


def test_saes_read_and_edit_a_linear_attention_familys_hooks(sae_lens_python, models, tmp_path):
    """SAEs and a transcoder on Qwen 3.5's first layer (Gated DeltaNet, then a dense MLP), as
    base.check_first_layer_saes checks them on DeepSeek's."""
    oracle = base.SAEOracle(models["qwen3_5"], tmp_path, base.FIRST_LAYER_SAE_KINDS)
    base.made_by_sae_lens(sae_lens_python, [oracle], tmp_path)
    base.check_first_layer_saes(oracle, tolerance("qwen3_5"), engine_arguments("qwen3_5"))
