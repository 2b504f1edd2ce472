"""Megatron distributed checkpoints of GPTModels with hybrid attention layers, resharded on load.

Every layer pattern must save and load through `model.sharded_state_dict()` and Megatron's
`dist_checkpointing.save/load` (called through `save_dist_checkpoint` / `load_dist_checkpoint`, which
also run on a torch without CUDA), also when its layers hold different parameters (W/C/H/M mixed),
and the checkpoint must reload under another TP or CP size: same parameters (gathered to TP 1),
same loss on a fixed batch. Then examples/megatron_pretrain.py: --cp, --save, --load. Runs in
spawned gloo processes (Megatron keeps its groups in module globals); skipped without megatron-core.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

pytest.importorskip("megatron.core", reason='megatron-core is not installed (pip install -e ".[megatron]")')

import torch.distributed as dist  # noqa: E402

from distributed import run_distributed  # noqa: E402
from megatron_dsa.integrations import megatron as integration  # noqa: E402
from megatron_dsa.parallel.context import shard_sequence  # noqa: E402
from megatron_dsa.parallel.sharding import partition_dims  # noqa: E402
from test_megatron_integration import megatron_config, tiny  # noqa: E402

SEQ, BATCH, VOCAB = 32, 2, 64


# ---------------------------------------------------------------- helpers run on every rank
def build(pattern: str, tp: int, cp: int, seed: int) -> torch.nn.Module:
    """A GPTModel of `pattern` on fresh Megatron groups (TP `tp`, CP `cp`, the rest data parallel)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    config, overrides = megatron_config(tiny(pattern), tensor_model_parallel_size=tp, context_parallel_size=cp)
    torch.manual_seed(seed)
    return integration.hybrid_gpt_model(config, VOCAB, SEQ, **overrides)


def fixed_batch_loss(model: torch.nn.Module) -> torch.Tensor:
    """Mean next-token loss of one fixed `[BATCH, SEQ]` batch; under CP every rank feeds its part of
    each row (the layers' partition) and the parts' sums add up over the CP group."""
    from megatron.core import parallel_state

    partition = model.decoder.layers[0].self_attention.config.cp_partition

    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    inputs, labels, positions = tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ).expand(BATCH, SEQ)
    cp, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    if cp > 1:
        inputs, labels, positions = (shard_sequence(t, cp, cp_rank, partition, dim=1)
                                     for t in (inputs, labels, positions))
    model.eval()
    with torch.no_grad():
        total = model(inputs, positions, None, labels=labels).sum()
    if cp > 1:
        dist.all_reduce(total, group=parallel_state.get_context_parallel_group())
    return total / (BATCH * SEQ)


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as the TP=1 model holds it: TP-split ones gathered along `partition_dim`."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    out = {}
    for name, param in model.named_parameters():
        if tp == 1 or not getattr(param, "tensor_model_parallel", False):
            out[name] = param.detach().clone()
            continue
        parts = [torch.empty_like(param) for _ in range(tp)]
        dist.all_gather(parts, param.detach().contiguous(), group=group)
        if name.endswith("mlp.linear_fc1.weight"):  # SwiGLU: each rank holds [its gate rows; its up rows]
            halves = [part.chunk(2) for part in parts]
            parts = [h[0] for h in halves] + [h[1] for h in halves]
        out[name] = torch.cat(parts, param.partition_dim)
    return out


def save(model: torch.nn.Module, directory: Path) -> None:
    integration.save_dist_checkpoint(model.sharded_state_dict(), str(directory))


def load(model: torch.nn.Module, directory: Path) -> None:
    model.load_state_dict(integration.load_dist_checkpoint(model.sharded_state_dict(), str(directory)))


def assert_same_model(loaded: torch.nn.Module, saved_parameters: dict[str, torch.Tensor],
                      loaded_loss: torch.Tensor, saved_loss: torch.Tensor, what: str) -> None:
    parameters = full_parameters(loaded)
    assert parameters.keys() == saved_parameters.keys(), what
    for name, value in parameters.items():
        assert torch.equal(value, saved_parameters[name]), f"{what}: {name} differs after loading"
    torch.testing.assert_close(loaded_loss, saved_loss, rtol=2e-6, atol=0, msg=what)


