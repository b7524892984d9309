"""Shards as Megatron-LM's tools/preprocess_data.py writes them, made with megatron-core's own
parts: its HuggingFaceTokenizer (``--tokenizer-type HuggingFaceTokenizer``) and its
IndexedDatasetBuilder, driven the way the tool's Encoder.encode and process_json_file drive
them (the tool itself is not in the megatron-core wheel). For the import tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def megatron_tokenizer(tokenizer_json: Path, directory: Path, eod_token: str = "<|endoftext|>"):
    """megatron-core's HuggingFaceTokenizer over a tokenizer.json (copied into `directory`,
    the model directory transformers' AutoTokenizer reads)."""
    from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import (
        HuggingFaceTokenizer,
    )

    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_json, directory / "tokenizer.json")
    return HuggingFaceTokenizer(str(directory), use_fast=True, eos_token=eod_token)


def preprocess(
    texts: list[str | list[str]],
    tokenizer,
    output_prefix: Path,
    *,
    append_eod: bool = True,
    dtype=None,
) -> str:
    """PREFIX_text_document.bin/.idx (``_text_sentence`` when a text is a list of sentences,
    what ``--split-sentences`` makes of a document): each sentence one sequence, EOD appended
    to a document's last (``--append-eod``), an empty document kept. Returns the prefix."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    level = "sentence" if any(isinstance(t, list) for t in texts) else "document"
    prefix = f"{output_prefix}_text_{level}"
    builder = IndexedDatasetBuilder(
        f"{prefix}.bin", dtype=dtype or DType.optimal_dtype(tokenizer.vocab_size)
    )
    for text in texts:  # Encoder.encode
        sentences = text if isinstance(text, list) else [text]
        doc_ids, sentence_lens = [], []
        for sentence in sentences:
            ids = tokenizer.text_to_ids(sentence)
            if ids:
                doc_ids.extend(ids)
                sentence_lens.append(len(ids))
        if doc_ids and append_eod:
            doc_ids.append(tokenizer.eos_id)
            sentence_lens[-1] += 1
        builder.add_document(doc_ids, sentence_lens)
    builder.finalize(f"{prefix}.idx")
    return prefix


def read_texts(jsonl: Path) -> list[str]:
    with open(jsonl) as f:
        return [json.loads(line)["text"] for line in f]
