"""Perplexity and KL divergence in llama-perplexity's conventions (llama.cpp `tools/perplexity`).

The text is tokenized once (BOS first when the file's `tokenizer.ggml.add_bos_token` says so) and cut into
`n_chunk = min(--chunks, tokens // ctx)` chunks of `ctx` tokens; each chunk runs from a fresh state, its
first token replaced by BOS when the vocabulary adds one. Only the second half is scored: the logits at
positions `ctx // 2 .. ctx - 2` predict the tokens after them (`ctx - 1 - ctx // 2` per chunk).
PPL = exp(mean NLL), and its uncertainty is `PPL * sqrt((mean(NLL^2) - mean(NLL)^2) / (count - 1))`.

A KL-divergence base file keeps, for every scored position, the reference model's log-probabilities as
llama.cpp stores them: per row `scale`, `min_log_prob` and one uint16 per vocabulary entry, covering the
16 nats below the row's top logit (entries below read as `min_log_prob` and do not enter the KLD sum).
It is an `.npz` (numpy zip) whose large member is streamed chunk by chunk on write and on read.
llama-perplexity's own base files (`--kl-divergence-base` written by llama.cpp: `_logits_`, n_ctx, n_vocab,
n_chunk, the tokens, then per scored row `scale`, `min_log_prob` and the codes padded to an even count)
are read as well, through a memory map.
"""

from __future__ import annotations

import codecs
import math
import os
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

BASE_FORMAT = "k3stream-kld-base-v1"
LLAMA_BASE_MAGIC = b"_logits_"  # llama-perplexity's base files begin so
LOG_PROB_RANGE = 16.0  # nats below the top logit that a base row resolves (llama.cpp's choice)
LEVELS = 65535.0


# ---------------------------------------------------------------- chunking


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks of a run: `tokens` [n_chunk * ctx] in file order (before any BOS replacement)."""

    ctx: int
    tokens: np.ndarray
    bos_id: int | None = None  # replaces each chunk's first token when set

    @property
    def n_chunk(self) -> int:
        return len(self.tokens) // self.ctx

    @property
    def first(self) -> int:
        return self.ctx // 2

    @property
    def scored(self) -> int:
        """Scored positions per chunk."""
        return self.ctx - 1 - self.first

    def chunk(self, index: int) -> list[int]:
        """Model input of chunk `index`."""
        ids = self.tokens[index * self.ctx : (index + 1) * self.ctx].tolist()
        if self.bos_id is not None:
            ids[0] = self.bos_id
        return ids

    def targets(self, index: int) -> np.ndarray:
        """The tokens the scored positions of chunk `index` predict."""
        start = index * self.ctx + self.first + 1
        return self.tokens[start : (index + 1) * self.ctx]


def plan_chunks(
    tokens: list[int] | np.ndarray,
    ctx: int,
    chunks: int | None = None,
    bos_id: int | None = None,
    source: str = "text",
    context_length: int | None = None,
) -> ChunkPlan:
    """llama-perplexity's chunking; refuses text shorter than two contexts, as it does, and a chunk
    longer than the model's `context_length` (when given)."""
    if context_length is not None and context_length < 4:
        raise ValueError(f"the model's context length {context_length} holds no perplexity chunk (4 tokens)")
    if ctx < 4 or (context_length is not None and ctx > context_length):
        bound = f"and the model's context length {context_length}" if context_length else "tokens or more"
        raise ValueError(f"--ctx {ctx} must be between 4 {bound}")
    if chunks is not None and chunks < 1:
        raise ValueError(f"--chunks {chunks}: must be at least 1")
    tokens = np.asarray(tokens, dtype=np.int32)
    if len(tokens) < 2 * ctx:
        raise ValueError(
            f"{source}: tokenizes to only {len(tokens)} tokens; a context of {ctx} needs at least {2 * ctx}"
        )
    n_chunk = len(tokens) // ctx if chunks is None else min(chunks, len(tokens) // ctx)
    return ChunkPlan(ctx=ctx, tokens=tokens[: n_chunk * ctx].copy(), bos_id=bos_id)


