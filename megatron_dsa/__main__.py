"""Command line of the package: `megatron-dsa COMMAND ...` (or `python -m megatron_dsa COMMAND ...`).

    train     the main training job (`python -m megatron_dsa.train`, same arguments)
    convert   convert attention checkpoints (`python -m megatron_dsa.convert`, same arguments)
    generate  sample from a trained checkpoint (`python -m megatron_dsa.generate`, same arguments)
    info      versions, the device, the layer kinds, which kernel backend can run which op family here,
              and the order `auto` tries them in

`train`, `convert` and `generate` hand their arguments to their module's own parser, so each option is
defined once and `megatron-dsa train --help` is the module's help.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Callable, NamedTuple, Optional, Sequence

import torch

import megatron_dsa
from megatron_dsa.config import KINDS

PROG = "megatron-dsa"
WIDTH = 100  # `info` lines fit a 100-column terminal (--verbose wraps its long reasons)


class Command(NamedTuple):
    """A subcommand; it imports its module when it runs, so one command never loads another's."""

    help: str
    run: Callable[[list[str], str], int]  # (arguments after the command, prog) → exit status


def run_train(argv: list[str], prog: str) -> int:
    from megatron_dsa import train

    train.main(argv, prog)
    return 0


def run_convert(argv: list[str], prog: str) -> int:
    from megatron_dsa import convert

    return convert.main(argv, prog)


def run_generate(argv: list[str], prog: str) -> int:
    from megatron_dsa import generate

    return generate.main(argv, prog)


def run_info(argv: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="Versions, the device, the layer kinds (the letters of layer_pattern), and "
                               "per kernel backend the op families it can run here, or why it declines.")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="every backend's versions and full decline reasons per op family, and which "
                             "FlashAttention generation and Triton sparse-attention kernel would serve")
    args = parser.parse_args(argv)
    print(describe_info(args.verbose))
    return 0


COMMANDS = {
    "train": Command("train HybridLM (the main job; --preset tiny to start)", run_train),
    "convert": Command("convert attention checkpoints (Megatron / Hugging Face <-> ours, TP merge / split)", run_convert),
    "generate": Command("sample from a trained checkpoint (greedy or temperature / top-p) through the decoding cache",
                        run_generate),
    "info": Command("show versions, the device, the layer kinds and the kernel backends this machine can run",
                    run_info),
}


# ---------------------------------------------------------------- info
def describe_torch() -> str:
    """torch's version and build, in words that cannot contradict the device line."""
    if torch.version.cuda:
        return f"torch {torch.__version__}, built with CUDA {torch.version.cuda}"
    if getattr(torch.version, "hip", None):
        return f"torch {torch.__version__}, built with ROCm {torch.version.hip}"
    return f"torch {torch.__version__}, CPU-only build"


def describe_devices() -> list[str]:
    """One line per CUDA device (name and compute capability), or why there is none."""
    if not torch.cuda.is_available():
        why = "no CUDA device visible" if torch.version.cuda else "this torch build has no CUDA"
        return [f"cpu ({why})"]
    lines = []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        lines.append(f"cuda:{index} {torch.cuda.get_device_name(index)} (compute capability {major}.{minor})")
    return lines


def describe_kinds() -> list[str]:
    """The kind table (`config.KINDS`, registered kinds included): letter, name, compress ratio, core."""
    rows = [(row.symbol, row.name, str(row.ratio), type(row.core).__name__) for row in KINDS.values()]
    table = format_table(("kind", "name", "compress ratio", "core"), rows)
    return ["layer kinds (the letters of layer_pattern):", *("  " + line for line in table.splitlines())]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces, the header underlined."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    return "\n".join([line(header), line(["-" * width for width in widths]), *map(line, rows)])


def backend_outcomes(rows: Sequence[tuple[str, str, str, str]]) -> dict[str, dict[str, list[str]]]:
    """`availability_table()` rows → backend → outcome ("yes" or the decline reason) → op families,
    backends and outcomes in the table's order."""
    grouped: dict[str, dict[str, list[str]]] = {}
    for backend, _, op, outcome in rows:
        grouped.setdefault(backend, {}).setdefault(outcome, []).append(op)
    return grouped


def summarise_backends(rows: Sequence[tuple[str, str, str, str]], width: int = WIDTH) -> list[str]:
    """One line per backend and outcome, at most `width` wide: "yes: <op families>" or
    "no: <the reason's headline>"."""
    grouped = backend_outcomes(rows)
    every_op = {op for _, _, op, _ in rows}
    name_width = max(map(len, grouped))
    lines = []
    for backend, outcomes in grouped.items():
        for index, (outcome, ops) in enumerate(outcomes.items()):
            scope = name_ops(ops, every_op)
            if outcome == "yes":
                text = f"yes: {scope}"
            else:
                text = f"no: {headline(outcome)}" if len(outcomes) == 1 else f"no ({scope}): {headline(outcome)}"
            label = backend if index == 0 else ""
            lines.append(shorten(f"  {label:<{name_width}}  {text}", width))
    return lines


