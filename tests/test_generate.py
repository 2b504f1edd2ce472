"""Generation (`megatron_dsa.generate`): the model through the decoding cache equals the full forward,
generation with the cache equals generation by recomputing every step, and the CLI samples from a
main-job checkpoint and scores the retrieval task by generation."""

from __future__ import annotations


import pytest
import torch

from megatron_dsa import HybridAttentionConfig
from megatron_dsa.__main__ import main as cli_main
from megatron_dsa.backends import call_counts, reset_call_counts
from megatron_dsa.checkpointing import CheckpointWriter
from megatron_dsa.data import RetrievalTask, seeded_generator
from megatron_dsa.generate import generate, next_tokens, score_retrieval
from megatron_dsa.model import HybridLM, ModelConfig
from megatron_dsa.packed_seq import PackedSeqParams
from megatron_dsa.train import History, JobConfig, TrainConfig, build_model, build_optimizer, job_extra


def small_job() -> JobConfig:
    attention = HybridAttentionConfig.from_preset("tiny", layer_pattern="WCHM", csa_window_size=6,
                                                  hca_compress_ratio=8, dsa_indexer_topk=3)
    return JobConfig(attention, ModelConfig(ffn_hidden_size=64, max_seq_len=96),
                     TrainConfig(seq_len=96, corpus_max_bytes=200_000, retrieval_pairs=2, retrieval_queries=2))


def model_fp64(seed: int = 0) -> HybridLM:
    job = small_job()
    torch.manual_seed(seed)
    model = HybridLM(job.attention, job.model).double().eval()
    with torch.no_grad():  # a larger scale than the init, so the greedy choices are not near-ties
        for parameter in model.parameters():
            parameter.mul_(8 if parameter.dim() >= 2 else 1)
    return model


@torch.no_grad()
def test_the_model_through_the_cache_equals_the_full_forward() -> None:
    model, lengths, extra = model_fp64(), [5, 17, 11], 9
    tokens = torch.randint(0, 256, (3, max(lengths) + extra), generator=torch.Generator().manual_seed(0))
    cache = model.new_inference_cache(3, max(lengths) + extra)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    stream = torch.cat([tokens[b, :n] for b, n in enumerate(lengths)]).unsqueeze(0)
    prefill = model(stream, PackedSeqParams(cu_seqlens_q=cu, max_seqlen_q=max(lengths)), cache)[0]
    steps = [model(torch.stack([tokens[b, n + i] for b, n in enumerate(lengths)]).unsqueeze(1),
                   inference_cache=cache)[:, 0] for i in range(extra)]
    for b, n in enumerate(lengths):
        full = model(tokens[b:b + 1, :n + extra])[0]
        assert float((prefill[cu[b]:cu[b + 1]] - full[:n]).abs().max()) < 1e-10
        assert float((torch.stack([s[b] for s in steps]) - full[n:]).abs().max()) < 1e-10


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 0.9)])
def test_generation_with_the_cache_equals_recomputing_every_step(temperature: float, top_p: float) -> None:
    model = model_fp64(1)
    draw = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=draw) for n in (3, 14, 9)]
    runs = [generate(model, prompts, 24, temperature, top_p, torch.Generator().manual_seed(7), use_cache=cached)
            for cached in (True, False)]
    assert torch.equal(runs[0], runs[1])
    assert len(set(runs[0].flatten().tolist())) > 3  # not one token repeated


def test_top_p_keeps_the_smallest_nucleus_and_temperature_zero_is_greedy() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = torch.stack([next_tokens(logits, 1.0, 0.7, torch.Generator().manual_seed(s)) for s in range(200)])
    assert set(draws.flatten().tolist()) == {0, 1}
    assert next_tokens(logits, 0.0, 1.0, None).tolist() == [0]
    with pytest.raises(ValueError, match="top_p"):
        generate(model_fp64(), [torch.tensor([1, 2])], 2, top_p=0.0)