def _one_byte_replaced(error: UnicodeError) -> tuple[str, int]:
    return "\ufffd", error.start + 1


EACH_BYTE_REPLACED = "k3stream-each-byte-replaced"
codecs.register_error(EACH_BYTE_REPLACED, _one_byte_replaced)


def file_text(data: bytes) -> str:
    """A text file as llama-perplexity reads `-f`: its bytes as they are (a CRLF stays), one line break
    at the end dropped, and each byte that begins no UTF-8 sequence one U+FFFD, as llama.cpp's tokenizer
    reads it (Python's "replace" makes one of a whole broken sequence)."""
    return data.decode("utf-8", errors=EACH_BYTE_REPLACED).removesuffix("\n")


def text_tokens(tokenizer: Any, text: str) -> list[int]:
    """`common_tokenize(ctx, text, add_special=true)`: BOS per the file, control tokens not parsed."""
    return tokenizer.encode(text, allow_special=False)


def chunk_logits(model: Any, ids: list[int], first: int, batch: int) -> torch.Tensor:
    """Logits [len(ids) - 1 - first, vocab] of the scored positions, from a fresh state, `batch` tokens
    per forward call."""
    if batch < 1:
        raise ValueError(f"--batch {batch}: must be at least 1")
    state, kept = model.new_state(), []
    for start in range(0, len(ids), batch):
        logits = model.prefill(state, ids[start : start + batch])
        lo, hi = max(first - start, 0), min(len(ids) - 1 - start, logits.shape[0])
        if lo < hi:
            kept.append(logits[lo:hi])
    return torch.cat(kept).float()


# ---------------------------------------------------------------- perplexity


def token_nll(logits: torch.Tensor, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, float64."""
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    index = torch.as_tensor(targets, dtype=torch.long, device=logits.device)[:, None]
    return (-log_probs.gather(1, index)[:, 0]).cpu().numpy()


@dataclass
class Perplexity:
    """Running NLL sums, as llama-perplexity keeps them."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0

    def add(self, nll: np.ndarray) -> None:
        self.nll += float(nll.sum())
        self.nll2 += float(np.square(nll).sum())
        self.count += len(nll)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    def uncertainty(self) -> float | None:
        """llama.cpp's `+/-`: PPL times the standard error of the mean NLL (None when undefined)."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        if var <= 0 or self.count < 2:
            return None
        return self.ppl * math.sqrt(var / (self.count - 1))


# ---------------------------------------------------------------- base log-probabilities


def quantize_log_probs(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's compact log-softmax of rows: (uint16 [n, V], scale [n], min_log_prob [n])."""
    logits = logits.float()
    top = logits.max(dim=-1).values
    low = torch.maximum(logits.min(dim=-1).values, top - LOG_PROB_RANGE)
    log_sum = torch.log(torch.exp(logits.double() - top.double()[:, None]).sum(dim=-1)).float()
    min_log_prob = low - top - log_sum
    scale = (top - low) / LEVELS
    inv_scale = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, 1.0), 0.0)
    steps = torch.round((logits - low[:, None]) * inv_scale[:, None])
    codes = torch.where(logits > low[:, None], steps, 0.0).clamp(0, LEVELS).to(torch.int32)
    return codes.cpu().numpy().astype(np.uint16), scale.cpu().numpy(), min_log_prob.cpu().numpy()


def dequantize_log_probs(codes: np.ndarray, scale: np.ndarray, min_log_prob: np.ndarray) -> np.ndarray:
    """The base rows' log-probabilities (float32 [n, V])."""
    return codes.astype(np.float32) * scale[:, None] + min_log_prob[:, None]


def _atomic_temp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.partial")


