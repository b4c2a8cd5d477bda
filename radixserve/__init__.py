"""radixserve: an LLM serving engine with SGLang's runtime architecture.

Importing the package is cheap; the heavy pieces load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "ServerArgs"]

if TYPE_CHECKING:
    from radixserve.args import ServerArgs
    from radixserve.entrypoints.engine import Engine
    from radixserve.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.entrypoints.engine import Engine

        return Engine
    if name == "SamplingParams":
        from radixserve.sampling_params import SamplingParams

        return SamplingParams
    if name == "ServerArgs":
        from radixserve.args import ServerArgs

        return ServerArgs
    raise AttributeError(name)
