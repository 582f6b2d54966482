"""``kind = "text"``: a UTF-8 string, tokenized by the worker per batch.

Tokenization is Hugging Face ``tokenizers`` (a ``tokenizer.json``): one
``encode_batch`` call per batch, in Rust, on the stage's thread, truncating to
``max_length`` tokens as the library does (special tokens included). The
encodings feed the model inputs ``ids`` and ``mask`` and, when the model has it,
``type_ids``, padded per engine run with the tokenizer's pad id (mask and type
ids with 0). The texts' token counts are the lengths the batch is grouped and
padded by, and per-token outputs are cut back to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from worker.config.model import TextInput
from worker.contract import ErrorInfo, InputValue
from worker.flow.codes import ErrorCode
from worker.flow.errors import ConfigError, InvalidRequest
from worker.model.files import resolve_tokenizer_path
from worker.model.inputs.base import BoundInput, value_kind
from worker.model.io import ModelIO, TensorDesc
from worker.model.rows import Row
from worker.model.shapes import dense


def load_tokenizer(cfg: TextInput, setting: str) -> tuple[Any, int]:
    """The tokenizer, set to truncate at ``max_length`` and not to pad (padding is
    per engine run, here), and its pad id."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # a core dependency; named in case a build lacks it
        raise ConfigError(f"{setting}: text inputs need the 'tokenizers' package") from exc
    path = resolve_tokenizer_path(cfg.tokenizer, f"{setting}.tokenizer")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # boundary: tokenizers raises its own Exception type
        raise ConfigError(f"{setting}.tokenizer: cannot load {path}: {exc}") from exc
    padding = tokenizer.padding
    pad_id = padding["pad_id"] if padding else None
    for token in ("[PAD]", "<pad>", "<PAD>"):
        if pad_id is None:
            pad_id = tokenizer.token_to_id(token)
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=cfg.max_length)
    return tokenizer, int(pad_id or 0)


class BoundText(BoundInput):
    kind = "text"
    # The attention mask is fed, so padding tokens change no token's answer; the
    # outputs that follow the sequence are cut back (``worker.model.inputs.binding``).
    pads = True

    def __init__(self, name: str, cfg: TextInput, io: ModelIO, setting: str) -> None:
        feeds = _feeds(cfg, io, setting)
        super().__init__(name, feeds)
        self.cfg = cfg
        self.tokenizer, self.pad_id = load_tokenizer(cfg, setting)
        # Fixed-length models (a sequence dim of the file's choosing) get every
        # row padded to it; truncation must then fit.
        for feed in feeds:
            (dim,) = feed.shape
            if isinstance(dim, int) and dim < cfg.max_length:
                raise ConfigError(
                    f"{setting}.max_length: {cfg.max_length} tokens do not fit the model input "
                    f"{feed.name!r} ({feed.shown()}); set it to at most {dim}"
                )
        self._pads = {feeds[0].name: self.pad_id}

    def row_ranks(self) -> tuple[int, ...]:
        return ()  # a text is a string, not a tensor

    def max_lengths(self) -> Mapping[str, int]:
        return {symbol: self.cfg.max_length for symbol in self.free_symbols()}

    def check(self, value: InputValue) -> str:
        if not isinstance(value, str):
            raise InvalidRequest(f"{self.field}: expected a text (a UTF-8 string), got "
                                 f"{value_kind(value)}")  # fmt: skip
        if not value:
            raise InvalidRequest(f"{self.field}: the text is empty")
        return value

    def pending(self, answers: Sequence[Row]) -> bool:
        return bool(answers)

    def prepare(self, answers: Sequence[Row]) -> None:
        """One ``encode_batch`` for the batch's texts; a batch the tokenizer refuses
        is encoded row by row, so only the text it refuses is answered."""
        texts = [a.values[self.name] for a in answers]
        try:
            encodings = self.tokenizer.encode_batch(texts)
        except Exception:  # boundary: tokenizers' own exception type
            encodings = [self._encode_one(a, t) for a, t in zip(answers, texts, strict=True)]
        for answer, encoding in zip(answers, encodings, strict=True):
            if encoding is None:
                continue
            answer.values[self.name] = encoding
            n = len(encoding.ids)
            for feed in self.feeds:
                dim = feed.shape[0]
                if not isinstance(dim, int):
                    answer.lengths[feed.symbol(0)] = n

    def _encode_one(self, answer: Row, text: str) -> Any:
        try:
            return self.tokenizer.encode(text)
        except Exception as exc:  # boundary
            answer.error = ErrorInfo(
                ErrorCode.INVALID_REQUEST, f"{self.field}: cannot tokenize: {exc}"
            )
            return None

    def collate(
        self, rows: Sequence[Any], padded: Mapping[str, int], out: dict[str, np.ndarray]
    ) -> None:
        n = len(rows)
        for feed, field in zip(self.feeds, ("ids", "attention_mask", "type_ids"), strict=False):
            shape = feed.row_at(padded)
            buffer = out.get(feed.name)
            view = (
                np.empty((n, *shape), dtype=feed.dtype)
                if buffer is None
                else dense(buffer, n, shape)
            )
            view.fill(self._pads.get(feed.name, 0))
            for i, encoding in enumerate(rows):
                values = getattr(encoding, field)
                view[i, : len(values)] = values
            out[feed.name] = view


def _feeds(cfg: TextInput, io: ModelIO, setting: str) -> tuple[TensorDesc, ...]:
    """The model inputs a text feeds, in the order ids, mask, type_ids: ids must
    exist; mask and type_ids are fed when the model has them (a mask the model
    lacks may not be followed by type ids it has)."""
    names = [cfg.ids, cfg.mask, cfg.type_ids]
    found = [io.input(n) for n in names]
    ids = found[0]
    if ids is None:
        raise ConfigError(
            f"{setting}.ids: the model has no input {cfg.ids!r} (its inputs: "
            f'{", ".join(io.input_names)}); name the token-ids input with ids = "..."'
        )
    feeds = [ids]
    for name, desc in zip(names[1:], found[1:], strict=True):
        if desc is None:
            if name == cfg.mask and found[2] is not None:
                raise ConfigError(
                    f"{setting}.mask: the model has no input {name!r} but has "
                    f'{cfg.type_ids!r}; name its attention-mask input with mask = "..."'
                )
            continue
        feeds.append(desc)
    for feed in feeds:
        if len(feed.shape) != 1 or feed.dtype.kind not in "iu":
            raise ConfigError(
                f"{setting}: the model input {feed.name!r} is {feed.shown()}; a text feeds "
                "integer inputs of one row of tokens ([sequence])"
            )
    return tuple(feeds)
