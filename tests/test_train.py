"""Fast tests of the language model, the data and the training job (CPU, fp32)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from megatron_dsa import compare, train
from megatron_dsa.checkpointing import latest_checkpoint, load_checkpoint
from megatron_dsa.config import HybridAttentionConfig
from megatron_dsa.data import Batch
from megatron_dsa.model import HybridLM, ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = REPO_ROOT / "configs" / "tiny.yaml"


def small_job_yaml(tmp_path: Path, **train_values) -> Path:
    """configs/tiny.yaml shrunk to seconds: short sequences, small batches, a small corpus."""
    job = yaml.safe_load(TINY_YAML.read_text())
    job["model"]["max_seq_len"] = 64
    job["train"].update(dict(batch_size=2, seq_len=64, retrieval_pairs=1, retrieval_queries=2, corpus_max_bytes=200_000,
                             warmup_steps=1, eval_batches=1, log_interval=1, eval_interval=2,
                             checkpoint_interval=2, out_dir=str(tmp_path / "run")), **train_values)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_model_forward_backward_shapes():
    attention = HybridAttentionConfig.from_preset("tiny")
    model = HybridLM(attention, ModelConfig(max_seq_len=48))
    tokens = torch.randint(0, 256, (3, 48))
    logits = model(tokens)
    assert logits.shape == (3, 48, 256) and logits.dtype == torch.float32
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert [layer.self_attention.kind.value for layer in model.layers] == list("WCHC")
    assert set(model.indexer_losses()) == {2, 4}  # the two C layers


def test_untied_head_and_too_long_input():
    model = HybridLM(HybridAttentionConfig.from_preset("tiny"), ModelConfig(max_seq_len=32,
                                                                          tie_embeddings=False))
    assert model.output_layer is not None
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_training_run_writes_checkpoint_and_plot(tmp_path):
    history = train.main(["--config", str(small_job_yaml(tmp_path)), "--steps", "3"])
    run_dir = tmp_path / "run"
    assert [s.step for s in history.steps] == [0, 1, 2]
    assert (run_dir / train.PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    latest = latest_checkpoint(run_dir)
    assert latest == run_dir / "checkpoints" / "step-000003" and (latest / ".metadata").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-000003"]
    assert train.read_history(run_dir).steps == history.steps
    assert all(set(s.indexer_losses) == {2, 4} for s in history.steps)


def test_resume_equals_uninterrupted_run(tmp_path):
    straight = tmp_path / "straight"
    straight.mkdir()
    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    # The LR horizon is pinned so the 2-step first leg follows the same schedule as a 4-step run.
    full = train.main(["--config", str(small_job_yaml(straight, lr_decay_steps=4)), "--steps", "4"])
    config = str(small_job_yaml(interrupted, lr_decay_steps=4))
    train.main(["--config", config, "--steps", "2"])
    resumed = train.main(["--config", config, "--steps", "4", "--resume"])
    assert [s.loss for s in resumed.steps] == [s.loss for s in full.steps]  # bitwise
    assert [s.indexer_losses for s in resumed.steps] == [s.indexer_losses for s in full.steps]


def test_retrieval_loss_falls_in_a_few_steps(tmp_path):
    """Smoke: on retrieval rows only, the answer-digit loss falls from uniform over bytes (ln 256)."""
    config = small_job_yaml(tmp_path, retrieval_fraction=1.0, batch_size=4, eval_interval=100, checkpoint_interval=100)
    history = train.main(["--config", str(config), "--steps", "20"])
    losses = [s.retrieval_loss for s in history.steps]
    assert all(s.lm_loss is None for s in history.steps)
    assert losses[0] > 5.0 and sum(losses[-4:]) / 4 < losses[0] - 2.0, losses


def test_answer_hits_counts_exact_arg_max_matches_on_masked_targets_only():
    """Hand-made logits over a vocabulary of 4: of the three masked targets two are hit; a hit on an
    unmasked position and a near miss (second-highest logit) do not count."""
    targets = torch.tensor([[1, 2, 3, 0], [3, 3, 1, 2]])
    loss_mask = torch.tensor([[False, True, False, True], [False, False, True, False]])
    predicted = torch.tensor([[1, 2, 0, 0], [3, 0, 2, 2]])  # hits at (0,1), (0,3); miss at (1,2)
    logits = torch.nn.functional.one_hot(predicted, 4).float() * 5.0
    logits[1, 2, 1] = 4.0  # the right answer, but not the arg-max
    batch = Batch(inputs=torch.zeros_like(targets), targets=targets, loss_mask=loss_mask,
                  is_retrieval=torch.tensor([True, True]))
    correct, counted = train.answer_hits(logits, batch)
    assert (int(correct), int(counted)) == (2, 3)


def test_example_script_runs(tmp_path):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "train_tiny.py"), "--steps", "2"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "step 2: loss" in result.stdout


@pytest.mark.parametrize("section, field, value", [
    ("train", "batch_size", 0),
    ("train", "lr", -1.0),
    ("train", "retrieval_fraction", 1.5),
    ("train", "retrieval_queries", 0),
    ("train", "retrieval_pairs", 27),  # more than the one-letter keys
    ("train", "retrieval_pair_bytes", 3),  # shorter than 'k=v;'
    ("train", "corpus", 7),
    ("train", "corpus", "no/such/corpus.txt"),
    ("train", "dtype", "fp16"),
    ("model", "ffn_hidden_size", 0),
    ("model", "vocab_size", "256"),
    ("attention", "hca_compress_ratio", 4),
])
def test_bad_config_values_name_the_field(section, field, value):
    job = yaml.safe_load(TINY_YAML.read_text())
    job[section][field] = value
    with pytest.raises(ValueError, match=field):
        train.JobConfig.from_dict(job)


def test_sequence_too_short_for_retrieval_or_model_is_rejected():
    job = yaml.safe_load(TINY_YAML.read_text())
    job["train"]["seq_len"] = 512
    with pytest.raises(ValueError, match="max_seq_len"):
        train.JobConfig.from_dict(job)
    job["train"].update(seq_len=40, retrieval_pairs=8)
    with pytest.raises(ValueError, match="seq_len"):
        train.JobConfig.from_dict(job)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_request_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        train.resolve_device("cuda")


def test_a_run_directory_with_a_checkpoint_is_never_overwritten_by_accident(tmp_path, capsys):
    config = str(small_job_yaml(tmp_path, checkpoint_interval=1))
    train.main(["--config", config, "--steps", "2"])
    latest = latest_checkpoint(tmp_path / "run")
    with pytest.raises(SystemExit):
        train.main(["--config", config, "--steps", "2"])
    assert "already holds a run" in capsys.readouterr().err
    assert latest_checkpoint(tmp_path / "run") == latest and (latest / ".metadata").is_file()
    with pytest.raises(SystemExit):
        train.main(["--config", config, "--steps", "3", "--resume", "--overwrite"])
    history = train.main(["--config", config, "--steps", "1", "--overwrite"])
    assert len(history.steps) == 1 and latest_checkpoint(tmp_path / "run").name == "step-000001"


def test_resume_keeps_the_saved_schedule_and_refuses_nothing_to_do(tmp_path, capsys):
    config = str(small_job_yaml(tmp_path, warmup_steps=1))
    first = train.main(["--config", config, "--steps", "3"])
    more = train.main(["--config", config, "--steps", "5", "--resume"])
    job = train.JobConfig.from_yaml(config, steps=3)
    assert [s.lr for s in more.steps[:3]] == [s.lr for s in first.steps]
    assert [s.lr for s in more.steps[3:]] == [train.learning_rate(step, job.train) for step in (3, 4)]
    assert more.steps[-1].lr == job.train.min_lr  # past the saved horizon: the final rate, not a new cosine
    stretched = train.main(["--config", config, "--steps", "6", "--resume", "--lr-decay-steps", "8"])
    assert stretched.steps[-1].lr > job.train.min_lr
    with pytest.raises(SystemExit):
        train.main(["--config", config, "--steps", "4", "--resume"])
    assert "leaves nothing to train" in capsys.readouterr().err


def test_default_run_directory_names_the_layout():
    assert train.layout_suffix(1, False, 1) == ""
    assert train.layout_suffix(2, True, 1) == "-tp2-sp"
    assert train.layout_suffix(2, False, 2) == "-tp2-cp2"


def test_training_stops_at_a_non_finite_gradient_and_keeps_a_finite_checkpoint(tmp_path, capsys, monkeypatch):
    """lr 1e4 without clipping diverges within a few steps: the job exits with an error naming the
    step before applying it, and every checkpoint it wrote holds finite tensors. Hashing is slowed
    so a save is still in flight when the job stops: the job must let it commit first."""
    from megatron_dsa import checkpointing

    digest = checkpointing._file_digest
    monkeypatch.setattr(checkpointing, "_file_digest", lambda path: (time.sleep(0.3), digest(path))[1])
    config = str(small_job_yaml(tmp_path, lr=1e4, min_lr=1e4, grad_clip=0.0, checkpoint_interval=1))
    with pytest.raises(SystemExit) as stopped:
        train.main(["--config", config, "--steps", "30"])
    assert stopped.value.code == 1
    message = capsys.readouterr().err
    assert "the gradient norm is" in message and "stopped before the update" in message
    latest = latest_checkpoint(tmp_path / "run")
    assert latest is not None
    # The job ended only after the save in flight committed: nothing half-written is left behind.
    assert not list((tmp_path / "run" / "checkpoints").glob("*.partial")), "a save was still in flight"
    job = train.JobConfig.from_yaml(config)
    model = train.build_model(job, torch.device("cpu"))
    optimizer = train.build_optimizer(model, job.train)
    load_checkpoint(latest, model, optimizer, None)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(v).all() for state in optimizer.state.values() for v in state.values())


def test_learning_rate_schedule_values():
    """Warm-up starts above zero and reaches lr at its last step; the cosine ends at min_lr on the
    horizon and stays there (an off-by-one in either shows here)."""
    config = train.TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=4, steps=10)
    assert train.learning_rate(0, config) == pytest.approx(0.25)
    assert train.learning_rate(3, config) == pytest.approx(1.0)
    assert train.learning_rate(4, config) == pytest.approx(1.0)  # cosine at progress 0
    assert train.learning_rate(7, config) == pytest.approx(0.55)  # half way: (lr + min_lr) / 2
    assert train.learning_rate(10, config) == pytest.approx(0.1)
    assert train.learning_rate(25, config) == pytest.approx(0.1)


def test_resuming_with_another_architecture_names_the_fields_before_reading_tensors(tmp_path, capsys):
    config = small_job_yaml(tmp_path)
    train.main(["--config", str(config), "--steps", "2"])
    job = yaml.safe_load(config.read_text())
    job["attention"]["hidden_size"] = 64  # every tensor's shape changes: reading one would fail obscurely
    config.write_text(yaml.safe_dump(job))
    with pytest.raises(SystemExit) as stopped:
        train.main(["--config", str(config), "--steps", "4", "--resume"])
    assert stopped.value.code == 1
    assert "was trained with a different `attention:` section (fields ['hidden_size'])" in capsys.readouterr().err


def test_compare_overlays_runs_and_names_a_directory_without_history(tmp_path, capsys):
    for name, pattern, accuracy in (("hybrid", "WCHC", 0.95), ("control", "WWWW", 0.11)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        history = train.History(evals=[train.EvalStats(step=0, val_lm_loss=5.5, retrieval_accuracy=0.0),
                                       train.EvalStats(step=50, val_lm_loss=2.0, retrieval_accuracy=accuracy)])
        train.write_history(history, run_dir)
        (run_dir / "config.yaml").write_text(yaml.safe_dump({"attention": {"layer_pattern": pattern}}))
    out = tmp_path / "plots" / "both.png"
    compare.main([str(tmp_path / "hybrid"), str(tmp_path / "control"), "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("WCHC (hybrid): retrieval accuracy 0.950 at step 50")
    assert printed[1].startswith("WWWW (control): retrieval accuracy 0.110 at step 50")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path), "--out", str(out)])
    assert "holds no history.json" in capsys.readouterr().err


def test_compare_summarises_the_runs_that_share_a_label_as_one_arm(tmp_path, capsys):
    """Seeds of one job labelled alike: each run's line, then the arm's mean and range; a single run is
    not an arm. The train loss is the mean of the last 30 steps."""
    def step(index: int, loss: float) -> train.StepStats:
        return train.StepStats(step=index, loss=loss, lm_loss=loss, retrieval_loss=None, indexer_losses={},
                               grad_norm=1.0, lr=1e-3, tokens_per_s=1.0)

    runs = {"fp8-s1": (0.5, 1.5, 9.0), "fp8-s2": (1.0, 1.2, 1.0), "bf16-s1": (0.9, 1.4, 1.0)}
    for name, (accuracy, val_loss, early_loss) in runs.items():
        steps = [step(i, early_loss) for i in range(10)] + [step(10 + i, 1.0 + 0.01 * i) for i in range(30)]
        history = train.History(steps=steps, evals=[train.EvalStats(step=40, val_lm_loss=val_loss,
                                                                    retrieval_accuracy=accuracy)])
        (tmp_path / name).mkdir()
        train.write_history(history, tmp_path / name)
    compare.main([str(tmp_path / name) for name in runs] + ["--labels", "fp8", "fp8", "bf16",
                                                          "--out", str(tmp_path / "arms.png")])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].endswith("validation LM loss 1.500 | train loss 1.145 (last 30 steps)")
    assert printed[3] == ("fp8 (2 runs, mean (min–max)): retrieval accuracy 0.750 (0.500–1.000) | validation LM "
                          "loss 1.350 (1.200–1.500) | train loss (last 30 steps) 1.145 (1.145–1.145)")
    assert printed[4].startswith("plot "), "bf16 has one run: no arm line"


def test_step_line_names_indexer_losses_only_where_there_are_some() -> None:
    from megatron_dsa.job.report import format_step

    stats = dict(step=4, loss=2.5, lm_loss=2.5, retrieval_loss=None, grad_norm=1.0, lr=1e-3, tokens_per_s=1000.0)
    assert "indexer" not in format_step(train.StepStats(indexer_losses={}, **stats))  # a window-only stack
    assert "| indexer L2=1.50e-03 |" in format_step(train.StepStats(indexer_losses={2: 1.5e-3}, **stats))