class BaseWriter:
    """Streams a base file: `add(logits)` per chunk, `close()` renames it into place (atomic)."""

    def __init__(self, path: str | Path, plan: ChunkPlan, n_vocab: int, model_name: str = "") -> None:
        self.path, self.plan, self.n_vocab = Path(path), plan, n_vocab
        self.rows = plan.n_chunk * plan.scored
        self.temp = _atomic_temp(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)  # as `pack --out` and `dequantize` do
        self.zip = zipfile.ZipFile(self.temp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1)
        self.member: Any = None
        self.scales: list[np.ndarray] = []
        self.mins: list[np.ndarray] = []
        with self._writing():
            for name, value in _meta_arrays(plan, n_vocab, model_name).items():
                self._write_array(name, value)
            self.member = self.zip.open("log_probs.npy", "w", force_zip64=True)
            header = {"descr": "<u2", "fortran_order": False, "shape": (self.rows, n_vocab)}
            np.lib.format.write_array_header_2_0(self.member, header)

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Any failure inside removes the partial file; an OSError (a full disk) names the base file."""
        try:
            yield
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError) and exc.filename is None:
                exc.filename = str(self.path)
            raise

    def _write_array(self, name: str, value: np.ndarray) -> None:
        with self.zip.open(f"{name}.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, np.asarray(value), allow_pickle=False)

    def add(self, logits: torch.Tensor) -> None:
        codes, scale, min_log_prob = quantize_log_probs(logits)
        with self._writing():
            self.member.write(np.ascontiguousarray(codes, dtype="<u2").tobytes())
        self.scales.append(scale.astype("<f4"))
        self.mins.append(min_log_prob.astype("<f4"))

    def close(self) -> Path:
        """Finish the file and rename it into place; on any failure nothing is left behind."""
        with self._writing():
            self._finish()
        os.replace(self.temp, self.path)
        return self.path

    def _finish(self) -> None:
        self.member.close()
        written = sum(len(s) for s in self.scales)
        if written != self.rows:
            raise ValueError(f"{self.path}: {written} rows written, {self.rows} expected")
        self._write_array("scale", np.concatenate(self.scales))
        self._write_array("min_log_prob", np.concatenate(self.mins))
        self.zip.close()
        with open(self.temp, "rb") as f:
            os.fsync(f.fileno())

    def abort(self) -> None:
        for stream in (self.member, self.zip):  # each closed, so no file is left open for the collector
            with suppress(OSError, ValueError, AttributeError):
                stream.close()
        self.temp.unlink(missing_ok=True)


def _meta_arrays(plan: ChunkPlan, n_vocab: int, model_name: str) -> dict[str, np.ndarray]:
    return {
        "format": np.array(BASE_FORMAT),
        "ctx": np.array(plan.ctx, dtype=np.int64),
        "n_vocab": np.array(n_vocab, dtype=np.int64),
        "tokens": plan.tokens.astype(np.int32),
        "model": np.array(model_name),
    }


@dataclass
class BaseFile:
    """A saved base: its `ctx`, `n_vocab`, `tokens`, per-row `scale`/`min_log_prob`; `rows(n)` streams."""

    path: Path
    ctx: int
    n_vocab: int
    tokens: np.ndarray
    scale: np.ndarray
    min_log_prob: np.ndarray
    model: str = ""
    _zip: zipfile.ZipFile | None = field(default=None, repr=False)
    _llama_codes: np.ndarray | None = field(default=None, repr=False)  # [rows, n_vocab] of a llama.cpp file

    @classmethod
    def open(cls, path: str | Path) -> BaseFile:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such KL-divergence base file")
        with path.open("rb") as stream:
            if stream.read(len(LLAMA_BASE_MAGIC)) == LLAMA_BASE_MAGIC:
                return cls._open_llama(path)
        archive = zipfile.ZipFile(path) if zipfile.is_zipfile(path) else None
        try:
            if archive is None:
                raise ValueError("not a zip archive")
            arrays = {name: _read_member(archive, name) for name in _BASE_MEMBERS}
            base = cls._from_arrays(path, arrays, archive)
        except (KeyError, ValueError, TypeError, *DAMAGED_ZIP) as exc:
            if archive is not None:
                archive.close()
            raise ValueError(f"{path}: not a k3stream KL-divergence base file ({exc})") from None
        return base

    @classmethod
    def _from_arrays(cls, path: Path, arrays: dict[str, np.ndarray], archive: zipfile.ZipFile) -> BaseFile:
        if str(arrays["format"]) != BASE_FORMAT:
            raise ValueError(f"format {str(arrays['format'])!r}, expected {BASE_FORMAT!r}")
        if arrays["tokens"].dtype.kind not in "iu":
            raise ValueError(f"tokens of dtype {arrays['tokens'].dtype}, not integers")
        ctx, tokens = int(arrays["ctx"]), arrays["tokens"].astype(np.int32)
        if ctx < 4 or tokens.ndim != 1 or len(tokens) % ctx:
            raise ValueError(f"ctx {ctx} does not divide its {len(tokens)} tokens")
        rows = len(tokens) // ctx * (ctx - 1 - ctx // 2)
        if arrays["scale"].shape != (rows,) or arrays["min_log_prob"].shape != (rows,):
            raise ValueError(f"scale/min_log_prob do not hold the {rows} scored rows")
        return cls(
            path=path,
            ctx=ctx,
            n_vocab=int(arrays["n_vocab"]),
            tokens=tokens,
            scale=arrays["scale"].astype(np.float32),
            min_log_prob=arrays["min_log_prob"].astype(np.float32),
            model=str(arrays["model"]),
            _zip=archive,
        )

    @classmethod
    def _open_llama(cls, path: Path) -> BaseFile:
        """A llama-perplexity base file, its rows mapped (each row: scale and min_log_prob as two float32,
        then the codes, padded to an even count)."""
        head = np.fromfile(path, dtype="<i4", count=5)  # the magic's two words, n_ctx, n_vocab, n_chunk
        ctx, n_vocab, n_chunk = (int(v) for v in head[2:5]) if len(head) == 5 else (0, 0, 0)
        if ctx < 4 or n_vocab < 1 or n_chunk < 1:
            raise ValueError(
                f"{path}: llama-perplexity base file with n_ctx {ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}"
            )
        row_words = 2 * ((n_vocab + 1) // 2) + 4
        rows = n_chunk * (ctx - 1 - ctx // 2)
        tokens_at = len(LLAMA_BASE_MAGIC) + 12
        expected = tokens_at + 4 * ctx * n_chunk + 2 * row_words * rows
        if path.stat().st_size != expected:
            raise ValueError(
                f"{path}: llama-perplexity base file of {path.stat().st_size} bytes; n_ctx {ctx}, n_vocab "
                f"{n_vocab} and n_chunk {n_chunk} make {expected}"
            )
        tokens = np.fromfile(path, dtype="<i4", count=ctx * n_chunk, offset=tokens_at)
        body = np.memmap(
            path, dtype="<u2", mode="r", offset=tokens_at + 4 * ctx * n_chunk, shape=(rows, row_words)
        )
        floats = np.ascontiguousarray(body[:, :4]).view("<f4")
        return cls(
            path=path,
            ctx=ctx,
            n_vocab=n_vocab,
            tokens=tokens,
            scale=floats[:, 0].copy(),
            min_log_prob=floats[:, 1].copy(),
            _llama_codes=body[:, 4 : 4 + n_vocab],
        )

    def rows(self, per_chunk: int, n_chunk: int) -> Iterator[np.ndarray]:
        """uint16 [per_chunk, n_vocab] log-probability codes of each of the first `n_chunk` chunks."""
        if self._llama_codes is not None:
            for index in range(n_chunk):
                yield np.asarray(self._llama_codes[index * per_chunk : (index + 1) * per_chunk])
            return
        assert self._zip is not None
        with self._zip.open("log_probs.npy") as member:
            shape, dtype = _npy_header(member)
            if shape != (len(self.scale), self.n_vocab) or dtype != np.dtype("<u2"):
                raise ValueError(f"{self.path}: log_probs is {dtype} {shape}, rows do not match scale")
            row_bytes = 2 * self.n_vocab
            for _ in range(n_chunk):
                try:
                    data = member.read(per_chunk * row_bytes)
                except DAMAGED_ZIP as exc:
                    raise ValueError(f"{self.path}: log_probs is damaged ({exc})") from None
                if len(data) != per_chunk * row_bytes:
                    raise ValueError(f"{self.path}: log_probs ends early")
                yield np.frombuffer(data, dtype="<u2").reshape(per_chunk, self.n_vocab)

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()


_BASE_MEMBERS = ("format", "ctx", "n_vocab", "tokens", "model", "scale", "min_log_prob")


def _npy_header(member: Any) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(member)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _fortran, dtype = read(member)
    return shape, dtype


# what reading a zip member whose bytes were changed raises (a bad CRC, a broken deflate stream)
DAMAGED_ZIP = (zipfile.BadZipFile, zlib.error, EOFError)
# a member's array may take this many times its compressed bytes (deflate reaches ~1000x on zeros, a
# few times on token ids and floats) or this many bytes: more is a zip bomb, refused before allocating
MEMBER_RATIO, MEMBER_FLOOR = 256, 64 << 20


def _read_member(archive: zipfile.ZipFile, name: str) -> np.ndarray:
    info = archive.getinfo(f"{name}.npy")
    with archive.open(info) as member:
        shape, dtype = _npy_header(member)
        nbytes = math.prod(shape) * dtype.itemsize
        allowed = max(MEMBER_FLOOR, MEMBER_RATIO * info.compress_size)
        if nbytes > min(info.file_size, allowed):
            raise ValueError(
                f"{name} claims {nbytes} bytes of {dtype} {shape}; its member holds {info.file_size} "
                f"({info.compress_size} compressed)"
            )
        if dtype.hasobject:
            raise ValueError(f"{name} holds Python objects")
        return np.frombuffer(member.read(nbytes), dtype=dtype, count=math.prod(shape)).reshape(shape)


def check_base_matches(base: BaseFile, plan: ChunkPlan, n_vocab: int | None, source: str) -> None:
    """One-line refusal when this run's ctx, tokens or vocabulary (unless None) are not the saved ones."""
    if base.ctx != plan.ctx:
        raise ValueError(f"{base.path}: saved with ctx {base.ctx}, this run uses --ctx {plan.ctx}")
    saved = base.tokens[: len(plan.tokens)]
    differ = np.flatnonzero(saved != plan.tokens[: len(saved)])
    if len(differ):
        raise ValueError(
            f"{base.path}: tokens differ from {source}'s (first at token {int(differ[0])}); "
            "save the base from the same text"
        )
    if len(saved) < len(plan.tokens):
        raise ValueError(
            f"{base.path}: holds {len(base.tokens) // base.ctx} chunks, this run evaluates {plan.n_chunk}"
        )
    if n_vocab is not None and base.n_vocab != n_vocab:
        raise ValueError(f"{base.path}: saved with n_vocab {base.n_vocab}, the model has {n_vocab}")


