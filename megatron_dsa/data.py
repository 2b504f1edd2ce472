"""Training data that needs no download: a built-in byte corpus plus a long-range retrieval task.

* LM text: the built-in corpus, `corpus/builtin-v1.txt.gz` (English-like prose written by
  `tools/make_corpus.py`, pinned by its SHA-256 so every Python version trains on the same bytes),
  or any text file given as `train.corpus`; split into train / validation by interleaved blocks.
* Retrieval: `k=v;` pairs (one-letter keys, one-digit values; each pair's slot is filled with copies
  of its value) open a sequence, a run of `.` follows, and queries `?k` spaced evenly over it ask the
  keys; the model must write the value next. With `configs/tiny.yaml` every answer lies beyond the
  reach of the whole stack of sliding windows (`window_reach`) from every earlier copy of its value,
  so only the compressed (C/H) paths of the hybrid attention can carry it. Loss counts the answers only.

Every batch is a pure function of `(seed, stream, index)`, so a resumed run sees the same batches.
"""

from __future__ import annotations

import gzip
import hashlib
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
BUILTIN_CORPUS = "builtin-v1.txt.gz"
BUILTIN_CORPUS_SHA256 = "6a0facbb6af11d3adac91bd5558f4b729e743bc0f40cf6c572943d009d9fc7e4"
BUILTIN = "builtin"  # the `train.corpus` value that selects the built-in corpus
KEY_ALPHABET = b"abcdefghijklmnopqrstuvwxyz"
VALUE_ALPHABET = b"0123456789"
PAIR_BYTES = 4  # 'k=v;': one group of the ratio-4 compressor
PAIR_VALUE = 2  # offset of the value in 'k=v;'
QUERY_BYTES = 3  # '?kv': the key itself predicts the answer
QUERY_ANSWER = 2  # offset of the answer in '?kv'
FILLER = b"."  # the gap between the pairs and the queries, and between queries


# ---------------------------------------------------------------- corpus
class CorpusError(ValueError):
    """The corpus file is missing, damaged or unusable."""


