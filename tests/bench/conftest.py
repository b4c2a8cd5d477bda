"""Fixtures for the benchmark tests: two tiny in-memory tokenizers (no downloads).

`word_tokenizer` is a whitespace WordLevel tokenizer, so decode → encode is exact and token
boundaries are easy to reason about; `bpe_tokenizer` is a byte-level BPE trained on a few
sentences, whose decode → encode round trip can change the token count like a real one.
"""

from __future__ import annotations

import os
import sys

import pytest

# Make the repository importable when pytest runs from the venv without an installed package.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
NUM_WORDS = 96
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a radix tree shares the prefix of every prompt that starts the same way",
    "serving engines batch requests continuously and stream tokens back to clients",
    "throughput latency concurrency and cached tokens are what the benchmark reports",
    "1234567890 !?.,;:-_()[]{} ünïcödé façade naïve café",
]


def make_word_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(NUM_WORDS)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )


def make_bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def word_tokenizer():
    return make_word_tokenizer()


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return make_bpe_tokenizer()
