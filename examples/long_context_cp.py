"""Train the HybridLM on long sequences split over context parallelism (CP = number of processes).

    torchrun --nproc-per-node 2 examples/long_context_cp.py --config configs/tiny_cp2.yaml --steps 20
    torchrun --nproc-per-node 8 examples/long_context_cp.py --config configs/dsv4_flash.yaml   # GPUs

Every rank holds `seq_len / cp` tokens of every row (zigzag: chunks r and 2·cp−1−r, Megatron's
order). W/C/H layers exchange a halo of hidden states and all-gather the compressed KV; M layers
run a ring. The per-rank pieces of the loss add up to the full-sequence loss, and gradients are
summed over CP before the optimizer step (see docs/parallelism.md). gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing the package

from megatron_dsa.packaged_configs import resolve_config  # noqa: E402
from megatron_dsa.train import (JobConfig, build_model, build_optimizer, format_step, load_corpus,  # noqa: E402
                                resolve_device, setup_parallel, train_batch, train_step)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/tiny_cp2.yaml"),
                        help="job YAML; a packaged config's name (configs/tiny_cp2.yaml) works from any directory")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)

    cp = int(os.environ.get("WORLD_SIZE", "1"))
    job = JobConfig.from_yaml(resolve_config(args.config), steps=args.steps)
    train = job.train
    device = resolve_device(train.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    state = setup_parallel(1, cp, device)  # None for a single process (CP 1)
    leader = state is None or dist.get_rank() == 0
    model = build_model(job, device, state)  # the same initial weights on every rank
    optimizer = build_optimizer(model, train)
    text = load_corpus(train).train
    if leader:
        print(f"CP {cp}: {train.batch_size} rows of {train.seq_len} tokens, "
              f"{train.seq_len // cp} per rank | pattern {job.attention.layer_pattern}")
    losses = []
    for step in range(train.steps):
        batch, packed = train_batch(job, text, step)  # the full batch; train_step takes this rank's part
        stats = train_step(model, optimizer, batch.to(device), step, train, device, packed)
        losses.append(stats.loss)
        if leader:
            print(format_step(stats))
    if state is not None:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
