"""The built-in corpus (pinned bytes, clear errors when damaged) and the retrieval task (decoded
independently of its generator; out of reach of a window-only model)."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from megatron_dsa import data
from megatron_dsa.data import CorpusError, load_builtin_corpus, load_corpus_bytes, make_batch, seeded_generator
from megatron_dsa.model import HybridLM
from megatron_dsa.train import JobConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = REPO_ROOT / "configs" / "tiny.yaml"
# Pinned here as well as in data.py: a changed corpus must be a deliberate new version.
CORPUS_SHA256 = "6a0facbb6af11d3adac91bd5558f4b729e743bc0f40cf6c572943d009d9fc7e4"
CORPUS_BYTES = 3_000_000


# ---------------------------------------------------------------- corpus
def test_builtin_corpus_is_the_pinned_text():
    text = load_builtin_corpus()
    assert len(text) == CORPUS_BYTES and hashlib.sha256(text).hexdigest() == CORPUS_SHA256
    assert not set(text) & set(b"=;?")  # the retrieval delimiters never occur in filler text
    head = load_corpus_bytes("builtin", 1000)
    assert head.dtype == torch.uint8 and bytes(head.tolist()) == text[:1000]


def test_corpus_script_reproduces_the_shipped_file():
    spec = importlib.util.spec_from_file_location("make_corpus", REPO_ROOT / "tools" / "make_corpus.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert hashlib.sha256(script.generate()).hexdigest() == CORPUS_SHA256


@pytest.mark.parametrize("damage, message", [
    (lambda text: gzip.compress(text[:-1] + b"!", mtime=0), "damaged: its text has SHA-256"),
    (lambda text: gzip.compress(text, mtime=0)[:5000], "cannot be read"),
    (lambda text: b"not gzip at all", "cannot be read"),
])
def test_damaged_builtin_corpus_is_a_clear_error(tmp_path, monkeypatch, damage, message):
    (tmp_path / data.BUILTIN_CORPUS).write_bytes(damage(load_builtin_corpus()))
    monkeypatch.setattr(data, "CORPUS_DIR", tmp_path)
    with pytest.raises(CorpusError, match=message) as error:
        load_corpus_bytes("builtin", 100)
    assert "make_corpus.py --write" in str(error.value)


def test_missing_builtin_corpus_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CORPUS_DIR", tmp_path)
    with pytest.raises(CorpusError, match="cannot be read"):
        load_builtin_corpus()


def test_a_text_file_can_be_the_corpus(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_bytes(b"0123456789" * 10)
    assert bytes(load_corpus_bytes(str(path), 15).tolist()) == b"012345678901234"
    path.write_bytes(b"")
    with pytest.raises(CorpusError, match="empty"):
        load_corpus_bytes(str(path), 15)


# ---------------------------------------------------------------- retrieval task
SLOT = re.compile(rb"([a-z])=([0-9]);(\2*)")
QUERY = re.compile(rb"\?([a-z])([0-9])")


Pairs = dict[bytes, tuple[bytes, list[int]]]  # key -> (value, positions of every copy of the value)
Queries = list[tuple[bytes, bytes, int]]  # (key, answer, position of the answer)


def decode(sequence: bytes, pair_bytes: int) -> tuple[Pairs, Queries]:
    """Parse one retrieval sequence from its bytes alone: `{key: (value, value positions)}` of the
    pair slots and `[(key, answer, answer position)]` of the queries in the gap."""
    header, rest = sequence.split(b"\n", 1)
    assert len(header) % pair_bytes == 0
    pairs = {}
    for start in range(0, len(header), pair_bytes):
        slot = SLOT.fullmatch(header[start:start + pair_bytes])
        assert slot, f"a slot is k=v; then copies of v: {header[start:start + pair_bytes]!r}"
        copies = [start + 2] + [start + 4 + i for i in range(len(slot.group(3)))]
        pairs[slot.group(1)] = (slot.group(2), copies)
    assert len(pairs) == len(header) // pair_bytes, "distinct one-letter keys"
    offset = len(header) + 1
    queries = [(m.group(1), m.group(2), offset + m.start(2)) for m in QUERY.finditer(rest)]
    assert set(QUERY.sub(b"", rest)) == {ord(".")}, "the gap holds queries and filler only"
    return pairs, queries


def tiny_job() -> JobConfig:
    return JobConfig.from_yaml(TINY_YAML)


@pytest.mark.parametrize("task", [tiny_job().retrieval_task(),
                                  data.RetrievalTask(seq_len=200, num_pairs=3, num_queries=5, min_distance=16,
                                                     pair_bytes=8)],
                         ids=["tiny", "3-pairs-5-queries"])
def test_every_answer_is_determined_by_the_text_and_out_of_reach_of_its_earlier_copies(task):
    attention = tiny_job().attention
    # A stack of L sliding windows of w tokens (itself included) sees L * (w - 1) positions back.
    reach = attention.num_layers * (attention.csa_window_size - 1)
    samples = task.sample(64, seeded_generator(3, "decode-test", 0))
    for row, sequence in enumerate(samples.tokens.tolist()):
        pairs, queries = decode(bytes(sequence), task.pair_bytes)
        assert len(pairs) == task.num_pairs and len(queries) == task.num_queries
        assert samples.answer_positions[row].tolist() == [position for _, _, position in queries]
        asked = [key for key, _, _ in queries]
        assert len(set(asked[:task.num_pairs])) == min(task.num_pairs, task.num_queries)  # each key before repeats
        for index, (key, answer, position) in enumerate(queries):
            value, copies = pairs[key]
            assert answer == value and samples.source_positions[row, index] == copies[0]
            earlier = copies + [p for k, _, p in queries[:index] if k == key]
            assert (position - 1) - max(earlier) >= task.closest_distance  # logits at position - 1 predict it
    assert tiny_job().retrieval_task().closest_distance > reach


def test_retrieval_batches_are_deterministic_and_score_the_answers_only():
    job = tiny_job()
    task = job.retrieval_task()
    text = load_corpus_bytes("builtin", 200_000)
    first = make_batch(text, task, 4, 2, seeded_generator(7, "test", 0))
    again = make_batch(text, task, 4, 2, seeded_generator(7, "test", 0))
    other = make_batch(text, task, 4, 2, seeded_generator(7, "test", 1))
    assert all(torch.equal(a, b) for a, b in zip(vars(first).values(), vars(again).values()))
    assert not torch.equal(first.inputs, other.inputs)
    assert first.is_retrieval.tolist() == [False, False, True, True] and first.loss_mask[:2].all()
    for row in (2, 3):
        sequence = bytes(first.inputs[row].tolist()) + bytes(first.targets[row, -1:].tolist())
        _, queries = decode(sequence, task.pair_bytes)
        scored = first.loss_mask[row].nonzero().flatten().tolist()
        assert scored == [position - 1 for _, _, position in queries]  # target p is token p + 1
        assert [bytes([first.targets[row, p]]) for p in scored] == [answer for _, answer, _ in queries]


def test_a_task_that_does_not_fit_its_sequence_is_rejected():
    with pytest.raises(ValueError, match="too short"):
        data.RetrievalTask(seq_len=64, num_pairs=2, num_queries=2, min_distance=16, pair_bytes=16)
    with pytest.raises(ValueError, match="pair_bytes"):
        data.RetrievalTask(seq_len=256, pair_bytes=3)


@pytest.mark.parametrize("pattern, sees_the_values", [("WWWW", False), ("WCHC", True)])
def test_only_compressed_layers_let_the_answers_depend_on_the_values(pattern, sees_the_values):
    """Changing every digit of the sequence (each copy of each value, in the pairs and in earlier
    answers) changes a freshly initialised model's logits at the answer-predicting positions only if
    the model has C/H layers: the window-only control cannot see any copy of a value before it must
    write it, so it stays at chance however it is trained."""
    job = tiny_job()
    attention, task = job.attention.replace(layer_pattern=pattern), job.retrieval_task()
    torch.manual_seed(0)
    model = HybridLM(attention, job.model).eval()
    samples = task.sample(2, seeded_generator(1, "reach", 0))
    digits = (samples.tokens >= ord("0")) & (samples.tokens <= ord("9"))
    changed = torch.where(digits, (samples.tokens - ord("0") + 1) % 10 + ord("0"), samples.tokens)
    predicting = samples.answer_positions - 1
    with torch.no_grad():
        logits = [model(tokens[:, :-1]).gather(1, predicting.unsqueeze(-1).expand(-1, -1, 256))
                  for tokens in (samples.tokens, changed)]
    assert torch.equal(logits[0], logits[1]) != sees_the_values


def test_the_window_only_control_differs_from_tiny_in_its_layer_pattern_only():
    import yaml

    tiny = yaml.safe_load(TINY_YAML.read_text())
    control = yaml.safe_load((REPO_ROOT / "configs" / "tiny_window_only.yaml").read_text())
    assert control["attention"].pop("layer_pattern") == "WWWW" and tiny["attention"].pop("layer_pattern") == "WCHC"
    assert control["train"].pop("out_dir") != tiny["train"].pop("out_dir")
    assert control == tiny
