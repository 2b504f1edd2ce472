"""Command line of the package: `python -m megatron_dsa <command>` or the `megatron-dsa` script.

    info    package and torch versions, the device, which backend can run which op family here, and
            which kernel generation serves where a backend has several (FlashAttention, Triton)
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch

import megatron_dsa
from megatron_dsa.backends import availability_table
from megatron_dsa.backends.flash_attn import describe_generations
from megatron_dsa.backends.triton_kernels.sparse_attention import describe_hopper_kernels


def describe_devices() -> list[str]:
    """One line per CUDA device (name and compute capability), or why there is none."""
    if not torch.cuda.is_available():
        return ["cpu (CUDA not available)"]
    lines = []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        lines.append(f"cuda:{index} {torch.cuda.get_device_name(index)} (compute capability {major}.{minor})")
    return lines


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces, the header underlined."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    return "\n".join([line(header), line(["-" * width for width in widths]), *map(line, rows)])


def run_info(args: argparse.Namespace) -> int:
    torch_build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
    print(f"megatron_dsa {megatron_dsa.__version__}")
    print(f"torch {torch.__version__} ({torch_build})")
    for device in describe_devices():
        print(f"device: {device}")
    print()
    print(format_table(("backend", "versions", "op family", "available"), availability_table()))
    print()
    print(describe_generations())
    print()
    print(describe_hopper_kernels())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-dsa", description="Tools of megatron_dsa (DeepSeek-V4-style hybrid attention).")
    commands = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    info = commands.add_parser("info", help="show versions, the device and the available kernel backends",
                               description="Versions, the device, and per backend and op family whether "
                                           "it can run here (\"yes\") or why it declines.")
    info.set_defaults(handler=run_info)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
