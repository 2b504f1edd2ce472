"""Sample from a model the main job trained, through the decoding cache.

    megatron-dsa generate --checkpoint OUT [--prompt TEXT ...] [--max-new-tokens N]
                          [--temperature T] [--top-p P] [--seed S] [--retrieval N] [--cuda-graph]

`python -m megatron_dsa.generate` is the same command. `--checkpoint` is a checkpoint directory
(`OUT/checkpoints/step-N`) or a run's output directory (its newest checkpoint); the model's config comes
from the checkpoint's manifest. Prompts are prefilled together (packed, each at its own length) into an
`InferenceCache`, then every sequence gets one token per step. `--temperature 0` (the default) is
greedy; otherwise tokens are sampled at that temperature from the smallest set of tokens whose
probability reaches `--top-p`, from a generator seeded with `--seed`. `--retrieval N` scores the
retrieval task on N validation samples by generating each answer from the sample's bytes before it,
next to the teacher-forced score the main job's evaluation reports. `--cuda-graph` (CUDA devices) captures
the whole model's one-token decode step once as a CUDA graph (`layers.DecodeGraph`) and replays it for
every further token; the prefill stays eager.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import yaml
from torch import Tensor

from megatron_dsa.checkpointing import CheckpointError, latest_checkpoint, load_checkpoint, read_manifest
from megatron_dsa.layers import DecodeGraph
from megatron_dsa.model import HybridLM
from megatron_dsa.packed_seq import PackedSeqParams

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


# ---------------------------------------------------------------- sampling
def next_tokens(logits: Tensor, temperature: float, top_p: float, generator: Optional[torch.Generator]) -> Tensor:
    """`logits [B, V]` → `[B]`: the argmax at temperature 0, else a sample from the nucleus `top_p` of
    `softmax(logits / temperature)` (the most probable tokens whose probability first reaches top_p)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    before = ordered.cumsum(-1) - ordered  # probability of the more likely tokens
    ordered = torch.where(before < top_p, ordered, 0.0)  # the most likely token always stays
    picked = torch.multinomial(ordered, 1, generator=generator)
    return order.gather(-1, picked).squeeze(-1)


def check_sampling(temperature: float, top_p: float) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.no_grad()
def generate(model: HybridLM, prompts: Sequence[Tensor], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, generator: Optional[torch.Generator] = None, use_cache: bool = True,
             cuda_graph: bool = False, fp8_indexer_keys: bool = False, fp8_attention_rows: bool = False) -> Tensor:
    """Continue each prompt (`[L_b]` int64 token ids, lengths may differ) by `max_new_tokens` tokens →
    `[B, max_new_tokens]`. With the cache the prompts are prefilled packed, then each step feeds one
    token per sequence; `use_cache=False` runs the full forward over every sequence at every step (the
    reference the cache must equal). `cuda_graph` (a model on a CUDA device, with the cache): the first
    one-token step is captured as a CUDA graph (`layers.DecodeGraph`) and every step replays it.
    `fp8_indexer_keys` / `fp8_attention_rows`: the cache keeps C layers' indexer keys / W, C and H layers' attention
    rows in FP8 (`LayerCache.for_layer`)."""
    check_sampling(temperature, top_p)
    for name, on in (("fp8_indexer_keys", fp8_indexer_keys), ("fp8_attention_rows", fp8_attention_rows)):
        if on and not use_cache:
            raise ValueError(f"{name} is a cache's option: it cannot be combined with use_cache=False")
    device = model.word_embeddings.weight.device
    check_cuda_graph(cuda_graph, use_cache, device)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(p.dim() != 1 or p.numel() == 0 for p in prompts):
        raise ValueError("give one or more prompts, each a non-empty 1-D tensor of token ids")
    # The model reads every token but the last one it samples.
    longest = max(p.numel() for p in prompts) + max_new_tokens - 1
    if longest > model.model_config.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens - 1 = {longest} tokens exceeds model.max_seq_len "
                         f"{model.model_config.max_seq_len}")
    prompts = [p.to(device) for p in prompts]
    step = (_cached_steps(model, prompts, longest, cuda_graph, dict(fp8_indexer_keys=fp8_indexer_keys,
                                                                    fp8_attention_rows=fp8_attention_rows))
            if use_cache else _recomputed_steps(model, prompts))
    generated: list[Tensor] = []
    logits = step(None)
    for _ in range(max_new_tokens):
        generated.append(next_tokens(logits, temperature, top_p, generator))
        if len(generated) < max_new_tokens:
            logits = step(generated[-1])
    return torch.stack(generated, dim=1)


