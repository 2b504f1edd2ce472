"""Convert attention checkpoints: `megatron-dsa convert COMMAND ...` (or `python -m megatron_dsa.convert`).

    megatron-to-ours  IN [IN ...] OUT --config CFG [--tp N]   Megatron GPTModel → HybridLM names
    ours-to-megatron  IN [IN ...] OUT --config CFG [--tp N]   HybridLM → Megatron GPTModel names
    tp-merge          IN IN [...] OUT --config CFG [--layout L]   TP shards (rank order) → TP = 1
    tp-split          IN OUT --config CFG --tp N [--layout L]      TP = 1 → N shards
    hf-to-ours        CKPT OUT [--tp N] [--dtype D] [--hf-config J]  DeepSeek-V4 safetensors → ours
    ours-to-hf        IN [IN ...] OUT.safetensors --config CFG [--naming hf|official]

Several INs are the TP ranks of one checkpoint, in rank order. A file may hold the state dict itself
or a dict with a "model" entry (Megatron's and our training checkpoints). With `--tp N > 1`, OUT
`x.pt` becomes `x_tp0.pt` ... `x_tp{N-1}.pt`. CFG is a YAML with the attention config (a job config
such as configs/tiny.yaml, which a packaged config's name finds from any directory, or a bare
HybridAttentionConfig). Only the attention layers are converted; the count of other tensors left
out is printed. An output is never an input, an existing one is replaced only with --force, and
every file is written whole or not at all.

hf-to-ours reads a DeepSeek-V4 checkpoint (a directory with config.json and *.safetensors, or one
.safetensors file with --hf-config) in transformers' naming or the release's (detected), one tensor
at a time; FP8 block-scaled weights are dequantized to --dtype (bf16 or fp32; other tensors keep
theirs). The layer kinds and RoPE come from config.json; the attention config is written beside OUT
as OUT with the suffix .yaml (the --config of later commands). ours-to-hf writes the attention tensors
of our checkpoint (TP ranks merged) as one safetensors file in --naming (default hf). Both need the
safetensors package (`pip install "megatron_dsa[hf]"`).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import yaml

from megatron_dsa.config import HybridAttentionConfig
from megatron_dsa.integrations.checkpoint import LAYOUTS, convert_attention
from megatron_dsa.integrations.hf import NAMINGS
from megatron_dsa.packaged_configs import resolve_config

COMMANDS = {  # command → (source layout, target layout); None = from --layout
    "megatron-to-ours": ("megatron", "ours"),
    "ours-to-megatron": ("ours", "megatron"),
    "tp-merge": (None, None),
    "tp-split": (None, None),
    "hf-to-ours": ("hf", "ours"),
    "ours-to-hf": ("ours", "hf"),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_parser(prog: str = "python -m megatron_dsa.convert") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("paths", nargs="+", type=Path, help="input file(s) in TP-rank order, then OUT")
    parser.add_argument("--config", type=Path,
                        help="YAML with the attention config (every command but hf-to-ours)")
    parser.add_argument("--hf-config", type=Path,
                        help="hf-to-ours: the checkpoint's config.json (default: the one beside the weights)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="hf-to-ours: dtype of dequantized FP8 weights (default bf16)")
    parser.add_argument("--naming", choices=sorted(NAMINGS), default="hf",
                        help="ours-to-hf: transformers' names (hf, default) or the release's (official)")
    parser.add_argument("--tp", type=int, default=1, help="TP size of the output (default 1)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="ours",
                        help="naming of tp-merge / tp-split files (default ours)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="load files that hold Python objects besides tensors (only files you trust)")
    parser.add_argument("--force", action="store_true", help="replace output files that exist")
    return parser


def main(argv: Optional[list[str]] = None, prog: str = "python -m megatron_dsa.convert") -> int:
    args = build_parser(prog).parse_args(argv)
    if len(args.paths) < 2:
        raise SystemExit("error: give at least one input file and the output file")
    *inputs, output = args.paths
    if args.command == "hf-to-ours":
        return convert_from_hf(args, inputs, output)
    if args.config is None:
        raise SystemExit(f"error: {args.command} needs --config (a YAML with the attention config)")
    if args.command == "ours-to-hf":
        return convert_to_hf(args, inputs, output)
    source, target = COMMANDS[args.command]
    source, target = source or args.layout, target or args.layout
    if args.command == "tp-merge" and (len(inputs) < 2 or args.tp != 1):
        raise SystemExit("error: tp-merge takes two or more shards and writes one TP = 1 file")
    if args.command == "tp-split" and (len(inputs) != 1 or args.tp < 2):
        raise SystemExit("error: tp-split takes one TP = 1 file and --tp N with N >= 2")
    targets = output_paths(output, args.tp)
    check_outputs(inputs, targets, args.force)
    config = read_config(args.config)
    shards = [load_state_dict(path, args.trust_pickle) for path in inputs]
    try:
        outputs, skipped = convert_attention(shards, config, source, target, args.tp)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    for path, state in zip(targets, outputs):
        save_atomically(state, path)
        print(f"wrote {path} ({len(state)} tensors)")
    report_left_out(skipped)
    return 0


def read_config(path: Path) -> HybridAttentionConfig:
    try:
        return HybridAttentionConfig.from_yaml(resolve_config(path))
    except (ValueError, TypeError, OSError, yaml.YAMLError) as error:
        raise SystemExit(f"error: --config {path}: {error}") from None


def convert_from_hf(args: argparse.Namespace, inputs: list[Path], output: Path) -> int:
    """hf-to-ours: a DeepSeek-V4 safetensors checkpoint → our TP shards and the attention YAML."""
    from megatron_dsa.integrations import hf

    if len(inputs) != 1 or args.config is not None:
        raise SystemExit("error: hf-to-ours takes one checkpoint (a directory or a .safetensors file) and reads "
                         "the attention config from its config.json (--hf-config names another one)")
    source = inputs[0]
    require_safetensors()
    try:
        files = hf.checkpoint_files(source)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    targets = output_paths(output, args.tp)
    config_path = output.with_suffix(".yaml")
    check_outputs([source, *files], [*targets, config_path], args.force)
    try:
        values = hf.read_hf_config(args.hf_config or (source if source.is_dir() else source.parent))
        config = hf.from_hf_config(values)
        with hf.SafetensorsCheckpoint(files) as checkpoint:
            outputs, skipped, naming = hf.hf_to_ours(checkpoint, config, args.tp, DTYPES[args.dtype],
                                                     values.get("quantization_config"))
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    print(f"read {len(files)} file(s) in the {naming} naming: {config.num_layers} attention layers "
          f"({config.layer_pattern})")
    for path, state in zip(targets, outputs):
        save_atomically(state, path)
        print(f"wrote {path} ({len(state)} tensors)")
    save_atomically(config, config_path, lambda value, path: value.to_yaml(path))
    print(f"wrote {config_path} (the attention config: pass it as --config)")
    report_left_out(skipped)
    return 0


def convert_to_hf(args: argparse.Namespace, inputs: list[Path], output: Path) -> int:
    """ours-to-hf: our checkpoint (TP ranks in order) → one safetensors file of attention tensors."""
    from megatron_dsa.integrations.hf import ours_to_hf

    if args.tp != 1:
        raise SystemExit("error: ours-to-hf writes one TP = 1 file; give the TP shards as inputs")
    require_safetensors()
    from safetensors.torch import save_file

    check_outputs(inputs, [output], args.force)
    config = read_config(args.config)
    shards = [load_state_dict(path, args.trust_pickle) for path in inputs]
    try:
        [full], skipped = convert_attention(shards, config, "ours", "ours")
        state, _ = ours_to_hf(full, config, args.naming)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    save_atomically({key: value.contiguous() for key, value in state.items()}, output,
                    lambda value, path: save_file(value, str(path), metadata={"format": "pt"}))
    print(f"wrote {output} ({len(state)} tensors, {args.naming} naming)")
    report_left_out(skipped)
    return 0


def require_safetensors() -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise SystemExit('error: reading and writing safetensors needs the safetensors package: '
                         'pip install "megatron_dsa[hf]"') from None


def report_left_out(skipped: list[str]) -> None:
    if skipped:
        print(f"left out {len(skipped)} tensors outside the attention layers (e.g. {skipped[0]!r})")


def load_state_dict(path: Path, trust_pickle: bool = False) -> dict[str, torch.Tensor]:
    """The state dict in `path`: the file itself or its "model" entry."""
    if not path.is_file():
        raise SystemExit(f"error: {path} is not a file")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as error:
        if trust_pickle or "Weights only load failed" not in str(error):
            raise SystemExit(f"error: {path} is not a readable checkpoint (corrupt?): {error}") from None
        raise SystemExit(f"error: {path} holds Python objects besides tensors, which weights_only=True refuses; "
                         f"if you trust the file, pass --trust-pickle") from None
    except Exception as error:  # noqa: BLE001 - a truncated or damaged file fails in many ways
        reason = str(error).split(". ")[0] or type(error).__name__
        raise SystemExit(f"error: {path} is not a readable checkpoint: it is truncated or corrupt "
                         f"({type(error).__name__}: {reason})") from None
    state = loaded.get("model", loaded) if isinstance(loaded, dict) else None
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise SystemExit(f"error: {path} holds no state dict (a str → tensor dict, or one under 'model')")
    return state


def check_outputs(inputs: list[Path], outputs: list[Path], force: bool) -> None:
    """An output may never be an input (it would be replaced by its attention layers alone), and an
    existing output is replaced only with `--force`."""
    sources = {path.resolve() for path in inputs}
    for path in outputs:
        if path.resolve() in sources:
            raise SystemExit(f"error: the output {path} is also an input; write to another file")
        if path.exists() and not force:
            raise SystemExit(f"error: {path} exists; pass --force to replace it")


def save_atomically(state: Any, path: Path, write: Callable[[Any, Path], None] = torch.save) -> None:
    """`write(state, path)` whole or not at all: a crash mid-write leaves no torn file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    write(state, partial)
    os.replace(partial, path)


def output_paths(output: Path, tp_size: int) -> list[Path]:
    if tp_size == 1:
        return [output]
    return [output.with_name(f"{output.stem}_tp{rank}{output.suffix}") for rank in range(tp_size)]


if __name__ == "__main__":
    sys.exit(main())
