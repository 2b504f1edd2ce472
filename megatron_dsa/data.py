"""Training data that needs no download: byte-level Python stdlib source, plus a long-range
retrieval task.

* LM text: the bytes of this interpreter's own standard-library `.py` files (deterministic order,
  capped), split into train / validation by interleaved blocks.
* Retrieval: `key=value;` pairs at the start of a sequence, filler text, then `?key=` at the end;
  the model must produce the value. The answer lies far beyond the sliding window, so only the
  compressed (C/H) paths of the hybrid attention can carry it. Loss counts the answer bytes only.

Every batch is a pure function of `(seed, stream, index)`, so a resumed run sees the same batches.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

# Sub-trees of the stdlib directory that are not the standard library's own source.
SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "__pycache__"})
KEY_ALPHABET = b"abcdefghijklmnopqrstuvwxyz"
VALUE_ALPHABET = b"0123456789"


# ---------------------------------------------------------------- corpus
def stdlib_source_files() -> list[Path]:
    """The stdlib's `.py` files sorted by relative path (tests and third-party packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [path for path in root.rglob("*.py")
             if not SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def load_stdlib_corpus(max_bytes: int) -> Tensor:
    """Concatenated stdlib source, at most `max_bytes` bytes, as `[N]` uint8."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    chunks, total = [], 0
    for path in stdlib_source_files():
        data = path.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


@dataclass(frozen=True)
class CorpusSplit:
    train: Tensor  # [N_train] uint8
    validation: Tensor  # [N_val] uint8


def split_corpus(corpus: Tensor, block_size: int = 4096, validation_every: int = 20) -> CorpusSplit:
    """Every `validation_every`-th block of `block_size` bytes goes to validation, the rest to train.

    Interleaving (rather than a tail split) keeps both splits spread over the whole corpus.
    """
    num_blocks = -(-corpus.numel() // block_size)
    if num_blocks < 2:
        raise ValueError(f"corpus of {corpus.numel()} bytes is too small to split into blocks of "
                         f"{block_size}")
    blocks = corpus.split(block_size)
    is_validation = [i % validation_every == validation_every - 1 for i in range(num_blocks)]
    is_validation[-1] = is_validation[-1] or not any(is_validation)  # a tiny corpus still validates
    return CorpusSplit(train=torch.cat([b for b, v in zip(blocks, is_validation) if not v]),
                       validation=torch.cat([b for b, v in zip(blocks, is_validation) if v]))


def seeded_generator(seed: int, stream: str, index: int) -> torch.Generator:
    """A CPU generator for batch `index` of `stream` ("train", "val-lm", ...), independent of the rest."""
    mixed = random.Random(f"{seed}/{stream}/{index}").getrandbits(63)  # str seeds hash stably
    return torch.Generator().manual_seed(mixed)


def sample_windows(text: Tensor, count: int, length: int, generator: torch.Generator) -> Tensor:
    """`count` random contiguous windows of `length` bytes of `text`, `[count, length]` int64."""
    if text.numel() < length:
        raise ValueError(f"text of {text.numel()} bytes is shorter than one window of {length}")
    starts = torch.randint(0, text.numel() - length + 1, (count,), generator=generator)
    return text[starts.unsqueeze(1) + torch.arange(length)].long()


# ---------------------------------------------------------------- retrieval task
@dataclass(frozen=True)
class RetrievalSamples:
    """`tokens [n, S+1]`; `answer_positions` / `source_positions` `[n, value_len]`: where each
    answer byte sits at the end and where the same byte was stated in the pair list."""

    tokens: Tensor
    answer_positions: Tensor
    source_positions: Tensor


@dataclass(frozen=True)
class RetrievalTask:
    """`k1=v1;k2=v2;…\\n<filler>\\n?k=v`: sequences of `seq_len + 1` bytes ending in the answer.

    Every answer byte lies more than `min_distance` positions after the value it copies (give the
    attention window), so a model that only sees its sliding window is at chance (1/10 per byte).
    """

    seq_len: int
    num_pairs: int = 8
    key_len: int = 4  # with value_len 2, a pair is 8 bytes: whole compressor groups (r = 4, 16)
    value_len: int = 2
    min_distance: int = 16

    def __post_init__(self) -> None:
        for name in ("seq_len", "num_pairs", "key_len", "value_len", "min_distance"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"retrieval {name} must be a positive integer, got {value!r}")
        if self.num_pairs > len(KEY_ALPHABET) ** self.key_len:
            raise ValueError(f"retrieval num_pairs {self.num_pairs} exceeds the distinct keys of "
                             f"length {self.key_len}")
        closest = self._answer_start - self._source_start(self.num_pairs - 1)
        if self._filler_len < 0 or closest <= self.min_distance:
            raise ValueError(f"retrieval seq_len {self.seq_len} is too short for {self.num_pairs} pairs "
                             f"with answers more than {self.min_distance} bytes after their source")

    @property
    def _pair_stride(self) -> int:
        return self.key_len + self.value_len + 2  # key '=' value ';'

    @property
    def _answer_start(self) -> int:
        return self.seq_len + 1 - self.value_len

    @property
    def _filler_len(self) -> int:
        query_len = 2 + self.key_len + 1  # '\n?' key '='
        return self._answer_start - query_len - self.num_pairs * self._pair_stride - 1  # 1: '\n'

    def _source_start(self, pair: int) -> int:
        return pair * self._pair_stride + self.key_len + 1

    def sample(self, filler_text: Tensor, count: int, generator: torch.Generator) -> RetrievalSamples:
        """`count` sequences; filler windows are drawn from `filler_text` (uint8)."""
        fillers = sample_windows(filler_text, count, self._filler_len, generator)
        sequences, sources = [], []
        for row in range(count):
            keys = self._distinct_keys(generator)
            values = [_random_bytes(VALUE_ALPHABET, self.value_len, generator) for _ in keys]
            asked = int(torch.randint(0, self.num_pairs, (1,), generator=generator))
            pairs = b"".join(key + b"=" + value + b";" for key, value in zip(keys, values))
            sequences.append(list(pairs + b"\n" + bytes(fillers[row].tolist()) + b"\n?"
                                  + keys[asked] + b"=" + values[asked]))
            sources.append(self._source_start(asked))
        offsets = torch.arange(self.value_len)
        return RetrievalSamples(
            tokens=torch.tensor(sequences, dtype=torch.long).view(count, self.seq_len + 1),
            answer_positions=(self._answer_start + offsets).expand(count, -1),
            source_positions=torch.tensor(sources, dtype=torch.long).view(-1, 1) + offsets)

    def _distinct_keys(self, generator: torch.Generator) -> list[bytes]:
        keys: list[bytes] = []
        while len(keys) < self.num_pairs:
            key = _random_bytes(KEY_ALPHABET, self.key_len, generator)
            if key not in keys:
                keys.append(key)
        return keys


def _random_bytes(alphabet: bytes, length: int, generator: torch.Generator) -> bytes:
    picks = torch.randint(0, len(alphabet), (length,), generator=generator)
    return bytes(alphabet[i] for i in picks.tolist())


# ---------------------------------------------------------------- batches
@dataclass(frozen=True)
class Batch:
    """inputs / targets `[B, S]` int64 (targets = inputs shifted by one); loss_mask `[B, S]` bool
    (all True for LM rows, answer bytes only for retrieval rows); is_retrieval `[B]` bool."""

    inputs: Tensor
    targets: Tensor
    loss_mask: Tensor
    is_retrieval: Tensor

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.inputs, self.targets, self.loss_mask, self.is_retrieval)))


def make_batch(text: Tensor, task: RetrievalTask, batch_size: int, retrieval_rows: int,
               generator: torch.Generator) -> Batch:
    """`batch_size - retrieval_rows` LM rows from `text`, then `retrieval_rows` retrieval rows."""
    if not 0 <= retrieval_rows <= batch_size:
        raise ValueError(f"retrieval_rows must be in [0, {batch_size}], got {retrieval_rows}")
    seq_len = task.seq_len
    lm = sample_windows(text, batch_size - retrieval_rows, seq_len + 1, generator)
    retrieval = task.sample(text, retrieval_rows, generator)
    tokens = torch.cat((lm, retrieval.tokens))
    loss_mask = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    loss_mask[: lm.shape[0]] = True
    # Target position p predicts token p + 1.
    loss_mask[lm.shape[0]:].scatter_(1, retrieval.answer_positions - 1, True)
    is_retrieval = torch.arange(batch_size) >= lm.shape[0]
    return Batch(tokens[:, :-1], tokens[:, 1:], loss_mask, is_retrieval)


def pack_documents(batch: Batch, generator: torch.Generator) -> tuple[Batch, Tensor]:
    """Cut every LM row into two documents at a random point and lay all rows end to end.

    Returns the batch (same `[B, S]` tensors; the target that would cross a cut is masked out) and
    `cu_seqlens` (int32, `[ndocs + 1]`) of the documents in the flattened `[B·S]` token stream.
    Retrieval rows stay whole documents.
    """
    rows, seq_len = batch.inputs.shape
    boundaries, loss_mask = [0], batch.loss_mask.clone()
    for row in range(rows):
        start = row * seq_len
        if not bool(batch.is_retrieval[row]) and seq_len >= 4:
            cut = int(torch.randint(seq_len // 4, 3 * seq_len // 4, (1,), generator=generator))
            boundaries.append(start + cut)
            loss_mask[row, cut - 1] = False  # the next token belongs to another document
        boundaries.append(start + seq_len)
    packed = Batch(batch.inputs, batch.targets, loss_mask, batch.is_retrieval)
    return packed, torch.tensor(boundaries, dtype=torch.int32)
