"""Train the tiny HybridLM for a few steps through the Python API (no CLI, no checkpoints).

    python examples/train_tiny.py --steps 20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing the package

from megatron_dsa.data import make_batch, seeded_generator  # noqa: E402
from megatron_dsa.packaged_configs import resolve_config  # noqa: E402
from megatron_dsa.train import (JobConfig, build_model, build_optimizer, compute_loss,  # noqa: E402
                                learning_rate, load_corpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, default=Path("configs/tiny.yaml"),
                        help="job YAML; a packaged config's name (configs/tiny.yaml) works from any directory")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    job = JobConfig.from_yaml(resolve_config(args.config), steps=args.steps)
    train = job.train
    model = build_model(job, torch.device("cpu"))  # seeded from train.seed
    optimizer = build_optimizer(model, train)
    text = load_corpus(train).train
    task = job.retrieval_task()
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, layer kinds "
          f"{[layer.self_attention.kind.value for layer in model.layers]}")

    for step in range(train.steps):
        batch = make_batch(text, task, train.batch_size, train.retrieval_rows,
                           seeded_generator(train.seed, "example", step))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, train)
        loss = compute_loss(model(batch.inputs), batch)
        optimizer.zero_grad()
        loss.total.backward()  # also trains the lightning indexers through their KL loss
        optimizer.step()
        indexer = ", ".join(f"layer {n}: {v:.2e}" for n, v in model.indexer_losses().items())
        print(f"step {step + 1}: loss {loss.total.item():.4f} | indexer KL {indexer}")


if __name__ == "__main__":
    main()