def name_ops(ops: Sequence[str], every_op: set[str], room: int = 40) -> str:
    if set(ops) == every_op:
        return "all op families"
    listed = ", ".join(ops)
    return listed if len(listed) <= room else f"{len(ops)} op families"


def headline(reason: str) -> str:
    """A decline reason without its parenthesised details, cut at its first ';' ("…" marks the cut)."""
    depth, kept = 0, []
    for char in reason:
        depth += char == "("
        if depth == 0:
            kept.append(char)
        depth -= char == ")" and depth > 0
    first, *rest = "".join(kept).split(";")
    return " ".join(first.split()) + ("; …" if any(part.strip() for part in rest) else "")


def detail_backends(rows: Sequence[tuple[str, str, str, str]], width: int = WIDTH) -> list[str]:
    """Per backend its versions, then every outcome with the op families it covers, wrapped."""
    versions = {backend: version for backend, version, _, _ in rows}
    lines = []
    for backend, outcomes in backend_outcomes(rows).items():
        lines += wrap(f"{backend} ({versions[backend]})", width, "    ")
        for outcome, ops in outcomes.items():
            lines += wrap(f"  {', '.join(ops)}: {outcome}", width, "      ")
    return lines


def shorten(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 1].rstrip() + "…"


def wrap(text: str, width: int, indent: str) -> list[str]:
    """`text` over lines of at most `width` (long words broken), continuation lines indented."""
    return textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False) or [""]


def describe_auto_order(width: int = WIDTH) -> list[str]:
    """`AUTO_ORDER` (per op family, the backends `auto` asks, first to last) and the one `auto` picks for a
    call on this machine's device, before the per-call rules (dtype, head dims, layout) have their say."""
    from megatron_dsa.backends import AUTO, BackendUnavailableError, OpFamily, auto_order, resolve

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for op in OpFamily:
        try:
            here = resolve(op, AUTO, device=device)[0]
        except BackendUnavailableError:
            here = "none"
        rows.append((op.value, " > ".join(auto_order(op)), here))
    table = format_table(("op family", "auto tries, first to last", f"picks on {device}"), rows)
    return ["auto's order per op family (the first backend that accepts a call runs it; the pick shown here",
            "may still change per call with its dtype, head dims or layout):",
            *(shorten("  " + line, width) for line in table.splitlines())]


def describe_info(verbose: bool = False, width: int = WIDTH) -> str:
    """What `megatron-dsa info` prints: every line fits `width` columns."""
    from megatron_dsa.backends import availability_table
    from megatron_dsa.backends.flash_attn import describe_generations
    from megatron_dsa.backends.triton_kernels.sparse_attention import describe_hopper_kernels

    rows = availability_table()
    lines = [f"megatron_dsa {megatron_dsa.__version__}", describe_torch()]
    lines += [f"device: {device}" for device in describe_devices()]
    lines += ["", *describe_kinds(), ""]
    if not verbose:
        lines.append("kernel backends: what each can run here (--verbose: versions, full reasons, kernels)")
        lines += summarise_backends(rows, width)
        lines += ["", *describe_auto_order(width)]
        return "\n".join(lines)
    lines.append("kernel backends, their versions, and per op family whether each can run here:")
    lines += detail_backends(rows, width)
    lines += ["", *describe_auto_order(width)]
    for section in (describe_generations(), describe_hopper_kernels()):
        lines.append("")
        for line in section.splitlines():
            indent = " " * (len(line) - len(line.lstrip()) + 4)
            lines += wrap(line, width, indent)
    return "\n".join(lines)


# ---------------------------------------------------------------- dispatch
def build_parser() -> argparse.ArgumentParser:
    """The top level: the command list for `--help`; each command parses its own arguments."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="megatron_dsa: DeepSeek-V4-style hybrid attention for Megatron-style training.",
        epilog=f"`{PROG} COMMAND --help` shows a command's options.")
    parser.add_argument("--version", action="version", version=f"megatron_dsa {megatron_dsa.__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        commands.add_parser(name, help=command.help, add_help=False)  # its own parser handles --help
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    return COMMANDS[args.command].run(rest, f"{PROG} {args.command}")


if __name__ == "__main__":
    sys.exit(main())
