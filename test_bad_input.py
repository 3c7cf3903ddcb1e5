"""Bad engines and bad input refused with what would be valid, before any work is lost; loading (the plugin, the core
copied alone, register and unregister) and the config channel.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tl_vllm_hooks as tlh
from conftest import (  # the shared engines, oracles and helpers
    BATCH, HERE, MAX_TOKENS_PER_FORWARD, NO_ENGINE, PROMPT, TOLERANCE, assert_matches, capture, engine,
    engine_arguments, environment_restored, generate, relative_error, shutdown, write_sae,
)


# --- loading in spawned workers ------------------------------------------------------

PROBE = textwrap.dedent(
    """
    # As a user's script: spawned workers re-import this file, and so tl_vllm_hooks,
    # before vLLM, whose entry point or worker extension must then register it.
    import json, sys, torch
    import tl_vllm_hooks as tlh
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if __name__ == "__main__":
        model_dir, specs, extension = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "extension"
        config = tlh.configure(specs, 128, enable_batching=True)
        kwargs = config.llm_kwargs
        if not extension:
            del kwargs["worker_extension_cls"]
        llm = LLM(model_dir, dtype="float32", max_model_len=256, enforce_eager=True, skip_tokenizer_init=True,
                  gpu_memory_utilization=0.05, **kwargs)
        result = {"module": tlh.__file__}
        if extension:
            # Two requests in one batch: one read as it is, one under an edit and kept at positions 10-19.
            (hook,) = specs
            params = [SamplingParams(max_tokens=1, detokenize=False, extra_args=tlh.request_args(config, *options))
                      for options in [("prompt",), (list(range(10, 20)), {hook: {"op": "scale", "value": 0.5}})]]
            outputs = llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 21)))] * 2, params, use_tqdm=False)
            rows = tlh.read_batched(llm, [output.request_id for output in outputs])
            result["rows"] = [rows[output.request_id][hook].tolist() for output in outputs]
            result["worker_module"] = tlh.status(llm)["module"]
        result["tools_imported"] = "tl_vllm_hooks_tools" in sys.modules
        print("PROBE " + json.dumps(result), flush=True)
    """
)


def run_probe(directory: Path, model_dir: Path, specs: dict, mode: str, **env):
    """Run PROBE in a fresh interpreter: (exit code, its result or None, its log)."""
    script = directory / "probe.py"
    script.write_text(PROBE)
    environment = {**os.environ, **env}
    environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    done = subprocess.run(
        [sys.executable, str(script), str(model_dir), json.dumps(specs), mode],
        cwd=directory,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    result = json.loads(lines[-1][len("PROBE ") :]) if lines else None
    return done.returncode, result, done.stdout + done.stderr


CORE_ALONE = """
import json, sys
import torch
import tl_vllm_hooks as tlh
from tl_vllm_hooks import *  # (every public name of the core alone)
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

model, hook, sae = sys.argv[1:]
config = tlh.configure({hook: 128}, 256, torch.float32, enable_batching=True, saes={hook: sae}, sae_top_k=64)
llm = LLM(model, dtype="float32", max_model_len=512, skip_tokenizer_init=True, enforce_eager=True,
          gpu_memory_utilization=0.05, **config.llm_kwargs)
prompt = TokensPrompt(prompt_token_ids=list(range(1, 21)))
features = hook + tlh.SAE_FEATURES
options = [tlh.request_args(config, "prompt"),
           tlh.request_args(config, "prompt", {hook: {"op": "add", "value": 0.25}}),
           tlh.request_args(config, "prompt", {features: {"op": "set", "features": [3], "value": 5.0}}),
           tlh.request_args(config, "prompt")]
