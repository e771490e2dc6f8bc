"""Offline inputs for torchtitan: a byte-level BPE tokenizer trained here and a JSONL text set.

torchtitan reads its tokenizer from ``--hf-assets-path`` (``tokenizer.json`` plus
``tokenizer_config.json`` naming the BOS/EOS tokens) and its text from
``--dataloader.dataset-path`` through ``datasets.load_dataset``: both are written into a folder,
deterministically, so that no test touches the Hugging Face hub and every run sees the same
tokens.
"""

from __future__ import annotations

import json
import os
import random

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
WORDS = (
    "the a one every some node rank spare worker step model layer weight gradient shard checkpoint "
    "train learn loss token sequence batch data fast slow runs waits fails restarts joins keeps "
    "sends reads writes saves loads and or but then when while because after before"
).split()


def corpus(lines: int = 400, seed: int = 0) -> list[str]:
    """Pseudo-sentences from a fixed vocabulary: enough structure for the loss to fall."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(rng.randint(2, 6))]
        out.append(" ".join(sentences))
    return out


def write_dataset(folder: str, texts: list[str]) -> str:
    """``folder/train.jsonl`` with a ``text`` field, what torchtitan's ``c4_test`` loader reads
    (``load_dataset(folder, split="train")``)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "train.jsonl"), "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return folder


def write_tokenizer(folder: str, texts: list[str], vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained on ``texts`` (at most ``vocab_size`` ids, so it fits
    the model's embedding), saved as torchtitan's ``HuggingFaceTokenizer`` loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids, the model {vocab_size}")
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}, f)
    return folder


def build(folder: str, vocab_size: int) -> dict[str, str]:
    """Both, under ``folder``: ``{"hf_assets_path": ..., "dataset_path": ...}``."""
    texts = corpus()
    return {
        "hf_assets_path": write_tokenizer(os.path.join(folder, "tokenizer"), texts, vocab_size),
        "dataset_path": write_dataset(os.path.join(folder, "data"), texts),
    }
