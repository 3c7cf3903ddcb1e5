"""SAELens oracle for the tests: run with the python printed by `bash scripts/sae_env.sh`.

All I/O goes through safetensors files, a SAELens save dir (cfg.json + sae_weights.safetensors)
and JSON; nothing is pickled. Uses sae-lens's own classes, save_model and SAE.load_from_disk.

  make   --architecture ARCH --d-in N --d-sae M --hook-name NAME [--d-out D] [--k K]
         [--apply-b-dec-to-input 0/1] [--normalize-activations MODE] [--seed S] --out DIR
      Random SAE/transcoder with all parameters random and non-trivial, saved with
      sae.save_model(DIR). ARCH: standard, jumprelu, topk, transcoder, skip_transcoder,
      jumprelu_transcoder, jumprelu_skip_transcoder. Prints a JSON summary to stdout.
  encode --sae DIR --acts FILE --out FILE
      SAE.load_from_disk(DIR, device="cpu", dtype="float32"); for every tensor K in the
      safetensors FILE (fp32, [n, d_in]) writes K = sae.encode(x) [n, d_sae] (dense fp32) and
      K.decoded = sae.decode(sae.encode(x)); for skip transcoders also K.forward = sae(x)
      (decode + x @ W_skip.T).
  batch  --jobs FILE.json
      FILE.json is a list of argument lists, e.g. [["make", "--architecture", "topk", ...],
      ["encode", "--sae", ...]]; runs them in one process (importing sae_lens costs ~10 s).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SAE_ARCHS = ("standard", "jumprelu", "topk")
TRANSCODER_ARCHS = (
    "transcoder",
    "skip_transcoder",
    "jumprelu_transcoder",
    "jumprelu_skip_transcoder",
)
ARCHS = SAE_ARCHS + TRANSCODER_ARCHS
NORM_MODES = (
    "none",
    "expected_average_only_in",
    "constant_norm_rescale",
    "layer_norm",
    "covariance_whitening",
)


def _bool01(s: str) -> bool:
    if s not in ("0", "1", "true", "false", "True", "False"):
        raise argparse.ArgumentTypeError(f"expected 0/1, got {s!r}")
    return s in ("1", "true", "True")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sae_oracle.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make", help="build a random SAE and save it with save_model")
    m.add_argument("--architecture", required=True, choices=ARCHS)
    m.add_argument("--d-in", type=int, required=True)
    m.add_argument("--d-sae", type=int, required=True)
    m.add_argument(
        "--d-out", type=int, default=None, help="transcoders only (default: d_in)"
    )
    m.add_argument(
        "--hook-name", required=True, help="stored as cfg.metadata.hook_name"
    )
    m.add_argument(
        "--hook-name-out", default=None, help="transcoders: cfg.metadata.hook_name_out"
    )
    m.add_argument("--model-name", default=None, help="cfg.metadata.model_name")
    m.add_argument(
        "--k", type=int, default=None, help="topk only (default: max(1, d_sae // 8))"
    )
    m.add_argument(
        "--rescale-acts-by-decoder-norm",
        type=_bool01,
        default=False,
        help="topk only, 0/1",
    )
    m.add_argument(
        "--apply-b-dec-to-input",
        type=_bool01,
        default=None,
        help="0/1; default 1 for SAEs (SAEConfig default), 0 for transcoders "
        "(sae-lens refuses 1 there)",
    )
    m.add_argument("--normalize-activations", default="none", choices=NORM_MODES)
    m.add_argument(
        "--input-scale",
        type=float,
        default=1.0,
        help="std of the inputs the SAE is calibrated for (default 1.0)",
    )
    m.add_argument(
        "--metadata", default=None, help="JSON object of extra cfg.metadata keys"
    )
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", required=True)

    e = sub.add_parser(
        "encode", help="encode/decode every tensor of a safetensors file"
    )
    e.add_argument("--sae", required=True, help="SAELens save dir (cfg.json + weights)")
    e.add_argument(
        "--acts", required=True, help="safetensors file of [n, d_in] tensors"
    )
    e.add_argument("--out", required=True, help="safetensors file to write")

    b = sub.add_parser("batch", help="run several make/encode jobs in one process")
    b.add_argument("--jobs", required=True, help="JSON file: list of argument lists")
    return p


# ---------------------------------------------------------------------------------------- make


def _config(args, d_out: int, apply: bool):
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata

    meta = {"hook_name": args.hook_name}
    if args.model_name is not None:
        meta["model_name"] = args.model_name
    if args.architecture in TRANSCODER_ARCHS:
        meta["hook_name_out"] = args.hook_name_out
    if args.metadata:
        extra = json.loads(args.metadata)
        if not isinstance(extra, dict):
            raise SystemExit("--metadata must be a JSON object")
        meta.update(extra)
    common = {
        "d_in": args.d_in,
        "d_sae": args.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": apply,
        "normalize_activations": args.normalize_activations,
        "metadata": SAEMetadata(**meta),
    }
    a = args.architecture
    if a == "standard":
        return sae_lens.StandardSAE, sae_lens.StandardSAEConfig(**common)
    if a == "jumprelu":
        return sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig(**common)
    if a == "topk":
        k = args.k if args.k is not None else max(1, args.d_sae // 8)
        if not 1 <= k <= args.d_sae:
            raise SystemExit(f"--k must be in [1, d_sae], got {k}")
        return sae_lens.TopKSAE, sae_lens.TopKSAEConfig(
            k=k,
            rescale_acts_by_decoder_norm=args.rescale_acts_by_decoder_norm,
            **common,
        )
    cls_cfg = {
        "transcoder": ("Transcoder", "TranscoderConfig"),
        "skip_transcoder": ("SkipTranscoder", "SkipTranscoderConfig"),
        "jumprelu_transcoder": ("JumpReLUTranscoder", "JumpReLUTranscoderConfig"),
        "jumprelu_skip_transcoder": (
            "JumpReLUSkipTranscoder",
            "JumpReLUSkipTranscoderConfig",
        ),
    }[a]
    return getattr(sae_lens, cls_cfg[0]), getattr(sae_lens, cls_cfg[1])(
        d_out=d_out, **common
    )


@torch.no_grad()
def cmd_make(args) -> dict:
    a = args.architecture
    is_tc = a in TRANSCODER_ARCHS
    if args.d_out is not None and not is_tc:
        raise SystemExit("--d-out is for transcoders only")
    if args.k is not None and a != "topk":
        raise SystemExit("--k is for topk only")
    d_in, d_sae = args.d_in, args.d_sae
    d_out = (args.d_out if args.d_out is not None else d_in) if is_tc else d_in
    apply = args.apply_b_dec_to_input
    if apply is None:
        apply = not is_tc
    sae_cls, cfg = _config(args, d_out, apply)
    sae = sae_cls(cfg)

    g = torch.Generator().manual_seed(args.seed)
    s = args.input_scale

    def randn(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std + mean

    # Calibration inputs, as the tests are expected to feed (N(0, s^2) per coordinate). With
    # normalize_activations the SAE sees the normalised input, so calibrate on that.
    x = randn(4096, d_in, std=s)
    if args.normalize_activations == "constant_norm_rescale":
        x = x * (d_in**0.5) / x.norm(dim=-1, keepdim=True)
    elif args.normalize_activations == "layer_norm":
        x = x - x.mean(-1, keepdim=True)
        x = x / (x.std(-1, keepdim=True) + 1e-5)
    x_scale = float(x.std())

    params = {
        # b_dec [d_out or d_in]: subtracted from the input when apply_b_dec_to_input.
        "b_dec": randn(d_out, std=0.3 * x_scale),
        # W_enc [d_in, d_sae]: pre-activations ~ N(b_enc, ~1) for N(0, x_scale^2) inputs.
        "W_enc": randn(d_in, d_sae, std=1.0 / (x_scale * math.sqrt(d_in))),
        # b_enc [d_sae]: negative-ish so that roughly a third of (x, feature) pairs fire.
        "b_enc": randn(d_sae, std=0.5, mean=-0.4),
        # W_dec [d_sae, d_out], rows of norm ~ U(0.5, 1.5) * x_scale (not unit: catches a
        # wrong rescale_acts_by_decoder_norm / fold handling).
        "W_dec": randn(d_sae, d_out),
    }
    params["W_dec"] *= (
        x_scale
        * (0.5 + torch.rand(d_sae, 1, generator=g))
        / params["W_dec"].norm(dim=-1, keepdim=True)
    )
    if "skip" in a:
        params["W_skip"] = randn(d_out, d_in, std=0.1 / math.sqrt(d_in))

    x_in = x - params["b_dec"] * apply if not is_tc else x
    pre = x_in @ params["W_enc"] + params["b_enc"]
    if "jumprelu" in a:
        # threshold [d_sae] > 0: per-feature median of the positive pre-activations times a
        # random factor in [0.6, 1.4], so roughly half of the positive pre-activations pass.
        pos = torch.where(pre > 0, pre, torch.nan)
        med = pos.nanmedian(dim=0).values
        med = torch.nan_to_num(med, nan=0.5).clamp(min=1e-3)
        params["threshold"] = med * (0.6 + 0.8 * torch.rand(d_sae, generator=g))

    sd = sae.state_dict()
    if set(sd) != set(params):
        raise SystemExit(
            f"parameter names differ: sae-lens {sorted(sd)}, ours {sorted(params)}"
        )
    for name, t in params.items():
        if tuple(sd[name].shape) != tuple(t.shape):
            raise SystemExit(
                f"{name}: sae-lens shape {tuple(sd[name].shape)}, ours {tuple(t.shape)}"
            )
    sae.load_state_dict(params)
    sae.eval()

    out = Path(args.out)
    sae.save_model(out)

    # Summary on the calibration batch, through sae-lens itself.
    feats = sae.encode(
        x if args.normalize_activations == "none" else randn(4096, d_in, std=s)
    )
    if hasattr(sae, "x_norm_coeff"):
        del sae.x_norm_coeff
    fired = (feats != 0).float()
    return {
        "out": str(out),
        "architecture": a,
        "d_in": d_in,
        "d_sae": d_sae,
        "d_out": d_out,
        "apply_b_dec_to_input": bool(apply),
        "fired_fraction": round(float(fired.mean()), 4),
        "features_never_fired": int((fired.sum(0) == 0).sum()),
        "files": sorted(p.name for p in out.iterdir()),
    }


# -------------------------------------------------------------------------------------- encode


@torch.no_grad()
def cmd_encode(args) -> dict:
    from sae_lens import SAE

    sae = SAE.load_from_disk(args.sae, device="cpu", dtype="float32")
    sae.eval()
    has_skip = hasattr(sae, "W_skip")
    acts = load_file(args.acts, device="cpu")
    result: dict[str, torch.Tensor] = {}
    for key, x in acts.items():
        x = x.to(torch.float32)
        feats = sae.encode(x)
        if feats.is_sparse:
            feats = feats.to_dense()
        # decode right after encode: constant_norm_rescale / layer_norm keep per-call state.
        dec = sae.decode(feats)
        result[key] = feats.to(torch.float32).contiguous()
        result[f"{key}.decoded"] = dec.to(torch.float32).contiguous()
        if has_skip:
            result[f"{key}.forward"] = sae(x).to(torch.float32).contiguous()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(result, args.out)
    return {
        "out": args.out,
        "architecture": sae.cfg.architecture(),
        "keys": {k: list(v.shape) for k, v in result.items()},
    }


# --------------------------------------------------------------------------------------- main


def _run(argv: list[str]) -> dict:
    args = _parser().parse_args(argv)
    if args.cmd == "make":
        return cmd_make(args)
    if args.cmd == "encode":
        return cmd_encode(args)
    jobs = json.loads(Path(args.jobs).read_text())
    if not isinstance(jobs, list) or not all(
        isinstance(j, list) and j and j[0] in ("make", "encode") for j in jobs
    ):
        raise SystemExit(
            "--jobs: expected a JSON list of argument lists of make/encode"
        )
    return {"batch": [_run([str(a) for a in j]) for j in jobs]}


def main(argv: list[str] | None = None) -> int:
    res = _run(sys.argv[1:] if argv is None else argv)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
