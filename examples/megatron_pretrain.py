"""Pretrain a Megatron-Core GPTModel whose attention layers are megatron_dsa's hybrid layers.

    pip install -e ".[megatron]"
    python examples/megatron_pretrain.py --config configs/tiny.yaml --steps 20            # 1 process
    torchrun --nproc-per-node 2 examples/megatron_pretrain.py --config configs/tiny.yaml --tp 2
    torchrun --nproc-per-node 2 examples/megatron_pretrain.py --device cuda --dtype bf16 --tp 2 --sp   # GPUs
    torchrun --nproc-per-node 4 examples/megatron_pretrain.py --tp 2 --cp 2 --steps 20 --save ckpt
    torchrun --nproc-per-node 2 examples/megatron_pretrain.py --cp 2 --steps 40 --load ckpt    # resumes at 20

The job YAML (attention / model / train sections, as for `megatron-dsa train`) becomes a
Megatron `MLATransformerConfig` plus the hybrid fields released megatron-core lacks. Megatron
supplies embeddings, RMSNorms, the SwiGLU MLP and the output layer (local, non-Transformer-Engine
spec); every `self_attention` is ours, its kind read from `attention.layer_pattern`. CPU runs use
gloo and fp32; with `train.device: cuda` NCCL and bf16 autocast.

Parallelism: `--tp T --cp C` on exactly T·C ranks (no data parallelism here), Megatron's own groups
(`initialize_model_parallel`). Under context parallelism every rank feeds its part of each sequence
(the attention config's `cp_partition`, zigzag by default; `train.seq_len` must divide into 2·C
chunks, C for `contiguous`), the loss is assembled over the CP group (the printed loss is the CP 1
loss) and gradients are averaged over it as Megatron's DDP does. `--sp` adds sequence parallelism
over the TP group: the spec then uses the package's RMSNorm (Megatron's torch norm refuses SP),
whose weight gradients are summed over TP after the backward (GPU only: Megatron's SP scatter
allocates on the current CUDA device).

Checkpoints: `--save DIR` writes a Megatron distributed checkpoint (`model.sharded_state_dict()`,
`dist_checkpointing.save`) of the model and the next step at the end; `--load DIR` restores it
before training and continues at that step up to `--steps`, under any `--tp` / `--cp` (Megatron
reshards on load). Batches and the learning rate are functions of the step, so the first resumed
step's loss equals the uninterrupted run's; the AdamW moments are not checkpointed (they restart
from zero).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing the package

# megatron-core warns at import and model build that Transformer Engine and Apex are absent and it
# uses its local (torch) classes instead: exactly the spec this example asks for, so the notes are
# noise here. Other warnings still show.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed", category=UserWarning,
                        module=r"megatron\.core")

from megatron_dsa.data import Batch, RetrievalTask, make_batch, seeded_generator  # noqa: E402
from megatron_dsa.integrations.megatron import (hybrid_gpt_model, tracked_indexer_losses,  # noqa: E402
                                                indexer_loss_scale, load_dist_checkpoint, require_megatron,
                                                save_dist_checkpoint, set_indexer_loss_scale)
from megatron_dsa.integrations.megatron_config import to_megatron_kwargs  # noqa: E402
from megatron_dsa.packaged_configs import resolve_config  # noqa: E402
from megatron_dsa.parallel.consistency import check_same_on_all_ranks  # noqa: E402
from megatron_dsa.parallel.context import chunks_per_sequence, shard_sequence  # noqa: E402
from megatron_dsa.train import (DIST_TIMEOUT_S, JobConfig, context_parallel_batch, learning_rate,  # noqa: E402
                                load_corpus, resolve_device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/tiny.yaml"),
                        help="job YAML; a packaged config's name (configs/tiny.yaml) works from any directory")
    parser.add_argument("--steps", type=int, default=10, help="train up to this step (a resumed run too)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (processes = tp × cp)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism over the TP group (--tp > 1)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (overrides train.device)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="fp32, or bf16 autocast (overrides train.dtype)")
    parser.add_argument("--save", type=Path, default=None, help="write a distributed checkpoint here at the end")
    parser.add_argument("--load", type=Path, default=None, help="resume from this distributed checkpoint")
    parser.add_argument("--dist-timeout", type=float, default=DIST_TIMEOUT_S, metavar="SECONDS",
                        help="how long a collective waits for a failed or stalled rank before the job ends")
    parser.add_argument("--gpu-init", action="store_true",
                        help="initialise Megatron's own layers on the GPU with its per-TP-rank RNG streams "
                             "(faster for big models; the initial weights then depend on --tp)")
    return parser.parse_args(argv)


def check_arguments(args: argparse.Namespace, job: JobConfig) -> None:
    """Clear errors for sizes the run cannot honour, before any process group exists."""
    for name in ("steps", "tp", "cp"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be a positive int, got {value!r}")
    if args.sp and args.tp == 1:
        raise ValueError("--sp needs --tp > 1 (sequence parallelism splits over the TP group)")
    if args.sp and not job.train.device.startswith("cuda"):
        raise ValueError(f"--sp needs --device cuda (got {job.train.device!r}): Megatron's sequence-parallel "
                         "scatter allocates on the current CUDA device")
    chunks = chunks_per_sequence(args.cp, job.attention.cp_partition)
    if job.train.seq_len % chunks:
        raise ValueError(f"train.seq_len {job.train.seq_len} must be a multiple of {chunks} for --cp {args.cp} "
                         f"with the {job.attention.cp_partition!r} partition")
    if args.load is not None and not args.load.is_dir():
        raise ValueError(f"--load {args.load}: no such checkpoint directory")


def init_distributed(tp: int, cp: int, device: torch.device, timeout_s: float = DIST_TIMEOUT_S) -> bool:
    """The default process group over tp·cp ranks (its collectives give up on a failed or stalled
    rank after `timeout_s`); True when this call created it (then the caller destroys it). An already
    initialised group (a test harness, an outer launcher) is used as is."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp * cp:
        raise ValueError(f"WORLD_SIZE={world} but --tp {tp} × --cp {cp} = {tp * cp}: launch with "
                         f"torchrun --nproc-per-node {tp * cp} (no data parallelism here)")
    if dist.is_initialized():
        return False
    if "MASTER_ADDR" not in os.environ:  # plain `python`: a single-rank group on a local port
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return True


