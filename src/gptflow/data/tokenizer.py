"""Tokenizers: load a Hugging Face ``tokenizer.json``, train a GPT-2-style ByteLevel BPE, find EOD.

The token stream is the one Megatron-LM's ``HuggingFaceTokenizer`` produces from the same
``tokenizer.json`` (``tokenizers`` encode with the file's own post-processor), so shards made
here and shards made by Megatron's tools agree token for token.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write, sha256_file

BYTES_PER_TOKEN_OF_TEXT = (
    4.0  # estimates of tokens from text (BPE on English text: about 4 bytes of UTF-8 per token)
)


@dataclass(frozen=True)
class TokenizerInfo:
    """What a shard or a run needs to know about the tokenizer it was made with."""

    path: str
    sha256: str
    vocab_size: int
    eod_id: int
    eod_token: str

    def manifest_record(self, path: str | os.PathLike) -> dict:
        """The ``tokenizer`` entry of a shard manifest made with this tokenizer, read at `path`."""
        return {
            "path": str(path),
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eod_token": self.eod_token,
            "eod_id": self.eod_id,
        }


def load_tokenizer(path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json; errors name the file."""
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise GptflowError(f"{path}: tokenizer file does not exist; check the path (--tokenizer)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise GptflowError(f"{path}: not a Hugging Face tokenizer.json ({e})") from None


def eod_id(tokenizer, eod_token: str, path: str | os.PathLike = "tokenizer") -> int:
    """Id of the end-of-document token; an error when the vocabulary does not have it."""
    token_id = tokenizer.token_to_id(eod_token)
    if token_id is None:
        raise GptflowError(
            f"{path}: EOD token {eod_token!r} is not in the vocabulary; set tokenizer.eod_token "
            f"(--eod-token) to one of its special tokens"
        )
    return int(token_id)


def tokenizer_info(
    path: str | os.PathLike, eod_token: str = "<|endoftext|>", tok=None
) -> TokenizerInfo:
    """sha256, vocabulary size (added tokens included, as Megatron counts) and EOD id
    (`tok`: the tokenizer already loaded from `path`)."""
    tok = tok or load_tokenizer(path)
    return TokenizerInfo(
        path=str(path),
        sha256=sha256_file(path),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eod_id=eod_id(tok, eod_token, path),
        eod_token=eod_token,
    )


# The ByteLevel alphabet a trained BPE starts from: one token per byte value
BYTE_ALPHABET = 256


def smallest_trained_vocab(special_tokens: list[str]) -> int:
    """The vocabulary a trained BPE holds before its first merge: the special tokens and the
    byte alphabet. A smaller tokenizer.train.vocab_size cannot be met (the trainer keeps
    them all and the file holds more ids than asked)."""
    return BYTE_ALPHABET + len(special_tokens)


def check_tokenizer_file(path: str | os.PathLike, eod_token: str, key: str) -> None:
    """The tokenizer.json at `path` (config key `key`) parses and holds `eod_token`."""
    tok = load_tokenizer(path)
    if tok.token_to_id(eod_token) is None:
        raise GptflowError(
            f"{key} '{path}' has no token {eod_token!r} (tokenizer.eod_token); set "
            f"tokenizer.eod_token to its end-of-document token"
        )


def train_bpe(
    texts: Iterable[str],
    out: str | os.PathLike,
    *,
    vocab_size: int,
    special_tokens: list[str],
    min_frequency: int = 2,
) -> dict:
    """Train a GPT-2-style ByteLevel BPE (no prefix space, byte fallback alphabet) on `texts`.

    Special tokens get ids 0.. in the order given (GPT-NeoX convention: ``<|endoftext|>`` = 0).
    Writes `out` atomically; returns a summary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    counted = _Counted(texts)
    tok.train_from_iterator(counted, trainer=trainer)
    if counted.documents == 0:
        raise GptflowError("no documents to train the tokenizer on; the corpus is empty")
    with atomic_write(out) as f:
        f.write(tok.to_str(pretty=True))
    return {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "documents": counted.documents,
        "bytes": counted.bytes,
    }


class _Counted:
    """Iterate texts while counting documents and UTF-8 bytes."""

    def __init__(self, texts: Iterable[str]) -> None:
        self._texts = texts
        self.documents = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[str]:
        for text in self._texts:
            self.documents += 1
            self.bytes += len(text.encode("utf-8"))
            yield text


def sample_texts(
    inputs: list[str],
    key: str,
    max_bytes: int,
    *,
    fmt: str | None = "jsonl",
    member: str = "*",
    member_format: str | None = None,
    on_bad: str = "error",
    dropped: Counter[str] | None = None,
) -> Iterator[str]:
    """Up to `max_bytes` of document text, an equal budget from each input, in file order.

    Bad documents and damaged inputs are handled by `on_bad` as tokenization handles them
    (see :func:`gptflow.data.readers.batch_texts`); what is skipped is counted in `dropped`.
    """
    from gptflow.data.readers import batch_texts, iter_batches

    budget = max(1, max_bytes // max(1, len(inputs)))
    for path in inputs:
        used = 0
        batches = iter_batches(path, fmt, member=member, member_format=member_format, json_key=key)
        for batch in batches:
            texts, skipped = batch_texts(batch, key, on_bad)
            if dropped is not None:
                dropped.update(skipped)
            for text in texts:
                yield text
                used += len(text)
                if used >= budget:
                    break
            if used >= budget:
                break


def write_sample(texts: Iterator[str], out: str | os.PathLike) -> dict:
    """Write texts as JSONL ``{"text": ...}`` (atomically); returns counts."""
    import json

    documents = size = 0
    with atomic_write(out) as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            documents += 1
            size += len(text)
        if documents == 0:  # inside: an empty sample is never published
            raise GptflowError(f"{out}: no documents in the inputs; nothing to sample")
    return {"documents": documents, "chars": size}


def gpt2_bpe(vocab: str | os.PathLike, merges: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` equivalent to Megatron's GPT2BPETokenizer from GPT-2 vocab +
    merges: byte-level BPE with GPT-2's pre-tokenizer regex and no prefix space;
    ``<|endoftext|>`` is looked up in the vocabulary but not made a special token, so a literal
    "<|endoftext|>" in a text is tokenized as text, exactly as Megatron's tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    for p in (vocab, merges):
        if not Path(p).is_file():
            raise GptflowError(f"{p}: no such file")
    try:
        model = models.BPE.from_file(str(vocab), str(merges))
    except Exception as e:  # tokenizers raises bare Exceptions on malformed files
        raise GptflowError(f"{vocab} / {merges}: not GPT-2 vocab.json + merges.txt ({e})") from None
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def gpt2_tokenizer(
    vocab: str | os.PathLike, merges: str | os.PathLike, out: str | os.PathLike
) -> dict:
    """:func:`gpt2_bpe` written to `out` as a tokenizer.json."""
    tok = gpt2_bpe(vocab, merges)
    with atomic_write(out) as f:
        f.write(tok.to_str(pretty=True))
    return {"vocab_size": tok.get_vocab_size(with_added_tokens=True)}


def tokenizer_difference(a, b, names: tuple[str, str] = ("a", "b")) -> str | None:
    """The first way tokenizers `a` and `b` (``tokenizers.Tokenizer``) differ in what a model
    trained on their ids depends on, in words naming each by `names`; None when they are the
    same tokenizer.

    The same tokenizer gives every text the same ids and has the same special tokens: equal
    model type and options, vocabulary (every token's id), merges (in order: their rank is
    their priority), normalizer, pre-tokenizer, post-processor (it may add tokens when
    encoding) and added tokens (content, id, special, and how each is matched). Not compared:
    the decoder (ids to text), padding and truncation settings, and how the file is written
    (both are read back in the installed tokenizers' own form, so merges written as "a b" or
    as ["a", "b"] are the same merges)."""
    import json

    ja, jb = json.loads(a.to_str()), json.loads(b.to_str())
    x, y = names
    ma, mb = ja.get("model") or {}, jb.get("model") or {}
    if ma.get("type") != mb.get("type"):
        return f"a {ma.get('type')} model in {x}, a {mb.get('type')} model in {y}"
    va, vb = ma.get("vocab"), mb.get("vocab")
    if va != vb:
        if not (isinstance(va, dict) and isinstance(vb, dict)):
            return (
                f"the vocabularies differ ({len(va or [])} entries in {x}, {len(vb or [])} in {y})"
            )
        if len(va) != len(vb):
            return f"a vocabulary of {len(va):,} tokens in {x}, {len(vb):,} in {y}"
        token, i = next(
            (t, i) for t, i in sorted(va.items(), key=lambda kv: kv[1]) if vb.get(t) != i
        )
        other = f"id {vb[token]}" if token in vb else "absent"
        return f"token {token!r} is id {i} in {x}, {other} in {y}"
    merges = [
        [m if isinstance(m, str) else " ".join(m) for m in d.get("merges") or []] for d in (ma, mb)
    ]
    if merges[0] != merges[1]:
        k = next((k for k, (p, q) in enumerate(zip(*merges, strict=False)) if p != q), None)
        if k is None:
            return f"{len(merges[0]):,} merges in {x}, {len(merges[1]):,} in {y}"
        return f"merge #{k} is {merges[0][k]!r} in {x}, {merges[1][k]!r} in {y}"
    for key in sorted((set(ma) | set(mb)) - {"vocab", "merges"}):
        if ma.get(key) != mb.get(key):
            return f"model.{key} {ma.get(key)!r} in {x}, {mb.get(key)!r} in {y}"

    def added(j: dict) -> dict[str, dict]:
        return {
            t["content"]: {k: v for k, v in t.items() if k != "content"}
            for t in j.get("added_tokens") or []
        }

    aa, ab = added(ja), added(jb)
    for content in sorted(set(aa) | set(ab), key=lambda c: (aa.get(c) or ab[c])["id"]):
        if aa.get(content) != ab.get(content):

            def shown(t: dict | None) -> str:
                if t is None:
                    return "absent"
                return f"id {t['id']}{', special' if t.get('special') else ''}"

            if shown(aa.get(content)) == shown(ab.get(content)):
                return f"added token {content!r} is matched differently ({aa[content]} in {x}, {ab[content]} in {y})"
            return f"added token {content!r}: {shown(aa.get(content))} in {x}, {shown(ab.get(content))} in {y}"
    for part in ("normalizer", "pre_tokenizer", "post_processor"):
        if ja.get(part) != jb.get(part):
            pa, pb = (json.dumps(j.get(part), separators=(",", ":"))[:120] for j in (ja, jb))
            return f"the {part} differs ({pa} in {x}, {pb} in {y})"
    return None
