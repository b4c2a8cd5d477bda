"""Request generators for the serving benchmarks: `random`, `generated-shared-prefix`, `sharegpt`,
`rewrite` and `natural` (chat prompts over the Python documentation: repeat a passage, or
answer a question about a topic; the workloads of speculative decoding).

Each generator returns a list of `BenchRequest` and is deterministic for a given seed. They need
only a tokenizer object with `encode`, `decode`, `vocab_size` and `all_special_ids` (a Hugging
Face tokenizer); they never touch torch or the network. `load_tokenizer` gets the server's
tokenizer for a model path. Called by `bench.serving` and `bench.hf_baseline`.

`prompt_len` is always the number of tokens the server will see: for token-id prompts it is the
list's length; for text prompts it is the length of the text re-tokenized, because decoding random
token ids and encoding the text again can merge or split tokens.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from radixserve.bench import FRACTION, POSITIVE

# Separator between a group's shared system prompt and each question (as SGLang's generator
# does); a blank line keeps the tokenizer from merging tokens across the boundary.
GSP_SEPARATOR = "\n\n"
# Too-short / too-long filters for ShareGPT, as vLLM's and SGLang's classic sampler.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


class Tokenizer(Protocol):
    """The slice of a transformers tokenizer the generators use."""

    vocab_size: int
    all_special_ids: list[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: the prompt (text or token ids) and its token budget."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        assert self.prompt_len >= 0 and self.output_len >= 1, self


def sample_lens(rng: np.random.Generator, full_len: int, range_ratio: float, num: int) -> list[int]:
    """Lengths drawn uniformly from [max(int(full_len * range_ratio), 1), full_len]."""
    assert 0.0 <= range_ratio <= 1.0, f"range_ratio must be in [0, 1], got {range_ratio}"
    low = max(int(full_len * range_ratio), 1)
    high = max(full_len, low)
    return [int(x) for x in rng.integers(low, high + 1, size=num)]


class RandomTokenSource:
    """Draws random non-special token ids and turns them into text of a target token length."""

    def __init__(self, tokenizer: Tokenizer, rng: np.random.Generator) -> None:
        special = set(tokenizer.all_special_ids)
        self.tokenizer = tokenizer
        self.rng = rng
        self.allowed = np.array(
            [i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int64
        )
        assert len(self.allowed) > 0, "tokenizer has no non-special tokens"

    def ids(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.choice(self.allowed, size=n)]

    def text(self, n: int, max_rounds: int = 4) -> str:
        """Decoded random ids, nudged so that re-encoding gives close to `n` tokens."""
        ids = self.ids(n)
        text = self.tokenizer.decode(ids)
        for _ in range(max_rounds):
            re_ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(re_ids) == n:
                break
            # Trim what merged text grew, or top up what it lost, and decode again.
            ids = re_ids[:n] if len(re_ids) > n else re_ids + self.ids(n - len(re_ids))
            text = self.tokenizer.decode(ids)
        return text


def _count(tokenizer: Tokenizer, prompt: str | list[int]) -> int:
    return len(prompt) if isinstance(prompt, list) else len(tokenizer.encode(prompt))


def sample_random_requests(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 1.0,
    seed: int = 1,
    return_text: bool = True,
) -> list[BenchRequest]:
    """`random`: prompts of random tokens; lengths uniform in [len * range_ratio, len]."""
    rng = np.random.default_rng(seed)
    input_lens = sample_lens(rng, input_len, range_ratio, num_prompts)
    output_lens = sample_lens(rng, output_len, range_ratio, num_prompts)
    source = RandomTokenSource(tokenizer, rng)
    requests = []
    for in_len, out_len in zip(input_lens, output_lens, strict=True):
        prompt: str | list[int] = source.text(in_len) if return_text else source.ids(in_len)
        requests.append(BenchRequest(prompt, _count(tokenizer, prompt), out_len))
    return requests


def sample_generated_shared_prefix_requests(
    tokenizer: Tokenizer,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int = 1,
    shuffle: bool = True,
    return_text: bool = True,
) -> list[BenchRequest]:
    """`generated-shared-prefix`: each group has its own random system prompt; every prompt of
    the group is that prefix followed by its own random question."""
    rng = np.random.default_rng(seed)
    source = RandomTokenSource(tokenizer, rng)
    requests = []
    for _ in range(num_groups):
        if return_text:
            prefix_text = source.text(system_prompt_len)
            for _ in range(prompts_per_group):
                prompt = prefix_text + GSP_SEPARATOR + source.text(question_len)
                requests.append(BenchRequest(prompt, _count(tokenizer, prompt), output_len))
        else:
            prefix_ids = source.ids(system_prompt_len)
            for _ in range(prompts_per_group):
                ids = prefix_ids + source.ids(question_len)
                requests.append(BenchRequest(ids, len(ids), output_len))
    if shuffle:
        random.Random(seed).shuffle(requests)
    return requests


def _doc_passages(tokenizer: Tokenizer, min_tokens: int) -> list[tuple[str, list[int]]]:
    """(topic, token ids) of the Python documentation's topics (the stdlib's
    pydoc_data.topics, on every machine with Python), those of at least `min_tokens`."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        ids = tokenizer.encode(topics[name], add_special_tokens=False)
        if len(ids) >= min_tokens:
            out.append((name, ids))
    return out