def build_model(job: JobConfig, tp: int, cp: int, device: torch.device, gpu_init: bool = False) -> torch.nn.Module:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    attention_kwargs, hybrid_overrides = to_megatron_kwargs(job.attention, fields)
    # megatron-core 0.16's default cuda_graph_scope "full" is deprecated (warned at every build); an
    # empty list is the same scope. This example captures no CUDA graphs.
    graph_scope = {"cuda_graph_scope": []} if "cuda_graph_scope" in fields else {}
    config = MLATransformerConfig(
        **attention_kwargs, **graph_scope, tensor_model_parallel_size=tp, context_parallel_size=cp,
        ffn_hidden_size=job.model.ffn_hidden_size, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0,
        # CPU initialisation draws every weight whole and keeps this rank's block, as our layers do:
        # the model is the same at any --tp, so runs at different layouts can be compared.
        use_cpu_initialization=device.type == "cpu" or not gpu_init)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(job.train.seed)  # Megatron's TP init streams
    torch.manual_seed(job.train.seed)
    model = hybrid_gpt_model(config, job.model.vocab_size, job.model.max_seq_len,
                             gpt_kwargs={"share_embeddings_and_output_weights": job.model.tie_embeddings},
                             **hybrid_overrides)
    return model.to(device)


def context_parallel_part(batch: Batch, positions: torch.Tensor, partition: str) -> tuple[Batch, torch.Tensor]:
    """This CP rank's part of every row: inputs / targets / loss mask / positions `[B, S]` →
    `[B, S/cp]`, in the attention layers' `partition` (Megatron's GPTModel expects its inputs, labels
    and positions already split this way). The whole batch without CP."""
    from megatron.core import parallel_state

    cp, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    if cp == 1:
        return batch, positions
    return context_parallel_batch(batch, cp, rank, partition), shard_sequence(positions, cp, rank, partition, dim=1)


