"""Train `HybridLM` on the built-in corpus (bytes) plus the long-range retrieval task.

    megatron-dsa train --preset tiny [--steps N] [--out DIR] [--device cuda] [--resume [CKPT]]
    megatron-dsa train --config my_job.yaml [--seed S] [--dtype fp32|bf16] ...

`python -m megatron_dsa.train` is the same command. `--preset NAME` reads a packaged job config
(the list is in `--help`); a `--config` path that does not exist but names a packaged config
(`configs/tiny.yaml`, `tiny.yaml`) reads the packaged copy, so both work from any directory.
The YAML file has three sections: `attention:` (`HybridAttentionConfig`), `model:` (`ModelConfig`)
and `train:` (`TrainConfig`); CLI flags override it. The output directory receives
`checkpoints/step-N/` (sharded model and optimizer, step, config, history and per-rank RNG states,
written asynchronously and atomically; see `megatron_dsa.checkpointing`), `history.json`,
`config.yaml` and `loss_curve.png`. Batches are pure functions of (seed, step), so `--resume`
continues exactly: the resumed run's losses equal those of an uninterrupted one (at another
--tp / --cp / --dp the checkpoint is resharded and the losses follow to rounding).

Under torchrun the processes form a DP × CP × TP grid (TP fastest): `--tp`, `--cp`, and DP =
WORLD_SIZE / (tp · cp). `train.batch_size` is the global batch; each DP rank runs its rows in
micro-batches of `train.micro_batch_size` (gradient accumulation), replicated or, with `--dp-shard`,
FSDP2-sharded over DP (see `megatron_dsa.data_parallel`).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import torch.distributed as dist
import yaml

from megatron_dsa.checkpointing import CheckpointError
from megatron_dsa.job.batches import (batch_rows, context_parallel_batch, load_corpus, shard_for_context_parallel,
                                      train_batch)
from megatron_dsa.job.config import DTYPES, JobConfig, TrainConfig
from megatron_dsa.job.errors import JobStopped, NonFiniteTrainingError
from megatron_dsa.job.evaluation import answer_hits, evaluate
from megatron_dsa.job.plots import PLOT_NAME, plot_history
from megatron_dsa.job.records import HISTORY_NAME, EvalStats, History, StepStats, read_history, write_history
from megatron_dsa.job.report import describe_retrieval, format_backends, format_eval, format_step
from megatron_dsa.job.resume import LAYOUT_FIELDS, job_extra, keep_saved_schedule, resume_from, resume_point
from megatron_dsa.job.loop import DIST_TIMEOUT_S, STALL_PROBE_S, check_launch, resolve_device, run, setup_parallel
from megatron_dsa.job.steps import (LossParts, autocast, build_model, build_optimizer, clip_grad_norm, compute_loss,
                                    finalize_grads, learning_rate, row_mean, train_step)
from megatron_dsa.packaged_configs import packaged_configs, preset_config, resolve_config
from megatron_dsa.parallel.consistency import MissingRanksError, RankMismatchError

# The job's building blocks live in `megatron_dsa.job`; they stay importable from here.
__all__ = [
    "DIST_TIMEOUT_S", "DTYPES", "HISTORY_NAME", "LAYOUT_FIELDS", "PLOT_NAME", "STALL_PROBE_S", "EvalStats", "History",
    "JobConfig", "JobStopped", "LossParts", "NonFiniteTrainingError", "StepStats", "TrainConfig", "answer_hits",
    "autocast", "batch_rows", "build_model", "build_optimizer", "check_launch", "clip_grad_norm", "compute_loss",
    "context_parallel_batch", "describe_retrieval", "evaluate", "finalize_grads", "format_backends", "format_eval",
    "format_step", "job_extra", "keep_saved_schedule", "layout_suffix", "learning_rate", "load_corpus", "main",
    "parse_args", "plot_history", "read_history", "resume_from", "resume_point", "row_mean", "run", "setup_parallel",
    "shard_for_context_parallel", "train_batch", "train_step", "write_history",
]


def parse_args(argv: Optional[Sequence[str]], prog: str = "python -m megatron_dsa.train"
               ) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    job = parser.add_mutually_exclusive_group(required=True)
    job.add_argument("--config", type=Path, help="job YAML (attention/model/train), or a packaged one by name")
    job.add_argument("--preset", help=f"a packaged job config: {', '.join(packaged_configs())}")
    parser.add_argument("--steps", type=int, help="total optimizer steps (overrides train.steps)")
    parser.add_argument("--out", dest="out_dir", help="output directory (overrides train.out_dir)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (overrides train.device)")
    parser.add_argument("--seed", type=int, help="overrides train.seed")
    parser.add_argument("--dtype", choices=DTYPES, help="fp32, or bf16 autocast (overrides train.dtype)")
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="CHECKPOINT",
                        help="continue from the checkpoint directory CHECKPOINT (default: the newest in "
                             "<out>/checkpoints); it loads at any --tp / --cp")
    parser.add_argument("--pack", action="store_true", default=None,
                        help="pack each batch's documents into one THD sequence (overrides train.pack)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (under torchrun)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (under torchrun)")
    parser.add_argument("--cp-comm-type", choices=("p2p", "all_gather"), help="context-parallel communication")
    parser.add_argument("--dp", type=int, help="data-parallel size (default and check: WORLD_SIZE / (tp · cp))")
    parser.add_argument("--dp-shard", action="store_true", default=None,
                        help="shard parameters, gradients and optimizer over DP with FSDP2 (sets "
                             "train.data_parallel: shard; default replicate)")
    parser.add_argument("--micro-batch-size", type=int,
                        help="rows per forward/backward on one DP rank (overrides train.micro_batch_size; "
                             "train.batch_size stays the global batch, the rest is gradient accumulation)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in an output directory that holds a run (deletes its checkpoints)")
    parser.add_argument("--lr-decay-steps", type=int,
                        help="cosine horizon (overrides train.lr_decay_steps; a resumed run keeps the saved one)")
    parser.add_argument("--dist-timeout", type=float, default=DIST_TIMEOUT_S, metavar="SECONDS",
                        help=f"how long a collective waits for a failed or stalled rank before the job ends "
                             f"(default {DIST_TIMEOUT_S:g})")
    parser.add_argument("--no-progress", action="store_true",
                        help="plain log lines, no progress bar (the default when stderr is not a terminal)")
    return parser, parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m megatron_dsa.train") -> History:
    parser, args = parse_args(argv, prog)
    try:  # configuration mistakes become a usage message, not a traceback
        config = preset_config(args.preset) if args.preset else resolve_config(args.config)
        job = JobConfig.from_yaml(config, steps=args.steps, out_dir=args.out_dir, device=args.device,
                                  seed=args.seed, dtype=args.dtype, pack=args.pack,
                                  lr_decay_steps=args.lr_decay_steps, micro_batch_size=args.micro_batch_size,
                                  data_parallel="shard" if args.dp_shard else None)
        parallel = {"sequence_parallel": args.sp or job.attention.sequence_parallel}
        if args.cp_comm_type:
            parallel["cp_comm_type"] = args.cp_comm_type
        job = dataclasses.replace(job, attention=job.attention.replace(**parallel))
        if job.attention.sequence_parallel and args.tp == 1:
            raise ValueError("--sp needs --tp > 1 (sequence parallelism splits over the TP group)")
        resolve_device(job.train.device)
        dp = check_launch(args.tp, args.cp, args.dp) // (args.tp * args.cp)  # a wrong launch is a usage error
        job.train.accumulation_steps(dp)  # the global batch must split into DP ranks' micro-batches
        if args.out_dir is None:  # the layout names the default directory: layouts never share one
            job = dataclasses.replace(job, train=dataclasses.replace(
                job.train, out_dir=job.train.out_dir + layout_suffix(args.tp, job.attention.sequence_parallel, args.cp,
                                                                     dp, job.train.data_parallel == "shard")))
        resume = resume_point(args, Path(job.train.out_dir))
    except (ValueError, TypeError, FileNotFoundError, yaml.YAMLError) as error:
        parser.error(str(error))
    owns_process_group = not dist.is_initialized()  # torchrun's: the job makes it; a caller's stays the caller's
    try:
        history = run(job, resume, tp=args.tp, cp=args.cp, overwrite=args.overwrite,
                      progress_bar=not args.no_progress, dp=args.dp, dist_timeout_s=args.dist_timeout)
    except (JobStopped, CheckpointError, RankMismatchError, MissingRanksError) as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    if owns_process_group and dist.is_initialized():
        # After the last save committed (`run` waits for it); NCCL warns at exit about a group left behind.
        # Not on the error paths: a rank that failed may leave collectives in flight that a destroy waits on.
        dist.destroy_process_group()
    return history


def layout_suffix(tp: int, sequence_parallel: bool, cp: int, dp: int = 1, dp_shard: bool = False) -> str:
    """`-tp2-sp-cp2-dp2` style suffix of a parallel layout ('' for one process); `-dp2-shard` under FSDP2."""
    return ((f"-tp{tp}" if tp > 1 else "") + ("-sp" if sequence_parallel else "") + (f"-cp{cp}" if cp > 1 else "")
            + (f"-dp{dp}" if dp > 1 else "") + ("-shard" if dp > 1 and dp_shard else ""))



if __name__ == "__main__":
    main()