def _chat(tokenizer: Any, content: str) -> str:
    """The user message in the model's chat template (plain text where it has none)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    return content + "\n\n"


def sample_rewrite_requests(
    tokenizer: Tokenizer,
    num_prompts: int,
    passage_len: int,
    output_len: int,
    seed: int = 1,
) -> list[BenchRequest]:
    """`rewrite`: chat prompts asking to repeat a passage of the Python documentation word for
    word, so that the answer quotes the prompt (the text NGRAM speculation predicts)."""
    rng = np.random.default_rng(seed)
    docs = _doc_passages(tokenizer, passage_len)
    if not docs:
        raise ValueError(
            f"--rewrite-passage-len {passage_len}: no topic of the Python documentation has "
            "that many tokens; choose a shorter passage"
        )
    requests = []
    for _ in range(num_prompts):
        _, ids = docs[int(rng.integers(len(docs)))]
        start = int(rng.integers(len(ids) - passage_len + 1))
        passage = tokenizer.decode(ids[start : start + passage_len]).strip()
        prompt = _chat(tokenizer, "Repeat the following text exactly, word for word:\n\n" + passage)
        requests.append(BenchRequest(prompt, _count(tokenizer, prompt), output_len))
    return requests


def sample_natural_requests(
    tokenizer: Tokenizer, num_prompts: int, output_len: int, seed: int = 1
) -> list[BenchRequest]:
    """`natural`: chat questions about topics of the Python documentation, nothing to quote:
    free natural-language answers."""
    rng = np.random.default_rng(seed)
    names = [name for name, _ in _doc_passages(tokenizer, 1)]
    asks = (
        "Explain what '{}' means in Python, with an example.",
        "Write a short tutorial paragraph about Python's {}.",
        "What should a beginner know about '{}' in Python?",
    )
    requests = []
    for _ in range(num_prompts):
        name = names[int(rng.integers(len(names)))].replace("-", " ")
        ask = asks[int(rng.integers(len(asks)))].format(name)
        prompt = _chat(tokenizer, ask)
        requests.append(BenchRequest(prompt, _count(tokenizer, prompt), output_len))
    return requests


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    """The first human turn and the reply that follows it, or None (also for an entry or
    turns of another shape: skipped, as entries without such a pair are)."""
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations", entry.get("conversation", []))
    if not isinstance(turns, list):
        return None
    for ask, answer in zip(turns, turns[1:], strict=False):
        if not (isinstance(ask, dict) and isinstance(answer, dict)):
            continue
        if (
            ask.get("from") in ("human", "user")
            and answer.get("from") in ("gpt", "assistant", "chatgpt")
            and ask.get("value") is not None
            and answer.get("value") is not None
        ):
            return str(ask["value"]), str(answer["value"])
    return None


def sample_sharegpt_requests(
    tokenizer: Tokenizer,
    dataset_path: str,
    num_prompts: int,
    fixed_output_len: int | None = None,
    context_len: int | None = None,
    seed: int = 1,
    return_text: bool = True,
) -> list[BenchRequest]:
    """`sharegpt`: first human turn as prompt, the reply's token count as output_len.

    Conversations are shuffled with the seed; pairs with fewer than 4 prompt or output tokens
    are dropped, and so are pairs longer than `context_len` (prompt + output) or, without it,
    prompts over 1024 tokens or pairs over 2048 tokens.
    """
    if fixed_output_len is not None and fixed_output_len < SHAREGPT_MIN_LEN:
        raise ValueError(f"fixed output length must be >= {SHAREGPT_MIN_LEN}")
    with open(dataset_path, encoding="utf-8") as f:
        dataset = json.load(f)
    if not isinstance(dataset, list):  # (an AttributeError traceback)
        raise ValueError(
            f"{dataset_path} is not a ShareGPT file: a JSON list of conversations, each "
            '{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}'
        )
    pairs = [p for p in map(_first_exchange, dataset) if p is not None]
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(requests) == num_prompts:
            break
        prompt_ids = tokenizer.encode(prompt)
        prompt_len = len(prompt_ids)
        out_len = fixed_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < SHAREGPT_MIN_LEN or out_len < SHAREGPT_MIN_LEN:
            continue
        if context_len is not None:
            if prompt_len + out_len > context_len:
                continue
        elif prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + out_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        requests.append(BenchRequest(prompt if return_text else prompt_ids, prompt_len, out_len))
    return requests


def summarize(requests: list[BenchRequest]) -> str:
    """One line with the request count and token totals, for the CLI to print."""
    total_in = sum(r.prompt_len for r in requests)
    total_out = sum(r.output_len for r in requests)
    return f"#Requests: {len(requests)}  #Input tokens: {total_in}  #Output tokens: {total_out}"


def model_source(path: str) -> tuple[str, dict[str, str]]:
    """(directory, from_pretrained kwargs) for a HF directory or a `.gguf` file path."""
    if path.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(path))
        return directory, {"gguf_file": name}
    return path, {}


def load_tokenizer(path: str | None) -> Any:
    """The tokenizer the server uses for a HF directory or `.gguf` file (default: the default
    model's), so that benchmark prompt lengths match the server's counts."""
    # Imported lazily: the loaders pull in transformers / gguf and live in model_loader.
    from radixserve.model_loader.weights import load_tokenizer as load_model_tokenizer

    if path is None:
        from radixserve.model_loader.default_model import ensure_default_model

        path = ensure_default_model()
    return load_model_tokenizer(path)


def add_dataset_args(parser: Any) -> None:
    """The dataset flags shared by `bench serving` and `bench offline`."""
    parser.add_argument(
        "--dataset-name",
        choices=["random", "generated-shared-prefix", "sharegpt", "rewrite", "natural"],
        default="random",
    )
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON file.")
    # Defaults are the ANCHORS.md workloads (32 x 200 in / 128 out; 8 x 8 x (1024 + 32) / 64).
    parser.add_argument("--num-prompts", type=POSITIVE, default=32)
    parser.add_argument("--random-input-len", type=POSITIVE, default=200)
    parser.add_argument("--random-output-len", type=POSITIVE, default=128)
    parser.add_argument("--random-range-ratio", type=FRACTION, default=1.0)
    parser.add_argument("--gsp-num-groups", type=POSITIVE, default=8)
    parser.add_argument("--gsp-prompts-per-group", type=POSITIVE, default=8)
    parser.add_argument("--gsp-system-prompt-len", type=POSITIVE, default=1024)
    parser.add_argument("--gsp-question-len", type=POSITIVE, default=32)
    parser.add_argument("--gsp-output-len", type=POSITIVE, default=64)
    parser.add_argument("--gsp-no-shuffle", action="store_true")
    parser.add_argument("--sharegpt-output-len", type=POSITIVE, default=None)
    parser.add_argument("--sharegpt-context-len", type=POSITIVE, default=None)
    parser.add_argument(
        "--rewrite-passage-len", type=POSITIVE, default=200, help="rewrite: tokens to repeat."
    )
    parser.add_argument("--tokenize-prompt", action="store_true", help="Send token ids, not text.")


def build_dataset(args: Any, tokenizer: Any) -> list[BenchRequest]:
    return_text = not args.tokenize_prompt
    if args.dataset_name == "random":
        return sample_random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            seed=args.seed,
            return_text=return_text,
        )
    if args.dataset_name == "generated-shared-prefix":
        return sample_generated_shared_prefix_requests(
            tokenizer,
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            seed=args.seed,
            shuffle=not args.gsp_no_shuffle,
            return_text=return_text,
        )
    if args.dataset_name in ("rewrite", "natural"):
        if args.dataset_name == "rewrite":
            reqs = sample_rewrite_requests(
                tokenizer,
                args.num_prompts,
                args.rewrite_passage_len,
                args.random_output_len,
                seed=args.seed,
            )
        else:
            reqs = sample_natural_requests(
                tokenizer, args.num_prompts, args.random_output_len, seed=args.seed
            )
        if return_text:
            return reqs
        # Token ids, as asked (bench offline's Engine takes only those: each prompt went in as
        # a list of its characters and every run failed).
        ids = [tokenizer.encode(r.prompt) for r in reqs]
        return [BenchRequest(p, len(p), r.output_len) for p, r in zip(ids, reqs, strict=True)]
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
    return sample_sharegpt_requests(
        tokenizer,
        args.dataset_path,
        args.num_prompts,
        fixed_output_len=args.sharegpt_output_len,
        context_len=args.sharegpt_context_len,
        seed=args.seed,
        return_text=return_text,
    )