def batch_loss(token_loss: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(this rank's share, the batch loss)` of the token-mean loss over the whole batch.

    token_loss / loss_mask: `[B, S/cp]` this CP rank's positions. The share (carries gradient) is the
    rank's masked loss sum over the batch's masked token count, so the shares of the CP ranks add up
    to the CP 1 loss; the batch loss is that sum (detached, the same on every rank)."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    count = loss_mask.sum().float()
    dist.all_reduce(count, group=group)
    share = (token_loss.float() * loss_mask).sum() / count
    total = share.detach().clone()
    dist.all_reduce(total, group=group)
    return share, total


def average_gradients_over_context_parallel(model: torch.nn.Module) -> None:
    """Average the gradients over the CP group, as Megatron's DDP does over data-and-context ranks.

    Each rank back-propagated `cp ×` its loss share (Megatron's schedule scales the loss that way), so
    the average is the full-batch gradient on every CP rank. One all-reduce per gradient dtype."""
    from megatron.core import parallel_state

    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=parallel_state.get_context_parallel_group())
        flat.div_(cp)
        for grad, value in zip(same, flat.split([g.numel() for g in same])):
            grad.copy_(value.view_as(grad))


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the norm of the whole gradient: TP-split parameters (Megatron's
    `tensor_model_parallel` attribute, which the hybrid layers set too) add their squares over TP,
    replicated ones count once, so every TP rank applies the same factor. Run after the CP average:
    CP ranks then hold the same gradients, so they need no reduction here. Returns the norm before
    clipping."""
    from megatron.core import parallel_state

    grads = [(p.grad, getattr(p, "tensor_model_parallel", False)) for p in model.parameters() if p.grad is not None]
    split = sum((g.float().pow(2).sum() for g, is_split in grads if is_split), torch.zeros(()))
    whole = sum((g.float().pow(2).sum() for g, is_split in grads if not is_split), torch.zeros(()))
    split = split.to(grads[0][0].device)
    dist.all_reduce(split, group=parallel_state.get_tensor_model_parallel_group())
    norm = (split + whole.to(split.device)).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad, _ in grads:
        grad.mul_(scale)
    return norm


def save_checkpoint(model: torch.nn.Module, directory: Path, next_step: int) -> None:
    """Megatron distributed checkpoint of the model's shards and the step to resume at (collective)."""
    save_dist_checkpoint({"model": model.sharded_state_dict(), "step": next_step}, str(directory))


def load_checkpoint(model: torch.nn.Module, directory: Path) -> int:
    """Load `save_checkpoint`'s model into `model` (any TP / CP split); returns the step to resume at."""
    loaded = load_dist_checkpoint({"model": model.sharded_state_dict()}, str(directory))
    model.load_state_dict(loaded["model"])
    return int(loaded["step"])


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the loss of every step run (all ranks)."""
    args = parse_args(argv)
    require_megatron()
    # Megatron's launch scripts export this for its tensor-parallel communication (one hardware queue
    # keeps the all-reduces in issue order) and warn without it; no effect on CPU.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    job = JobConfig.from_yaml(resolve_config(args.config), steps=args.steps, device=args.device, dtype=args.dtype)
    check_arguments(args, job)
    if args.sp:
        job = dataclasses.replace(job, attention=job.attention.replace(sequence_parallel=True))
    device = resolve_device(job.train.device)
    owns_group = init_distributed(args.tp, args.cp, device, args.dist_timeout)
    try:
        check_same_on_all_ranks("the job's configuration", {**job.to_dict(), "flags": vars(args)})
        return run(job, args, device)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if owns_group:
            dist.destroy_process_group()


def run(job: JobConfig, args: argparse.Namespace, device: torch.device) -> list[float]:
    """Build (and maybe load) the model, train from its step to `--steps`, maybe save; the losses."""
    train = job.train
    leader = dist.get_rank() == 0
    model = build_model(job, args.tp, args.cp, device, args.gpu_init)
    start = load_checkpoint(model, args.load) if args.load is not None else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=train.weight_decay,
                                  betas=(train.adam_beta1, train.adam_beta2))
    text = load_corpus(train).train
    task = job.retrieval_task()
    positions = torch.arange(train.seq_len, device=device).expand(train.batch_size, -1)
    if leader:
        resumed = f", resumed from {args.load} at step {start}" if args.load is not None else ""
        print(f"Megatron GPTModel, TP {args.tp} CP {args.cp}: {sum(p.numel() for p in model.parameters()):,} "
              f"parameters per rank, attention kinds {job.attention.layer_pattern}{resumed}")
    losses = []
    for step in range(start, train.steps):
        losses.append(train_step(model, optimizer, job, text, task, positions, step, args.cp, device))
        indexer = tracked_indexer_losses()  # this step's, summed over CP; then cleared
        if leader:
            kl = ", ".join(f"{v:.2e}" for v, kind in zip(indexer, job.attention.layer_pattern) if kind == "C")
            print(f"step {step + 1}: loss {losses[-1]:.4f} | indexer KL (C layers) {kl}")
    if args.save is not None:
        save_checkpoint(model, args.save, max(start, train.steps))
        if leader:
            print(f"saved a distributed checkpoint to {args.save} (resumes at step {max(start, train.steps)})")
    return losses


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, job: JobConfig, text: torch.Tensor,
               task: RetrievalTask, positions: torch.Tensor, step: int, cp: int, device: torch.device) -> float:
    """One optimizer step on the step's batch; returns the batch loss (equal to the CP 1 loss)."""
    train = job.train
    # Same batch on every rank (seeded by the step); one microbatch per step, no loss scaling.
    batch = make_batch(text, task, train.batch_size, train.retrieval_rows,
                       seeded_generator(train.seed, "megatron", step)).to(device)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, train)
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(model, job, batch, positions, cp, device)
    clip_grad_norm(model, train.grad_clip)
    optimizer.step()
    return loss