def check_replica_ids(model: torch.nn.Module, tp: int) -> None:
    """Attention entries of the model's sharded state dict: per-layer keys, TP-split parameters are
    TP fragments of one global tensor (attention sinks along dim 0), the rest (compressor, indexer,
    ...) whole; replica ids `(0, TP replica, data-and-context rank)`, so every global tensor's
    pieces have exactly one main replica over all ranks: on the first CP / DP rank, and for a
    TP-replicated tensor on TP rank 0."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    data_replica = parallel_state.get_data_parallel_rank(with_context_parallel=True)  # CP ranks included
    entries = model.sharded_state_dict()
    dims = {f"decoder.layers.{index}.self_attention.{name}": dim
            for index, layer in enumerate(model.decoder.layers)
            for name, dim in partition_dims(layer.self_attention).items()}
    assert dims and set(dims) <= set(entries)
    for key, dim in dims.items():
        entry = entries[key]
        assert entry.key == key and entry.prepend_axis_num == 0, f"{key}: stacked along a layer axis"
        if key.endswith("attn_sink"):
            assert dim == 0 and entry.global_shape == (4,) and entry.global_offset == (tp_rank * 4 // tp,)
        if ".compressor." in key or ".indexer." in key:
            assert dim is None, f"{key} must be replicated"
        fragments = [1] * len(entry.global_shape)
        if dim is not None:
            fragments[dim] = tp
        assert entry.axis_fragmentations == tuple(fragments), key
        # Megatron's convention (its own layers' entries carry the same ids).
        assert entry.replica_id == (0, 0 if dim is not None else tp_rank, data_replica), (key, entry.replica_id)
    counts = torch.tensor([sum(is_main_replica(entries[key].replica_id) for key in dims)], dtype=torch.float)
    dist.all_reduce(counts)
    split = sum(dim is not None for dim in dims.values())
    assert counts.item() == len(dims) - split + split * tp  # each global tensor's pieces saved once


def reshard_round_trips(rank: int, world: int, pattern: str, root: str) -> None:
    """TP 2 → TP 1, TP 1 → TP 2 and CP 2 → CP 1 (the remaining ranks data-parallel replicas)."""
    from megatron.core import parallel_state

    root_path = Path(root)
    for name, (save_tp, save_cp), (load_tp, load_cp) in (("tp2-to-tp1", (2, 1), (1, 1)),
                                                         ("tp1-to-tp2", (1, 1), (2, 1)),
                                                         ("cp2-to-cp1", (1, 2), (1, 1))):
        what = f"{pattern} {name}"
        saved = build(pattern, save_tp, save_cp, seed=1)
        check_replica_ids(saved, save_tp)
        saved_loss, saved_parameters = fixed_batch_loss(saved), full_parameters(saved)
        save(saved, root_path / name)
        loaded = build(pattern, load_tp, load_cp, seed=2)  # other initial weights: loading must set all
        assert any(not torch.equal(v, saved_parameters[k]) for k, v in full_parameters(loaded).items())
        load(loaded, root_path / name)
        assert_same_model(loaded, saved_parameters, fixed_batch_loss(loaded), saved_loss, what)
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("pattern", ["WCHC", "CM"])
def test_dist_checkpoint_reshards_tp_and_cp(pattern: str, tmp_path: Path) -> None:
    """Mixed layer kinds (different parameter sets and shapes per layer) save and load across TP/CP."""
    run_distributed(reshard_round_trips, 2, pattern, str(tmp_path))


# ---------------------------------------------------------------- examples/megatron_pretrain.py
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "megatron_pretrain.py"


def small_job(directory: Path) -> Path:
    """configs/tiny.yaml cut down to 2 layers (C, H), 2 rows of 64 tokens and a small corpus."""
    import yaml

    job = yaml.safe_load((EXAMPLE.parents[1] / "configs" / "tiny.yaml").read_text())
    job["attention"].update(num_layers=2, layer_pattern="CH")
    job["model"].update(max_seq_len=64)
    job["train"].update(batch_size=2, seq_len=64, retrieval_fraction=0.5, retrieval_pairs=1,
                        retrieval_queries=2, corpus_max_bytes=40_000, warmup_steps=1)
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def example_module() -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location("megatron_pretrain", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_main(*argv: str) -> list[float]:
    return example_module().main(list(argv))


def check_example_gradients_under_context_parallel(config: Path) -> None:
    """The example's CP 2 forward/backward: after its CP average every rank holds the CP 1 gradients,
    indexer parameters included, and its clip sees the CP 1 norm. Checked directly because Adam
    ignores a constant gradient scale, so equal losses alone would not catch a wrong factor."""
    from megatron.core import parallel_state
    from megatron_dsa.data import make_batch, seeded_generator
    from megatron_dsa.train import JobConfig, load_corpus

    module, job = example_module(), JobConfig.from_yaml(config)
    train, cpu = job.train, torch.device("cpu")
    text = load_corpus(train).train
    batch = make_batch(text, job.retrieval_task(), train.batch_size, train.retrieval_rows,
                       seeded_generator(train.seed, "megatron", 0))
    positions = torch.arange(train.seq_len).expand(train.batch_size, -1)
    runs = {}
    for cp in (2, 1):  # CP 1: both ranks run the whole batch (data-parallel replicas)
        model = module.build_model(job, 1, cp, cpu)
        loss = module.forward_backward(model, job, batch, positions, cp, cpu)
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        runs[cp] = loss, module.clip_grad_norm(model, 1e-3), grads
        parallel_state.destroy_model_parallel()
    (loss2, norm2, grads2), (loss1, norm1, grads1) = runs[2], runs[1]
    torch.testing.assert_close(torch.tensor([loss2, float(norm2)]), torch.tensor([loss1, float(norm1)]),
                               rtol=1e-5, atol=0)
    assert any(".indexer." in name for name in grads1)  # trained by the indexer loss alone: its scale
    for name, grad in grads1.items():
        scale = float(grad.abs().max())
        assert scale > 0, f"{name}: no gradient"
        torch.testing.assert_close(grads2[name], grad, rtol=1e-4, atol=1e-6 * scale, msg=name)


def two_rank_example_runs(rank: int, world: int, root: str) -> None:
    """CP 2 for 2 steps; TP 2 for 2 steps, then a checkpoint. Rank 0 writes the losses."""
    import json

    config = str(Path(root) / "job.yaml")
    check_example_gradients_under_context_parallel(Path(config))
    losses = {"cp2": example_main("--config", config, "--steps", "2", "--cp", "2"),
              "tp2": example_main("--config", config, "--steps", "2", "--tp", "2",
                                  "--save", str(Path(root) / "tp2-step2"))}
    if rank == 0:
        (Path(root) / "two_ranks.json").write_text(json.dumps(losses))


def one_rank_example_runs(rank: int, world: int, root: str) -> None:
    """The uninterrupted 3-step TP 1 run against the CP 2 and TP 2 runs and the TP 2 → TP 1 resume."""
    import json

    config = str(Path(root) / "job.yaml")
    other = json.loads((Path(root) / "two_ranks.json").read_text())
    uninterrupted = torch.tensor(example_main("--config", config, "--steps", "3"), dtype=torch.float64)
    resumed = example_main("--config", config, "--steps", "3", "--load", str(Path(root) / "tp2-step2"))
    assert len(resumed) == 1, "the resumed run must start at step 3"
    torch.testing.assert_close(torch.tensor(other["cp2"], dtype=torch.float64), uninterrupted[:2], rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(other["tp2"], dtype=torch.float64), uninterrupted[:2], rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(resumed, dtype=torch.float64), uninterrupted[2:], rtol=1e-5, atol=0)


def test_example_context_parallel_loss_and_tp_resharded_resume_equal_one_rank_run(tmp_path: Path) -> None:
    """examples/megatron_pretrain.py: --cp 2 losses equal the 1-rank run's, and a --tp 2 --save
    checkpoint resumed with --tp 1 --load gives the uninterrupted run's next loss."""
    small_job(tmp_path)
    run_distributed(two_rank_example_runs, 2, str(tmp_path))
    run_distributed(one_rank_example_runs, 1, str(tmp_path))


def test_example_and_loader_reject_bad_arguments(tmp_path: Path) -> None:
    """Checked before any process group exists: sizes, the CP split of the sequence, the checkpoint."""
    config = str(small_job(tmp_path))
    main = example_module().main
    with pytest.raises(ValueError, match="--cp must be a positive int"):
        main(["--config", config, "--cp", "0"])
    with pytest.raises(ValueError, match="seq_len 64 must be a multiple of 6 for --cp 3"):
        main(["--config", config, "--cp", "3"])
    with pytest.raises(ValueError, match="no such checkpoint directory"):
        main(["--config", config, "--load", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="WORLD_SIZE=1 but --tp 2 × --cp 1 = 2"):
        main(["--config", config, "--tp", "2"])
    with pytest.raises(ValueError, match="--sp needs --device cuda"):  # not Megatron's CUDA assertion mid-step
        main(["--config", config, "--tp", "2", "--sp", "--device", "cpu"])
    with pytest.raises(ValueError, match="is not a Megatron distributed checkpoint"):
        integration.load_dist_checkpoint({}, str(tmp_path))