def check_cuda_graph(cuda_graph: bool, use_cache: bool, device: torch.device, *, flags: bool = False) -> None:
    """CUDA-graph decoding needs the cache and a CUDA device; `flags`: name the CLI's options, not the
    arguments of `generate`."""
    graph, no_cache, where = (("--cuda-graph", "--no-cache", "--device") if flags else
                              ("cuda_graph", "use_cache=False", "the model on"))
    if cuda_graph and not use_cache:
        raise ValueError(f"{graph} replays the cached one-token decode step: it cannot be combined with {no_cache}")
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"{graph} needs a CUDA device (CUDA graphs), got {where} {device}")


def _cached_steps(model: HybridLM, prompts: list[Tensor], capacity: int, cuda_graph: bool, cache_options: dict):
    """`step(None)` prefills the prompts; `step(tokens [B])` decodes one token each → last logits `[B, V]`
    (with `cuda_graph`, graph memory that the next step overwrites; `cache_options`: `new_inference_cache`'s)."""
    cache = model.new_inference_cache(len(prompts), capacity, **cache_options)
    graph: Optional[DecodeGraph] = None

    def decode(tokens: Tensor) -> Tensor:  # tokens [B, 1]
        return model(tokens, inference_cache=cache)[:, -1]

    def step(tokens: Optional[Tensor]) -> Tensor:
        nonlocal graph
        if tokens is not None:
            if not cuda_graph:
                return decode(tokens.unsqueeze(1))
            if graph is None:
                graph = DecodeGraph(decode, tokens.unsqueeze(1), cache.layers)
            return graph(tokens.unsqueeze(1))
        lengths = torch.tensor([p.numel() for p in prompts])
        cu = torch.zeros(len(prompts) + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        packed = PackedSeqParams(cu_seqlens_q=cu.to(prompts[0].device), max_seqlen_q=int(lengths.max()))
        logits = model(torch.cat(prompts).unsqueeze(0), packed_seq_params=packed, inference_cache=cache)[0]
        return logits[cu[1:].long().to(logits.device) - 1]

    return step


def _recomputed_steps(model: HybridLM, prompts: list[Tensor]):
    sequences = list(prompts)

    def step(tokens: Optional[Tensor]) -> Tensor:
        if tokens is not None:
            sequences[:] = [torch.cat((s, t.view(1))) for s, t in zip(sequences, tokens)]
        return torch.cat([model(s.unsqueeze(0))[:, -1] for s in sequences])

    return step


# ---------------------------------------------------------------- retrieval scored by generation
@dataclasses.dataclass(frozen=True)
class RetrievalScores:
    """Answer bytes right (per byte) and answers right in full, by greedy generation; the teacher-forced
    per-byte score (each answer byte predicted from the true bytes before it) for comparison."""

    samples: int
    generated_bytes: float
    generated_answers: float
    teacher_forced_bytes: float


@torch.no_grad()
def score_retrieval(model: HybridLM, tokens: Tensor, answer_positions: Tensor) -> RetrievalScores:
    """Retrieval samples `tokens [n, S+1]` with their answers at `answer_positions [n, A]`: each answer
    is generated greedily, through the decoding cache, from the sample's bytes before it (the filler
    and the keys asked between answers are the task's, not the model's to guess), and compared with
    the sample's answer byte."""
    prompts = [row[:position] for row, positions in zip(tokens, answer_positions.tolist()) for position in positions]
    generated = generate(model, prompts, 1).view(answer_positions.shape)
    answers = tokens.gather(1, answer_positions).to(generated.device)
    right = generated == answers
    device = model.word_embeddings.weight.device
    predicted = model(tokens[:, :-1].to(device)).argmax(-1)  # position t predicts token t + 1
    forced = predicted.gather(1, (answer_positions - 1).to(device)) == answers
    return RetrievalScores(tokens.shape[0], float(right.double().mean()), float(right.all(1).double().mean()),
                           float(forced.double().mean()))


# ---------------------------------------------------------------- loading a main-job checkpoint
def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run's output directory's newest checkpoint."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    newest = latest_checkpoint(path)
    if newest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint directory (OUT/checkpoints/step-N) nor a "
                                f"run directory with a checkpoint")
    return newest