def load_corpus_bytes(corpus: str, max_bytes: int) -> Tensor:
    """The first `max_bytes` bytes of the corpus as `[N]` uint8: `"builtin"` or a file path."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    data = load_builtin_corpus() if corpus == BUILTIN else _read_text_file(Path(corpus))
    return torch.frombuffer(bytearray(data[:max_bytes]), dtype=torch.uint8)


def load_builtin_corpus() -> bytes:
    """The built-in corpus text, checked against its pinned SHA-256."""
    path = CORPUS_DIR / BUILTIN_CORPUS
    try:
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
        raise CorpusError(f"the built-in corpus {path} cannot be read ({error}); reinstall the package "
                          f"or regenerate it with `python tools/make_corpus.py --write`") from error
    digest = hashlib.sha256(data).hexdigest()
    if digest != BUILTIN_CORPUS_SHA256:
        raise CorpusError(f"the built-in corpus {path} is damaged: its text has SHA-256 {digest}, expected "
                          f"{BUILTIN_CORPUS_SHA256}; reinstall the package or regenerate it with "
                          f"`python tools/make_corpus.py --write`")
    return data


def _read_text_file(path: Path) -> bytes:
    if not path.is_file():
        raise CorpusError(f"train.corpus {str(path)!r} is neither 'builtin' nor an existing file")
    data = path.read_bytes()
    if not data:
        raise CorpusError(f"train.corpus {str(path)!r} is empty")
    return data


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
def window_reach(num_layers: int, window: int) -> int:
    """How far back a stack of `num_layers` sliding-window layers sees: each layer's window of
    `window` tokens (itself included) adds `window - 1` positions."""
    return num_layers * (window - 1)


@dataclass(frozen=True)
class RetrievalSamples:
    """`tokens [n, S+1]`; `answer_positions` / `source_positions` `[n, num_queries]`: where each
    answer byte sits in the queries and where its pair states the value (the `=v` byte)."""

    tokens: Tensor
    answer_positions: Tensor
    source_positions: Tensor


@dataclass(frozen=True)
class RetrievalTask:
    """`a=3;333…\n.....?a3.....?a3`: sequences of `seq_len + 1` bytes.

    `num_pairs` pairs of a distinct one-letter key and a random digit open the sequence, each in a
    slot of `pair_bytes` bytes: `k=v;` (one group of the ratio-4 compressor) then the value repeated
    to fill the slot, so the compressed entries holding a pair carry its value, not filler. A newline
    ends the pairs; the rest is `.` with `num_queries` queries `?kv` spaced evenly over it, the last
    at the very end. Queries ask the keys in random order, each key once before any key is asked
    again. Every answer lies more than `closest_distance` positions after any earlier copy of its
    value (in the pairs or in an earlier query); where that exceeds the reach of a window-only stack
    (`window_reach`), such a model cannot see the value and is at chance, 1/10 per answer.
    """

    seq_len: int
    num_pairs: int = 1
    num_queries: int = 2
    min_distance: int = 60
    pair_bytes: int = PAIR_BYTES

    def __post_init__(self) -> None:
        for name in ("seq_len", "num_pairs", "num_queries", "min_distance", "pair_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"retrieval {name} must be a positive integer, got {value!r}")
        if self.num_pairs > len(KEY_ALPHABET):
            raise ValueError(f"retrieval num_pairs {self.num_pairs} exceeds the {len(KEY_ALPHABET)} one-letter keys")
        if self.pair_bytes < PAIR_BYTES:
            raise ValueError(f"retrieval pair_bytes {self.pair_bytes} is shorter than a pair 'k=v;' ({PAIR_BYTES})")
        if self.query_spacing < QUERY_BYTES or self.closest_distance <= self.min_distance:
            raise ValueError(f"retrieval seq_len {self.seq_len} is too short for {self.num_pairs} pair(s) of "
                             f"{self.pair_bytes} bytes and {self.num_queries} query(ies) with every answer more "
                             f"than {self.min_distance} positions after any earlier copy of its value")

    @property
    def header_len(self) -> int:
        """Bytes of the pairs and the newline after them."""
        return self.pair_bytes * self.num_pairs + 1

    @property
    def query_spacing(self) -> int:
        """Positions between consecutive answers (the first query takes the leftover bytes too)."""
        return (self.seq_len + 1 - self.header_len) // self.num_queries

    @property
    def answer_positions(self) -> Tensor:
        """`[num_queries]` positions of the answers (the same in every sequence)."""
        last = self.seq_len  # the sequence's final byte
        return last - self.query_spacing * torch.arange(self.num_queries - 1, -1, -1)

    @property
    def closest_distance(self) -> int:
        """The fewest positions from any copy of a value to the position that predicts an answer of
        it: from the last byte of the pairs to the first answer, or between consecutive answers."""
        first_answer = int(self.answer_positions[0])
        last_value = self.header_len - 2  # the pairs end with a value byte (or ';' when pair_bytes is 4)
        return min((first_answer - 1) - last_value, self.query_spacing - 1)

    def sample(self, count: int, generator: torch.Generator) -> RetrievalSamples:
        """`count` sequences. The gap is a constant run of `.` (FILLER), so the pairs are the only
        compressed entries that carry anything (README: which layouts the tiny model learns)."""
        answers = self.answer_positions
        sequences, sources = [], []
        for _ in range(count):
            letters = torch.randperm(len(KEY_ALPHABET), generator=generator)[: self.num_pairs].tolist()
            keys = [KEY_ALPHABET[i:i + 1] for i in letters]
            values = _random_bytes(VALUE_ALPHABET, self.num_pairs, generator)
            rounds = -(-self.num_queries // self.num_pairs)
            asked = torch.cat([torch.randperm(self.num_pairs, generator=generator)
                               for _ in range(rounds)])[: self.num_queries].tolist()
            fill = self.pair_bytes - PAIR_BYTES
            tokens = bytearray(FILLER * (self.seq_len + 1))
            for i, key in enumerate(keys):
                slot = self.pair_bytes * i
                tokens[slot:slot + self.pair_bytes] = key + b"=" + values[i:i + 1] + b";" + values[i:i + 1] * fill
            tokens[self.header_len - 1] = ord("\n")
            for i, answer in zip(asked, answers.tolist()):
                tokens[answer - QUERY_ANSWER:answer + 1] = b"?" + keys[i] + values[i:i + 1]
            sequences.append(list(tokens))
            sources.append([self.pair_bytes * i + PAIR_VALUE for i in asked])
        return RetrievalSamples(tokens=torch.tensor(sequences, dtype=torch.long).view(count, self.seq_len + 1),
                                answer_positions=answers.expand(count, -1),
                                source_positions=torch.tensor(sources, dtype=torch.long).view(count, self.num_queries))


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
    retrieval = task.sample(retrieval_rows, generator)
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