params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args=o) for o in options]
outputs = llm.generate([prompt] * 4, params, use_tqdm=False)
rows = tlh.read_batched(llm, [o.request_id for o in outputs])
plain, edited, featured, again = (rows[o.request_id] for o in outputs)
moved = float((featured[hook] - plain[hook]).norm() / plain[hook].norm())
print("PROBE " + json.dumps({
    "module": tlh.__file__, "tools_imported": "tl_vllm_hooks_tools" in sys.modules,
    "plain": plain[hook].tolist(), "edited": edited[hook].tolist(), "plain_again": again[hook].tolist(),
    "indices": plain[features + ".indices"].tolist(), "values": plain[features + ".values"].tolist(),
    "feature_edit_moved": moved,
}))
"""


KILLED_DRIVER = textwrap.dedent(
    """
    # A driver that holds rows mapped from its worker's row files, then waits to be killed.
    import glob, json, socket, sys, time
    import torch
    import tl_vllm_hooks as tlh
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        config = tlh.configure({"blocks.0.hook_resid_post": 128}, 128, enable_batching=True)
        llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True, skip_tokenizer_init=True,
                  gpu_memory_utilization=0.05, **config.llm_kwargs)
        outputs = llm.generate([{"prompt_token_ids": list(range(1, 30))}], SamplingParams(max_tokens=2), use_tqdm=False)
        (reply,) = llm.collective_rpc("tl_call", args=("read_batched", [outputs[0].request_id], socket.gethostname()))
        held = [tlh._map_row_file(token) for token in reply["result"]["files"]]  # as read_batched does
        worker = reply["result"]["files"][0].rpartition("#")[0].split("-")[-2]
        print("HOLDING " + json.dumps([int(worker), glob.glob(f"/dev/shm/tl_vllm_hooks-{worker}-*")]), flush=True)
        time.sleep(600)
    """
)


BAD_ENGINES = textwrap.dedent(
    """
    # Each engine below must fail to start with a clear message; then a good one
    # starts in the same process and serves, and TL_VLLM_HOOKS_DISABLE=1 lets an
    # engine with a broken config start without hooks. Engines run in this process,
    # so the module's own exception reaches the caller.
    if __name__ == "__main__":
        import json, os, sys, torch
        import tl_vllm_hooks as tlh
        from vllm import LLM
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        model_dir, unplaced_dir = sys.argv[1], sys.argv[2]
        good = {"blocks.0.hook_mlp_out": 128}
        base = dict(dtype="float32", max_model_len=256, enforce_eager=True, skip_tokenizer_init=True,
                    gpu_memory_utilization=0.05)
        attempts = {
            "path": ({"h": ("model.layers.0.mpl", 128)}, 128, {}),
            "width": ({"h": ("model.layers.0.mlp.down_proj", 64)}, 128, {}),
            "shape": ({"blocks.0.hook_mlp_out": 64}, 128, {}),
            "layer": ({"blocks.3.hook_mlp_out": 128}, 128, {}),
            "architecture": (good, 128, {"model": unplaced_dir}),
            "prefix": (good, 128, {"enable_prefix_caching": True}),
            "rows": (good, 64, {"max_num_batched_tokens": 128}),
        }
        refused = {}
        for name, (specs, rows, overrides) in attempts.items():
            config = tlh.configure(specs, rows)
            try:
                LLM(**{"model": model_dir, **base, **config.llm_kwargs, **overrides})
                refused[name] = "started"
            except ValueError as error:
                refused[name] = type(error).__name__
                print(f"{name}: {error}", flush=True)
            cleanup_dist_env_and_memory()
        llm = LLM(model_dir, **base, **tlh.configure(good, 128).llm_kwargs)
        hooks = tlh.status(llm)["hooks"]
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
        os.environ["TL_VLLM_HOOKS_DISABLE"] = "1"
        llm = LLM(model_dir, **base, **tlh.configure(attempts["path"][0], 128).llm_kwargs)
        try:
            tlh.read_fire_counts(llm)
            disabled = "hooks installed"
        except RuntimeError as error:
            disabled = str(error)
        print("PROBE " + json.dumps({"refused": refused, "hooks": hooks, "disabled": disabled}), flush=True)
    """
)


# --- pure helpers ------------------------------------------------------------


@NO_ENGINE
class TestConfigChannel:
    SPECS = {"blocks.0.hook_resid_post": (128,), "blocks.0.attn.hook_z": (2, 64), "gate_up": ("model.layers.0.mlp.gate_up_proj", 512)}

    def test_round_trip(self):
        config = tlh.CaptureConfig(self.SPECS, 64, torch.bfloat16, True, True)
        assert tlh.CaptureConfig.from_json(config.to_json()) == config

    @pytest.mark.parametrize(
        "kwargs, field",
        [
            (dict(capture_specs=[]), "capture_specs"),
            (dict(capture_specs={"h": ("model.layers.0",)}), r"\(module_path: str, width: positive int\)"),
            (dict(capture_specs={"h": ("model.layers.0", 0)}), "width: positive int"),
            (dict(capture_specs={"h": ("model.layers.0", 1.5)}), "width: positive int"),
            (dict(capture_specs={"h": ("model.layers.0", True)}), "width: positive int"),
            (dict(capture_specs={"blocks.0.hook_resid_post": ("model.layers.0", 128)}), "takes no module path"),
            (dict(capture_specs={"blocks.0.hook_resid_post": (128, 0)}), "the shape of one row"),
            (dict(capture_specs={"blocks.0.hook_resid_pots": 128}), "close matches: \\['blocks.0.hook_resid_post'"),
            (dict(capture_specs={"blocks.0.attn.hook_result": 128}), "not a hook this module knows"),
            (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
            (dict(max_num_batched_tokens="64"), "max_num_batched_tokens"),
            (dict(dtype=torch.int8), "dtype"),
            (dict(dtype="float32"), "dtype"),
            (dict(enable_batching=1), "enable_batching"),
            (dict(shard_seconds=0), "shard_seconds"),
            (dict(shard_seconds=float("nan")), "shard_seconds"),
            (dict(shard_seconds=True), "shard_seconds"),
            (dict(shard_seconds="1"), "shard_seconds"),
            (dict(logit_lens={"blocks.0.hook_resid_post": 5}), r"logit_lens: .*enable_batching=True"),
            (dict(enable_batching=True, logit_lens=["blocks.0.hook_resid_post"]), r"logit_lens: a dict"),
            (dict(enable_batching=True, logit_lens={"blocks.0.hook_resid_pre": 5}), "not a residual-stream hook in "
             r"capture_specs; those are \['blocks.0.hook_resid_post'\]"),
            (dict(enable_batching=True, logit_lens={"blocks.0.hook_resid_post": 0}), "k must be a positive int"),
            (dict(enable_batching=True, logit_lens={"blocks.0.hook_resid_post": True}), "k must be a positive int"),
        ],
    )
    def test_bad_config_names_the_field(self, kwargs, field):
        arguments = dict(capture_specs=self.SPECS, max_num_batched_tokens=64, dtype=torch.float32)
        arguments.update(kwargs)
        with pytest.raises(ValueError, match=field):
            tlh.configure(**arguments)

    @pytest.mark.parametrize(
        "mangle, field",
        [
            (lambda d: "{not json", "JSON"),
            (lambda d: json.dumps({**d, "dtype": "float8"}), "dtype"),
            (lambda d: json.dumps({**d, "version": "0.0.1"}), "version"),
            (lambda d: json.dumps({k: v for k, v in d.items() if k != "dtype"}), "missing"),
            (lambda d: json.dumps({**d, "extra": 1}), "unknown"),
            (lambda d: json.dumps({**d, "max_num_batched_tokens": -3}), "max_num_batched_tokens"),
        ],
    )
    def test_corrupted_payload_names_the_problem(self, mangle, field):
        good = json.loads(tlh.CaptureConfig(self.SPECS, 64, torch.float32).to_json())
        with pytest.raises(ValueError, match=field):
            tlh.CaptureConfig.from_json(mangle(good))

    def test_llm_kwargs_carry_the_config_and_what_the_engine_needs(self):
        config = tlh.configure(self.SPECS, 64, torch.bfloat16, enable_batching=True)
        kwargs = config.llm_kwargs
        assert kwargs["worker_extension_cls"] == tlh.WORKER_EXTENSION == "tl_vllm_hooks.WorkerExtension"
        assert kwargs["max_num_batched_tokens"] == 64 and kwargs["enable_prefix_caching"] is False
        (payload,) = kwargs["additional_config"].values()
        assert tlh.CaptureConfig.from_json(payload) == config
        assert "TL_VLLM_HOOKS_CONFIG" not in os.environ, "configure must leave nothing behind for later engines"

    def test_serve_args_carry_the_same_for_the_command_line(self):
        batched = tlh.configure(self.SPECS, 64, torch.bfloat16, enable_batching=True)
        args = batched.serve_args
        assert args[:2] == ["--worker-extension-cls", "tl_vllm_hooks.WorkerExtension"]
        assert args[args.index("--max-num-batched-tokens") + 1] == "64"
        (payload,) = json.loads(args[args.index("--additional-config") + 1]).values()
        assert tlh.CaptureConfig.from_json(payload) == batched
        # One prefix-caching setting for both: a request without options keeps every row either way.
        assert args[-1] == "--no-enable-prefix-caching" and batched.llm_kwargs["enable_prefix_caching"] is False
        assert tlh.configure(self.SPECS, 64).serve_args[-1] == "--no-enable-prefix-caching"


@NO_ENGINE
def test_the_core_imports_nothing_of_its_companion():
    """tl_vllm_hooks.py holds no import of tl_vllm_hooks_tools, at its top or inside a function, and loads no module by
    a name it writes itself: it names the companion only as the default sink writer, which it loads by the name a
    config carries (the copy-alone test checks the same at run time)."""
    tree = ast.parse((HERE / "tl_vllm_hooks.py").read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.startswith("tl_vllm_hooks")], imported
    loads = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) in
             ("importlib.import_module", "__import__")]
    assert [ast.unparse(node.args[0]) for node in loads] == ["module_name"], "only _sink_writer loads by name"


@NO_ENGINE
def test_unregister_puts_back_every_attribute_register_patched():
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_worker import Worker

    tlh.register()
    patched = {(owner, name): original for owner, record in tlh._originals.items() for name, original in record.items()}
    assert set(patched) >= {(Worker, "load_model"), (InputProcessor, "process_inputs")}
    try:
        tlh.unregister()
        assert all(owner.__dict__[name] is original for (owner, name), original in patched.items() if isinstance(owner, type))
    finally:
        tlh.register()  # as every other test expects
    assert Worker.load_model is not patched[(Worker, "load_model")]


class TestEngineChecks:
    """Engines of their own: the engine a request is checked against, hooks removed, no config, the compile cache.
    Those that need no second process run in this one (each separate engine spawns two
    processes that import vLLM again: ~35 s)."""

    def test_requests_are_checked_against_the_engine_they_go_to(self, models):
        """With a one-prompt and a batched engine in one process, built in either order, a request
        with per-request options is taken by the batched engine and refused by the one-prompt one;
        its SamplingParams, made while only the one-prompt engine exists, are not refused.
        The check is the driver's (each engine's InputProcessor, against its own config): the
        three engines run wholly in this process, where the engine cores and workers of all
        three meet too."""
        from vllm import SamplingParams

        model, prompt, sites = models["llama"], {"prompt_token_ids": PROMPT}, ("resid_post",)
        batched_config = tlh.configure(
            tlh.capture_specs(model.hf.config, sites=sites), MAX_TOKENS_PER_FORWARD, enable_batching=True
        )

        def check(one_prompt, batched, params):
            with pytest.raises(ValueError, match="this engine has one-prompt hooks"):
                one_prompt.generate(prompt, params, use_tqdm=False)
            (output,) = batched.generate(prompt, params, use_tqdm=False)
            rows = tlh.read_batched(batched, [output.request_id])[output.request_id]
            assert_matches(rows, model.reference(PROMPT, list(rows)))

        with engine(model, sites=sites, in_process=True, eager=True) as one_prompt_first:
            params = SamplingParams(max_tokens=1, detokenize=False, extra_args=tlh.request_args(batched_config, "prompt"))
            with engine(model, sites=sites, in_process=True, eager=True, batching=True) as batched:
                check(one_prompt_first, batched, params)
                with engine(model, sites=sites, in_process=True, eager=True) as one_prompt_after:
                    check(one_prompt_after, batched, params)

    def test_remove_hooks_takes_edits_out_of_an_eager_engine(self, models):
        with engine(models["llama"], sites=("final_norm",), in_process=True, eager=True, batching=True) as llm:
            (plain,) = generate(llm, BATCH[:1], max_tokens=4)
            tlh.set_edits(llm, {"ln_final.hook_normalized": {"op": "suppress"}})
            (suppressed,) = generate(llm, BATCH[:1], max_tokens=4)
            assert list(suppressed.outputs[0].token_ids) == [0, 0, 0, 0], "all-zero logits pick token 0"
            tlh.remove_hooks(llm)
            (after,) = generate(llm, BATCH[:1], max_tokens=4)
            assert list(after.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
            with pytest.raises(RuntimeError, match="this engine has no hooks"):
                tlh.read_batched(llm, [after.request_id])

    def test_config_in_the_environment_reaches_spawned_workers(self, models):
        """For servers one does not construct: TL_VLLM_HOOKS_CONFIG instead of additional_config."""
        from vllm import LLM

        model = models["llama"]
        config = tlh.configure(tlh.capture_specs(model.hf.config, sites=("mlp_out",), layers=[1]), MAX_TOKENS_PER_FORWARD)
        kwargs = {key: value for key, value in config.llm_kwargs.items() if key != "additional_config"}
        with environment_restored(VLLM_ENABLE_V1_MULTIPROCESSING="1", TL_VLLM_HOOKS_CONFIG=config.to_json()):
            llm = LLM(str(model.path), **engine_arguments(), enforce_eager=True, **kwargs)
            try:
                assert_matches(capture(llm, PROMPT), model.reference(PROMPT, ["blocks.1.hook_mlp_out"]))
            finally:
                shutdown(llm, in_process=False)

    def test_engine_built_without_the_config_has_no_hooks(self, models):
        from vllm import LLM

        config = tlh.configure({"layer0": ("model.layers.0", 128)}, MAX_TOKENS_PER_FORWARD)
        with environment_restored(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
            llm = LLM(str(models["qwen2"].path), **engine_arguments(), enforce_eager=True,
                      worker_extension_cls=config.llm_kwargs["worker_extension_cls"])
            try:
                generate(llm, [PROMPT])
                with pytest.raises(RuntimeError, match=re.escape("this engine has no hooks: build it with LLM(model, **")):
                    tlh.read_fire_counts(llm)
            finally:
                shutdown(llm, in_process=True)

    def test_compile_cache_never_serves_a_graph_traced_for_other_hooks(self, models, tmp_path, monkeypatch):
        """vLLM keys its on-disk compile cache by its config, which knows no hooks.

        Three compiled engines share one cache directory: hooks on one site, on
        another, then the first again. Each must run exactly its own hooks, and
        the two configs must get two cache entries (one, without the module's key).

        On the CPU the three run in this process (no six worker processes to start).
        vLLM 0.32's CPU build cannot load its own entry, in this process or in a fresh
        one ("'function' object has no attribute 'finalize_loading'"): the third compiles
        again, so there the entries on disk and each engine's own hooks are what is
        checked, as they were with separate processes. On GPUs the engines stay in
        separate processes, where a loadable entry serves the third.
        """
        cache = tmp_path / "vllm-cache"
        monkeypatch.setenv("VLLM_CACHE_ROOT", str(cache))
        # vLLM points inductor's cache into the entry it compiles for, in os.environ: put it back after.
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        model = models["llama"]
        for sites in [("resid_post",), ("mlp_out",), ("resid_post",)]:
            with engine(model, sites=sites, in_process=not torch.cuda.is_available(), eager=False) as llm:
                tlh.reset_fire_counts(llm)
                captured = capture(llm, PROMPT)
                assert set(tlh.read_fire_counts(llm).values()) == {1}, tlh.read_fire_counts(llm)
                assert_matches(captured, model.reference(PROMPT, llm.hook_names), f"cache, {sites}")
        entries = sorted(p.name for p in cache.glob("torch_compile_cache/*/*") if p.is_dir())
        assert len(entries) == 2, f"expected one compile-cache entry per hook config, got {entries}"


class TestLoading:
    """Spawned workers: the copied-in core, the installed entry point, engine configs refused at startup."""

    def test_copied_in_file_works_in_spawned_workers(self, tmp_path, models):
        (tmp_path / "tl_vllm_hooks.py").write_text((HERE / "tl_vllm_hooks.py").read_text())
        # VLLM_PLUGINS="" keeps an installed entry point from loading: only the copy runs.
        code, result, log = run_probe(
            tmp_path, models["llama"].path, {"blocks.0.hook_resid_post": 128}, "extension", VLLM_PLUGINS=""
        )
        assert code == 0 and result, f"probe failed:\n{log[-4000:]}"
        copy = str(tmp_path / "tl_vllm_hooks.py")
        assert result["module"] == copy and result["worker_module"] == copy, result["worker_module"]
        assert not result["tools_imported"], "the core alone imported its companion"
        hook, prompt = "blocks.0.hook_resid_post", list(range(1, 21))
        plain = models["llama"].reference(prompt, [hook])[hook]
        edited = models["llama"].reference(prompt, [hook], {hook: {"op": "scale", "value": 0.5}})[hook]
        assert relative_error(torch.tensor(result["rows"][0]), plain) <= TOLERANCE
        assert relative_error(torch.tensor(result["rows"][1]), edited[10:]) <= TOLERANCE

    def test_the_core_copied_in_alone_captures_edits_per_request_and_runs_an_sae(self, tmp_path, models):
        """tl_vllm_hooks.py alone in an empty directory (a tl_vllm_hooks_tools.py there that refuses to import stands
        for its absence; the installed entry point off): the batched flavour keeps each request's rows, a request's
        own edit and its SAE feature edit change only its rows, and the SAE's features are read, all as
        TransformerLens computes them."""
        (tmp_path / "tl_vllm_hooks.py").write_text((HERE / "tl_vllm_hooks.py").read_text())
        (tmp_path / "tl_vllm_hooks_tools.py").write_text('raise ImportError("the core imported its companion")\n')
        hook = "blocks.1.hook_resid_post"
        write_sae(tmp_path / "sae", hook=hook, d_sae=64)
        script = tmp_path / "alone.py"
        script.write_text(CORE_ALONE)
        environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": ""}
        environment.pop("PYTHONPATH", None)
        done = subprocess.run([sys.executable, str(script), str(models["llama"].path), hook, str(tmp_path / "sae")],
                              cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
        lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
        assert done.returncode == 0 and lines, f"the copied core failed:\n{(done.stdout + done.stderr)[-4000:]}"
        result = json.loads(lines[-1][len("PROBE "):])
        assert result["module"] == str(tmp_path / "tl_vllm_hooks.py") and not result["tools_imported"]
        prompt, edit = list(range(1, 21)), {hook: {"op": "add", "value": 0.25}}
        plain, edited = (models["llama"].reference(prompt, [hook], edits)[hook] for edits in (None, edit))
        assert relative_error(torch.tensor(result["plain"]), plain) <= TOLERANCE
        assert relative_error(torch.tensor(result["edited"]), edited) <= TOLERANCE
        assert relative_error(torch.tensor(result["plain"]), edited) > 0.01, "the edit changed nothing"
        from safetensors.torch import load_file

        weights = load_file(str(tmp_path / "sae" / "sae_weights.safetensors"))  # a standard SAE's encode, by hand
        sae = ((plain - weights["b_dec"]) @ weights["W_enc"] + weights["b_enc"]).relu()
        top = torch.zeros_like(sae).scatter_(1, torch.tensor(result["indices"]).long(), torch.tensor(result["values"]))
        assert relative_error(top, sae) <= 1e-5, "the SAE's features are SAELens's encode of the rows"
        assert result["feature_edit_moved"] > 0.01 and result["plain_again"] == result["plain"]

    def test_installed_entry_point_installs_hooks_in_spawned_worker(self, tmp_path, models):
        from importlib.metadata import entry_points

        names = [e.value for e in entry_points(group="vllm.general_plugins")]
        assert "tl_vllm_hooks:register" in names, "the tests need the package pip-installed: pip install -e '.[cpu,test]'"
        # No worker_extension_cls: only the entry point can bring the module into
        # the worker. A misspelt module path then fails the worker's model load,
        # with the close match named, which proves the hooks were being installed.
        code, _result, log = run_probe(tmp_path, models["llama"].path, {"probe": ["model.layers.0.mlpp", 128]}, "plain")
        assert code != 0, "the engine started although its hook path does not exist"
        assert "'model.layers.0.mlpp' does not exist" in log and "model.layers.0.mlp" in log, log[-3000:]

    def test_a_killed_job_leaves_no_row_files_once_the_next_engine_installs(self, tmp_path, models):
        """A driver killed with its engine (its process group, as a shell or scheduler kills a job)
        while it holds rows: the row files its worker made are removed by the next install."""
        script = tmp_path / "driver.py"
        script.write_text(KILLED_DRIVER)
        environment = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        driver = subprocess.Popen(
            [sys.executable, str(script), str(models["llama"].path)], cwd=tmp_path, env=environment,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )
        try:
            line = next((line for line in driver.stdout if line.startswith("HOLDING ")), None)
            assert line is not None, "the driver died before it held rows"
            worker_pid, files = json.loads(line[len("HOLDING "):])
            assert files and all(os.path.exists(path) for path in files)
        finally:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and os.path.exists(f"/proc/{worker_pid}"):
            time.sleep(0.2)
        assert glob.glob(f"/dev/shm/tl_vllm_hooks-{worker_pid}-*"), "a killed worker cannot remove its files"
        tlh._sweep_shared_files()  # what the next engine's install runs
        assert glob.glob(f"/dev/shm/tl_vllm_hooks-{worker_pid}-*") == []

    def test_bad_engine_configs_are_refused_at_startup(self, tmp_path, models):
        script = tmp_path / "bad_engines.py"
        script.write_text(BAD_ENGINES)
        # The Llama's weights under an architecture no record places: vLLM
        # serves it (with its Llama class), and the TransformerLens names must be refused.
        unplaced = tmp_path / "internlm3"
        shutil.copytree(models["llama"].path, unplaced)
        config = json.loads((unplaced / "config.json").read_text())
        (unplaced / "config.json").write_text(json.dumps({**config, "architectures": ["InternLM3ForCausalLM"]}))
        environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        done = subprocess.run(
            [sys.executable, str(script), str(models["llama"].path), str(unplaced)],
            cwd=HERE, env=environment, capture_output=True, text=True, timeout=600,
        )
        log = done.stdout + done.stderr
        lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
        assert done.returncode == 0 and lines, f"probe failed:\n{log[-4000:]}"
        result = json.loads(lines[-1][len("PROBE ") :])
        assert set(result["refused"].values()) == {"ValueError"}, f"engines that started anyway: {result['refused']}"
        for message in [
            "'model.layers.0.mpl' does not exist in LlamaForCausalLM; close matches: ['model.layers.0.mlp'",
            "capture_specs['h']: width 64, but model.layers.0.mlp.down_proj (RowParallelLinear) outputs rows of 128",
            "row shape (64,), but this model's blocks.0.hook_mlp_out has rows of (128,)",
            "blocks.3.hook_mlp_out: the model has 3 layers",
            "architecture InternLM3ForCausalLM: TransformerLens hook names are placed per architecture and this "
            "module has no record for it; supported: ['AfmoeForCausalLM', 'ApertusForCausalLM', 'ArceeForCausalLM'",
            "enable_prefix_caching: the one-prompt flavour keeps the rows of one forward, and tokens served from vLLM's",
            "the engine schedules up to 128 tokens per forward but the capture buffers hold 64",
        ]:
            assert message in log, f"missing error message: {message}"
        assert result["hooks"] == ["blocks.0.hook_mlp_out"], "the good engine after the bad ones has no hooks"
        assert "this engine has no hooks" in result["disabled"], result["disabled"]
