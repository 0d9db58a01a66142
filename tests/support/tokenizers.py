"""Tokenizers made in the test run (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "Zürich liegt am Zürichsee und ist die grösste Stadt der Schweiz.",
    "東京 is Tokyo, the capital of Japan; 大阪 is Osaka.",
    "A naïve café in Kraków serves crème brûlée.",
    "The Vistula River is the specific axis of Warsaw.",
] * 20


def byte_level_tokenizer(directory: Path) -> Path:
    """A small byte-level BPE (the GPT-2 / Qwen2.5 kind) with ChatML's special tokens, saved
    as directory/tokenizer.json; trained with a fixed vocabulary, so it is the same every run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory
