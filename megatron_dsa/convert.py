"""Convert attention checkpoints: `megatron-dsa convert COMMAND ...` (or `python -m megatron_dsa.convert`).

    megatron-to-ours  IN [IN ...] OUT --config CFG [--tp N]   Megatron GPTModel → HybridLM names
    ours-to-megatron  IN [IN ...] OUT --config CFG [--tp N]   HybridLM → Megatron GPTModel names
    tp-merge          IN IN [...] OUT --config CFG [--layout L]   TP shards (rank order) → TP = 1
    tp-split          IN OUT --config CFG --tp N [--layout L]      TP = 1 → N shards

Several INs are the TP ranks of one checkpoint, in rank order. A file may hold the state dict itself
or a dict with a "model" entry (Megatron's and our training checkpoints). With `--tp N > 1`, OUT
`x.pt` becomes `x_tp0.pt` ... `x_tp{N-1}.pt`. CFG is a YAML with the attention config (a job config
such as configs/tiny.yaml, which a packaged config's name finds from any directory, or a bare
HybridAttentionConfig). Only the attention layers are converted; the count of other tensors left
out is printed. An output is never an input, an existing one is replaced only with --force, and
every file is written whole or not at all.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path
from typing import Optional

import torch
import yaml

from megatron_dsa.config import HybridAttentionConfig
from megatron_dsa.integrations.checkpoint import LAYOUTS, convert_attention
from megatron_dsa.packaged_configs import resolve_config

COMMANDS = {  # command → (source layout, target layout); None = from --layout
    "megatron-to-ours": ("megatron", "ours"),
    "ours-to-megatron": ("ours", "megatron"),
    "tp-merge": (None, None),
    "tp-split": (None, None),
}


def build_parser(prog: str = "python -m megatron_dsa.convert") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("paths", nargs="+", type=Path, help="input file(s) in TP-rank order, then OUT")
    parser.add_argument("--config", type=Path, required=True, help="YAML with the attention config")
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
    source, target = COMMANDS[args.command]
    source, target = source or args.layout, target or args.layout
    if args.command == "tp-merge" and (len(inputs) < 2 or args.tp != 1):
        raise SystemExit("error: tp-merge takes two or more shards and writes one TP = 1 file")
    if args.command == "tp-split" and (len(inputs) != 1 or args.tp < 2):
        raise SystemExit("error: tp-split takes one TP = 1 file and --tp N with N >= 2")
    targets = output_paths(output, args.tp)
    check_outputs(inputs, targets, args.force)
    try:
        config = HybridAttentionConfig.from_yaml(resolve_config(args.config))
    except (ValueError, TypeError, OSError, yaml.YAMLError) as error:
        raise SystemExit(f"error: --config {args.config}: {error}") from None
    shards = [load_state_dict(path, args.trust_pickle) for path in inputs]
    try:
        outputs, skipped = convert_attention(shards, config, source, target, args.tp)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    for path, state in zip(targets, outputs):
        save_atomically(state, path)
        print(f"wrote {path} ({len(state)} tensors)")
    if skipped:
        print(f"left out {len(skipped)} tensors outside the attention layers (e.g. {skipped[0]!r})")
    return 0


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


def save_atomically(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write `path` whole or not at all: a crash mid-write leaves no torn file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def output_paths(output: Path, tp_size: int) -> list[Path]:
    if tp_size == 1:
        return [output]
    return [output.with_name(f"{output.stem}_tp{rank}{output.suffix}") for rank in range(tp_size)]


if __name__ == "__main__":
    sys.exit(main())
