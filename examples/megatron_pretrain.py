"""Pretrain a Megatron-Core GPTModel whose attention layers are megatron_dsa's hybrid layers.

    pip install -e ".[megatron]"
    python examples/megatron_pretrain.py --config configs/tiny.yaml --steps 20            # 1 process
    torchrun --nproc-per-node 2 examples/megatron_pretrain.py --config configs/tiny.yaml --tp 2

The job YAML (attention / model / train sections, as for `python -m megatron_dsa.train`) becomes a
Megatron `MLATransformerConfig` plus the hybrid fields released megatron-core lacks. Megatron
supplies embeddings, RMSNorms, the SwiGLU MLP and the output layer (local, non-Transformer-Engine
spec); every `self_attention` is ours, its kind read from `attention.layer_pattern`. CPU runs use
gloo and fp32; with `train.device: cuda` NCCL and bf16 autocast. Every rank is one TP rank (no data
parallelism here). Megatron's torch norms refuse sequence parallelism, so `sequence_parallel` needs
Apex or Transformer Engine norms (pass your own `base_layer_spec`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing the package

from megatron_dsa.data import load_stdlib_corpus, make_batch, seeded_generator, split_corpus  # noqa: E402
from megatron_dsa.integrations.megatron import (INDEXER_LOSS_NAME, hybrid_gpt_model,  # noqa: E402
                                                indexer_loss_scale, require_megatron, set_indexer_loss_scale)
from megatron_dsa.integrations.megatron_config import to_megatron_kwargs  # noqa: E402
from megatron_dsa.train import JobConfig, learning_rate, resolve_device  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "configs" / "tiny.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= number of processes)")
    return parser.parse_args(argv)


def init_distributed(tp: int, device: torch.device) -> None:
    """One gloo/NCCL process group over all ranks (a 1-rank group without torchrun), TP = world."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        raise ValueError(f"WORLD_SIZE={world} but --tp {tp}: launch with torchrun --nproc-per-node {tp}")
    if "MASTER_ADDR" not in os.environ:  # plain `python`: a single-rank group on a local port
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def build_model(job: JobConfig, tp: int, device: torch.device) -> torch.nn.Module:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    attention_kwargs, hybrid_overrides = to_megatron_kwargs(job.attention, fields)
    config = MLATransformerConfig(
        **attention_kwargs, tensor_model_parallel_size=tp, ffn_hidden_size=job.model.ffn_hidden_size,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=device.type == "cpu")
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(job.train.seed)  # Megatron's TP init streams
    torch.manual_seed(job.train.seed)
    model = hybrid_gpt_model(config, job.model.vocab_size, job.model.max_seq_len,
                             gpt_kwargs={"share_embeddings_and_output_weights": job.model.tie_embeddings},
                             **hybrid_overrides)
    return model.to(device)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> None:
    """Clip by the norm of the whole gradient: TP-split parameters (Megatron's
    `tensor_model_parallel` attribute, which the hybrid layers set too) add their squares over TP,
    replicated ones count once, so every TP rank applies the same factor."""
    from megatron.core import parallel_state

    grads = [(p.grad, getattr(p, "tensor_model_parallel", False)) for p in model.parameters() if p.grad is not None]
    split = sum((g.float().pow(2).sum() for g, is_split in grads if is_split), torch.zeros(()))
    whole = sum((g.float().pow(2).sum() for g, is_split in grads if not is_split), torch.zeros(()))
    split = split.to(grads[0][0].device)
    dist.all_reduce(split, group=parallel_state.get_tensor_model_parallel_group())
    scale = (max_norm / ((split + whole.to(split.device)).sqrt() + 1e-6)).clamp(max=1.0)
    for grad, _ in grads:
        grad.mul_(scale)


def indexer_losses() -> list[float]:
    """Per-layer indexer KL of the last step from Megatron's auxiliary-loss tracker (then cleared)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(INDEXER_LOSS_NAME)
    if entry is None:
        return []
    values = entry["values"].tolist()
    entry["values"].zero_()
    return values


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    require_megatron()
    job = JobConfig.from_yaml(args.config, steps=args.steps)
    train = job.train
    device = resolve_device(train.device)
    init_distributed(args.tp, device)
    leader = dist.get_rank() == 0
    model = build_model(job, args.tp, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=train.weight_decay,
                                  betas=(train.adam_beta1, train.adam_beta2))
    text = split_corpus(load_stdlib_corpus(train.corpus_max_bytes)).train
    task = job.retrieval_task()
    positions = torch.arange(train.seq_len, device=device).expand(train.batch_size, -1)
    if leader:
        print(f"Megatron GPTModel, TP {args.tp}: {sum(p.numel() for p in model.parameters()):,} parameters "
              f"per rank, attention kinds {job.attention.layer_pattern}")
    losses = []
    for step in range(train.steps):
        # Same batch on every TP rank (seeded by the step); one microbatch per step, no loss scaling.
        batch = make_batch(text, task, train.batch_size, train.retrieval_rows,
                           seeded_generator(train.seed, "megatron", step)).to(device)
        set_indexer_loss_scale(indexer_loss_scale(num_microbatches=1))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, train)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=train.dtype == "bf16"):
            token_loss = model(batch.inputs, positions, None, labels=batch.targets)  # [B, S]
        loss = (token_loss.float() * batch.loss_mask).sum() / batch.loss_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_grad_norm(model, train.grad_clip)
        optimizer.step()
        losses.append(float(loss))
        indexer = indexer_losses()
        if leader:
            kl = ", ".join(f"{v:.2e}" for v, kind in zip(indexer, job.attention.layer_pattern) if kind == "C")
            print(f"step {step + 1}: loss {losses[-1]:.4f} | indexer KL (C layers) {kl}")
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