def test_retrieval_scored_by_generation_counts_right_answers() -> None:
    model = model_fp64()
    task = RetrievalTask(seq_len=80, num_pairs=2, num_queries=3, min_distance=6)
    samples = task.sample(4, seeded_generator(0, "t", 0))
    tokens, positions = samples.tokens.clone(), samples.answer_positions
    # Make some answers the model's own greedy choice (by the full forward), so the count is not 0.
    with torch.no_grad():
        for row, column in ((0, 0), (0, 1), (0, 2), (1, 1), (2, 0), (2, 2)):
            position = int(positions[row, column])
            tokens[row, position] = model(tokens[row, :position].unsqueeze(0))[0, -1].argmax()
    scores = score_retrieval(model, tokens, positions)
    # Independent count: greedy answers by the full forward, each from the true bytes before it.
    right = [[bool(model(row[:p].unsqueeze(0))[0, -1].argmax() == row[p]) for p in ps.tolist()]
             for row, ps in zip(tokens, positions)]
    flat = [r for answers in right for r in answers]
    assert sum(flat) >= 6
    assert scores.samples == 4 and scores.generated_bytes == pytest.approx(sum(flat) / len(flat))
    assert scores.generated_answers == pytest.approx(sum(all(answers) for answers in right) / 4)


def test_the_cli_samples_from_a_main_job_checkpoint(tmp_path, capsys) -> None:
    job = small_job()
    model = build_model(job, torch.device("cpu"))
    writer = CheckpointWriter(tmp_path, None)
    writer.save(3, model, build_optimizer(model, job.train), job_extra(3, job, History()))
    writer.wait()
    args = ["generate", "--checkpoint", str(tmp_path), "--prompt", "def f(", "--prompt", "x",
            "--max-new-tokens", "5", "--dtype", "fp64"]
    assert cli_main(args) == 0
    model = model.double().eval()
    prompts = [torch.tensor(list(b"def f(")), torch.tensor(list(b"x"))]
    continuations = generate(model, prompts, 5)
    expected = "".join(text + bytes(c.tolist()).decode(errors="replace") + "\n"
                       for text, c in zip(("def f(", "x"), continuations))
    assert capsys.readouterr().out == expected
    assert cli_main(args + ["--temperature", "1.0", "--seed", "3"]) == 0
    sampled = capsys.readouterr().out
    assert cli_main(args + ["--temperature", "1.0", "--seed", "3", "--no-cache"]) == 0
    assert capsys.readouterr().out == sampled
    assert cli_main(["generate", "--checkpoint", str(tmp_path), "--retrieval", "2"]) == 0
    assert "retrieval, 2 samples: generated answers" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="error: .*temperature"):
        cli_main(args + ["--temperature", "-1"])
    with pytest.raises(SystemExit, match="error: .*neither a checkpoint"):
        cli_main(["generate", "--checkpoint", str(tmp_path / "nothing"), "--prompt", "x"])
    with pytest.raises(SystemExit, match="^error: --cuda-graph needs a CUDA device .*--device cpu$"):
        cli_main(args + ["--cuda-graph"])
    with pytest.raises(SystemExit, match="^error: --cuda-graph .* cannot be combined with --no-cache$"):
        cli_main(args + ["--cuda-graph", "--no-cache"])
    with pytest.raises(SystemExit, match="^error: --fp8-indexer-keys .* cannot be combined with --no-cache$"):
        cli_main(args + ["--fp8-indexer-keys", "--no-cache"])
    assert cli_main(args + ["--fp8-indexer-keys"]) == 0  # FP8 indexer keys in the cache (a C layer's indexer)
    assert capsys.readouterr().out.startswith("def f(")
    with pytest.raises(SystemExit, match="^error: --fp8-attention-rows .* cannot be combined with --no-cache$"):
        cli_main(args + ["--fp8-attention-rows", "--no-cache"])
    assert cli_main(args + ["--fp8-attention-rows"]) == 0  # W/C/H attention rows in FP8 pages
    assert capsys.readouterr().out.startswith("def f(")