def forward_backward(model: torch.nn.Module, job: JobConfig, batch: Batch, positions: torch.Tensor, cp: int,
                     device: torch.device) -> float:
    """Forward and backward of the whole batch `[B, S]` (this CP rank feeds its part); afterwards every
    rank holds the full-batch gradients of its parameters. Returns the batch loss."""
    local, local_positions = context_parallel_part(batch, positions, job.attention.cp_partition)
    # Gradients are averaged over CP (Megatron's rule), so the indexer-loss scale carries the cp factor.
    set_indexer_loss_scale(indexer_loss_scale(num_microbatches=1, cp_size=cp))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=job.train.dtype == "bf16"):
        token_loss = model(local.inputs, local_positions, None, labels=local.targets)  # [B, S/cp]
    share, loss = batch_loss(token_loss, local.loss_mask)
    (share * cp).backward()
    sum_sequence_parallel_gradients(model)
    average_gradients_over_context_parallel(model)
    return float(loss)


def sum_sequence_parallel_gradients(model: torch.nn.Module) -> None:
    """Under sequence parallelism each TP rank's norms saw only its rows: their weights (marked
    `sequence_parallel`, as Megatron marks them) get the sum over TP, as Megatron's
    `finalize_model_grads` does."""
    from megatron.core import parallel_state

    for param in model.parameters():
        if param.grad is not None and getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())


if __name__ == "__main__":
    main()
