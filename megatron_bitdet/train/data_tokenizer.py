"""Byte-level tokenizer with the interface megatron-core's GPTDataset needs (eod, vocab_size, identity).

Token id = byte value, vocab 256 (the recipe's ``vocab_size``). The end-of-document token is byte 0
(NUL): source text never contains it, and the corpus builder rejects documents that do, so EOD is
unambiguous without growing the vocabulary. There is no pad token on purpose: megatron's GPTDataset
then uses its own sentinel (-1), which cannot collide with any byte.
"""
from __future__ import annotations

import numpy
from megatron.core.tokenizers import MegatronTokenizerBase

EOD = 0
VOCAB_SIZE = 256


class ByteTokenizer(MegatronTokenizerBase):
    """Bytes in, bytes out; ``unique_identifiers`` feeds megatron's index-cache hash."""

    def __init__(self) -> None:
        super().__init__(path="", config={})
        self.unique_identifiers = {"class": "bitdet.ByteTokenizer", "vocab_size": VOCAB_SIZE, "eod": EOD}

    def tokenize(self, text: str | bytes) -> numpy.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return numpy.frombuffer(data, dtype=numpy.uint8)

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) != EOD).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> dict[bytes, int]:
        return {bytes([i]): i for i in range(VOCAB_SIZE)}

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def eod(self) -> int:
        return EOD

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("the byte tokenizer has no chat template")
