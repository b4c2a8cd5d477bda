"""Load the tokenizer that goes with ServerArgs (HF directory or GGUF metadata), once per process."""

from __future__ import annotations

from typing import Any


def tokenizer_source(server_args: Any) -> str:
    if server_args.tokenizer_path:
        return server_args.tokenizer_path
    if server_args.model_path:
        return server_args.model_path
    from radixserve.model_loader.default_model import ensure_default_model

    return ensure_default_model()


def load_tokenizer_for(server_args: Any) -> Any:
    from radixserve.model_loader.weights import load_tokenizer

    return load_tokenizer(tokenizer_source(server_args))