def load_model(checkpoint: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> HybridLM:
    """The trained model of a main-job checkpoint, on one process, in `dtype`, in eval mode."""
    from megatron_dsa.train import JobConfig, build_model, build_optimizer

    path = resolve_checkpoint(checkpoint)
    saved = read_manifest(path)["config"]
    job = JobConfig.from_dict(saved)
    # One process here: the saved parallel layout does not apply (the weights load at any layout).
    job = dataclasses.replace(job, attention=dataclasses.replace(job.attention, sequence_parallel=False))
    model = build_model(job, device)
    load_checkpoint(path, model, build_optimizer(model, job.train), None)
    return model.to(dtype).eval()


def retrieval_samples(checkpoint: Path, count: int, seed: int) -> tuple[Tensor, Tensor]:
    """`count` retrieval samples of the checkpoint's task."""
    from megatron_dsa.data import seeded_generator
    from megatron_dsa.train import JobConfig

    job = JobConfig.from_dict(read_manifest(resolve_checkpoint(checkpoint))["config"])
    samples = job.retrieval_task().sample(count, seeded_generator(seed, "generate-retrieval", 0))
    return samples.tokens, samples.answer_positions


# ---------------------------------------------------------------- command line
def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[2].strip())
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="a checkpoint directory (OUT/checkpoints/step-N) or a run's output directory")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampler and the retrieval samples")
    parser.add_argument("--retrieval", type=int, default=0, metavar="N",
                        help="score the retrieval task on N validation samples, by generation and by teacher forcing")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the full forward at every step (slow; the cache's reference)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture the one-token decode step once as a CUDA graph and replay it (CUDA devices)")
    parser.add_argument("--fp8-indexer-keys", action="store_true",
                        help="keep C layers' indexer keys in the cache in FP8 (e4m3, a scale per key) and score them "
                             "with e4m3 queries: half their bytes, read every step; the scores differ from the full "
                             "forward's by that rounding")
    parser.add_argument("--fp8-attention-rows", action="store_true",
                        help="keep W, C and H layers' attention rows (window and compressed entries) in the cache as "
                             "e4m3 pages with a power-of-two scale per 64 columns and bf16 RoPE columns (FlashMLA's "
                             "FP8 sparse decode reads them where it is built); outputs differ from the full forward's "
                             "by that rounding")
    return parser


def main(argv: Optional[list[str]] = None, prog: str = "python -m megatron_dsa.generate") -> int:
    args = build_parser(prog).parse_args(argv)
    if not args.prompt and not args.retrieval:
        raise SystemExit("error: give --prompt TEXT (one or more) or --retrieval N")
    try:
        check_sampling(args.temperature, args.top_p)
        if args.retrieval < 0:
            raise ValueError(f"--retrieval must be >= 0, got {args.retrieval}")
        from megatron_dsa.train import resolve_device

        device = resolve_device(args.device)
        check_cuda_graph(args.cuda_graph, not args.no_cache, device, flags=True)
        for flag, on in (("--fp8-indexer-keys", args.fp8_indexer_keys), ("--fp8-attention-rows",
                                                                          args.fp8_attention_rows)):
            if on and args.no_cache:
                raise ValueError(f"{flag} is a cache's option: it cannot be combined with --no-cache")
        model = load_model(args.checkpoint, device, DTYPES[args.dtype])
        generator = torch.Generator(device=model.word_embeddings.weight.device).manual_seed(args.seed)
        if args.prompt:
            prompts = [torch.tensor(list(text.encode()), dtype=torch.long) for text in args.prompt]
            continuations = generate(model, prompts, args.max_new_tokens, args.temperature, args.top_p,
                                     generator, use_cache=not args.no_cache, cuda_graph=args.cuda_graph,
                                     fp8_indexer_keys=args.fp8_indexer_keys,
                                     fp8_attention_rows=args.fp8_attention_rows)
            for text, continuation in zip(args.prompt, continuations):
                print(text + bytes(continuation.tolist()).decode(errors="replace"))
        if args.retrieval:
            scores = score_retrieval(model, *retrieval_samples(args.checkpoint, args.retrieval, args.seed))
            print(f"retrieval, {scores.samples} samples: generated answers {scores.generated_answers:.1%} right "
                  f"({scores.generated_bytes:.1%} of bytes); teacher forcing {scores.teacher_forced_bytes:.1%} "
                  f"of bytes")
    except (ValueError, TypeError, FileNotFoundError, CheckpointError, yaml.YAMLError) as error:
        raise SystemExit(f"error: {error}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