def generated_caches(monkeypatch, **options) -> list:
    """The `LayerCache`s a generation of 4 tokens from two prompts with cache `options` makes; with the cache only."""
    from megatron_dsa.layers import decoding

    model, prompts = model_fp64(), [torch.tensor([1, 2, 3]), torch.tensor([4])]
    made = []
    original = decoding.LayerCache.for_layer
    monkeypatch.setattr(decoding.LayerCache, "for_layer",
                        lambda *args, **kwargs: made.append(original(*args, **kwargs)) or made[-1])
    assert generate(model, prompts, 4, **options).shape == (2, 4)
    name = next(iter(options))
    with pytest.raises(ValueError, match=f"{name} .* cannot be combined with use_cache=False"):
        generate(model, prompts, 3, use_cache=False, **options)
    return made


def test_generation_with_fp8_indexer_keys_reaches_every_c_layers_cache(monkeypatch) -> None:
    """`fp8_indexer_keys` gives every C layer's cache e4m3 indexer keys with their scales."""
    with_indexer = [cache for cache in generated_caches(monkeypatch, fp8_indexer_keys=True)
                    if cache.indexer_keys is not None]
    assert with_indexer and all(cache.indexer_keys.dtype == torch.float8_e4m3fn
                                and cache.indexer_key_scales is not None for cache in with_indexer)


def test_generation_with_fp8_attention_rows_reaches_every_sparse_layers_cache(monkeypatch) -> None:
    """`fp8_attention_rows` gives every W/C/H layer's cache FP8 pages and leaves M layers' latent rows as they are."""
    from megatron_dsa.ops.paged_rows import PagedRows

    made = generated_caches(monkeypatch, fp8_attention_rows=True)
    kinds = {cache.kind for cache in made}
    assert "M" in kinds and len(kinds) > 2, kinds
    for cache in made:
        assert isinstance(cache.window, PagedRows) == (cache.kind != "M"), cache.kind


def test_cuda_graph_generation_needs_the_cache_and_a_cuda_device() -> None:
    model, prompts = model_fp64(), [torch.tensor([1, 2, 3])]
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device .*got the model on cpu"):
        generate(model, prompts, 3, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph .* cannot be combined with use_cache=False"):
        generate(model, prompts, 3, use_cache=False, cuda_graph=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, options", [(torch.float32, {}), (torch.bfloat16, {}),
                                            (torch.bfloat16, dict(fp8_indexer_keys=True)),
                                            (torch.bfloat16, dict(fp8_attention_rows=True))],
                         ids=["fp32", "bf16", "bf16_fp8_keys", "bf16_fp8_rows"])
@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 0.9)])
def test_cuda_graph_generation_replays_the_eager_cached_steps(dtype: torch.dtype, options: dict,
                                                             temperature: float, top_p: float, monkeypatch) -> None:
    """Generation through a captured decode step gives the eager cached path's tokens, greedy and sampled from
    the same seed (with FP8 indexer keys or FP8 attention rows too); the steps after the capture are graph replays
    (counted), not eager decode steps (the dispatch counters move only while the step runs on the host: warm-up
    and capture)."""
    model = model_fp64(1).to(device="cuda", dtype=dtype)
    draw = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=draw) for n in (3, 14, 9)]
    new_tokens = 24
    run = lambda graphed: generate(model, prompts, new_tokens, temperature, top_p,  # noqa: E731
                                   torch.Generator(device="cuda").manual_seed(7), cuda_graph=graphed,
                                   **options)
    eager = run(False)
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: (replays.append(1), replay(graph))[1])
    reset_call_counts()
    graphed = run(True)
    assert torch.equal(graphed, eager)
    assert len(set(eager.flatten().tolist())) > 3  # not one token repeated
    assert len(replays) == new_tokens - 1
    steps_on_the_host = 2 + 1  # DecodeGraph's default warm-up steps, then the capture
    assert sum(n for (_, op), n in call_counts().items() if op in ("decode_attention", "paged_decode_attention")) == (
        steps_on_the_host * len(model.layers)), call_counts()  # every kind's step, M's too
    assert call_counts().get(("triton", "decode_compressor"), 0) > 0, call_counts()  # captured with the step