# ---------------------------------------------------------------- KL divergence


ROW_BLOCK = 32


def kld_rows(
    logits: torch.Tensor, base_log_probs: np.ndarray, targets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row: NLL of the target under this model and under the base, KL(base || model) over the base
    entries above -16 nats (as llama.cpp sums it), and whether both rank the same token first."""
    log_q = torch.log_softmax(logits.double(), dim=-1).cpu().numpy()
    log_p = base_log_probs.astype(np.float64)
    rows = np.arange(len(targets))
    kld = np.where(log_p > -LOG_PROB_RANGE, np.exp(log_p) * (log_p - log_q), 0.0).sum(axis=-1)
    same_top = logits.argmax(dim=-1).cpu().numpy() == base_log_probs.argmax(axis=-1)
    return -log_q[rows, targets], -log_p[rows, targets], kld, same_top


@dataclass
class KLDivergence:
    """llama.cpp's `kl_divergence_result` sums, with every position's KLD and Δp kept for percentiles."""

    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list[np.ndarray] = field(default_factory=list)
    p_diff_values: list[np.ndarray] = field(default_factory=list)

    def add(self, logits: torch.Tensor, base_log_probs: np.ndarray, targets: np.ndarray) -> None:
        """One chunk: this model's logits [n, V] against the base's log-probabilities [n, V] (float64
        work in blocks of `ROW_BLOCK` rows, so a 160k vocabulary stays within a few hundred MB)."""
        for lo in range(0, len(targets), ROW_BLOCK):
            span = slice(lo, lo + ROW_BLOCK)
            self._add_rows(*kld_rows(logits[span], base_log_probs[span], targets[span]))

    def _add_rows(self, nll: np.ndarray, nll_base: np.ndarray, kld: np.ndarray, same_top: np.ndarray) -> None:
        p_diff = np.exp(-nll) - np.exp(-nll_base)
        self.sum_nll += nll.sum()
        self.sum_nll2 += np.square(nll).sum()
        self.sum_nll_base += nll_base.sum()
        self.sum_nll_base2 += np.square(nll_base).sum()
        self.sum_nll_nll_base += (nll * nll_base).sum()
        self.sum_kld += kld.sum()
        self.sum_kld2 += np.square(kld).sum()
        self.sum_p_diff += p_diff.sum()
        self.sum_p_diff2 += np.square(p_diff).sum()
        self.sum_p_diff4 += np.square(np.square(p_diff)).sum()
        self.n_same_top += int(same_top.sum())
        self.count += len(nll)
        self.kld_values.append(kld)
        self.p_diff_values.append(p_diff)

    def log_ppl(self) -> tuple[float, float]:
        return mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count)

    def log_ppl_base(self) -> tuple[float, float]:
        return mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count)

    def log_ppl_ratio(self) -> tuple[float, float]:
        (q, dq), (b, db) = self.log_ppl(), self.log_ppl_base()
        cov = covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, self.count)
        return q - b, math.sqrt(max(dq * dq + db * db - 2.0 * cov, 0.0))

    def kld(self) -> tuple[float, float]:
        return mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count)

    def p_diff_rms(self) -> tuple[float, float]:
        mse, dmse = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count)
        rms = math.sqrt(mse)
        return rms, (0.5 / rms * dmse if rms > 0 else 0.0)

    def same_top(self) -> tuple[float, float]:
        p = self.n_same_top / self.count
        return p, math.sqrt(p * (1 - p) / (self.count - 1)) if self.count > 1 else 0.0

    def sorted_kld(self) -> np.ndarray:
        return np.sort(np.concatenate(self.kld_values))

    def sorted_p_diff(self) -> np.ndarray:
        return np.sort(np.concatenate(self.p_diff_values))


def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    """Mean and its standard error, zero below 11 values (llama.cpp's rule)."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total2 / count - mean * mean
    return mean, (math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0)


def covariance(total_a: float, total_b: float, total_ab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (total_ab / count - (total_a / count) * (total_b / count)) / (count - 1)


def percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's linear interpolation between sorted values."""
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    position = fraction * (len(values) - 1)
    low = int(position)
    weight = position - low
    return float((1 - weight) * values[low] + weight * values[min(low + 1, len(values) - 1)])


def median(values: np.ndarray) -> float:
    n = len(values)
    return float(values[n // 2]) if n % 2 else float(0.5 * (values[n // 2] + values[n // 2 - 1]))
