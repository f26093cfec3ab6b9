"""Offline byte-level BPE tokenizers for the tiny checkpoints.

Trained with the `tokenizers` library on ``epd/models/data/corpus.txt``. Training is
deterministic (same corpus, vocab size and special tokens -> identical tokenizer.json);
the special tokens take the first ids, in the order given, so ids are stable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CORPUS_PATH = Path(__file__).with_name("data") / "corpus.txt"
IMAGE_TOKEN = "<image>"


@dataclass(frozen=True)
class TokenizerSpec:
    bos: str | None
    eos: str
    pad: str
    extra_eos: tuple[str, ...]  # further generation stop tokens (chatml end of turn)
    specials: tuple[str, ...]  # all special tokens, in id order


LLAMA_TOKENS = TokenizerSpec(
    bos="<s>", eos="</s>", pad="<pad>", extra_eos=(), specials=("<pad>", "<s>", "</s>", IMAGE_TOKEN)
)
CHATML_TOKENS = TokenizerSpec(
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    extra_eos=("<|endoftext|>",),
    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_TOKEN),
)


def train_tokenizer(spec: TokenizerSpec, vocab_size: int = 1024):
    """Return a `transformers.PreTrainedTokenizerFast` trained on the shipped corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(spec.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS_PATH.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    kwargs = {"eos_token": spec.eos, "pad_token": spec.pad}
    if spec.bos is not None:
        kwargs["bos_token"] = spec.bos
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        extra_special_tokens=[IMAGE_TOKEN] + [t for t in spec.specials if t not in kwargs.values() and t != IMAGE_TOKEN],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
        **kwargs,
    )
    return fast
