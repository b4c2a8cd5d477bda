"""Reasoning parsers (`--reasoning-parser`, SGLang's names): split `<think>...</think>` from the
rest of an output, in one go (`parse`) or as it streams (`parse_streaming`, then `finish`).

  deepseek-r1, qwen3-thinking  the template opens `<think>` in the prompt, so the output starts
                               inside the reasoning (a repeated `<think>` at its start is dropped)
  qwen3                        reasoning only when the output itself opens with `<think>`,
                               or the prompt opened it (`opened`: Qwen3-Thinking-2507's, QwQ's
                               templates)

The reasoning is the text between the tags, stripped of surrounding whitespace; the content is
what follows `</think>` without its leading whitespace. An output that never closes its
reasoning is all reasoning. Streaming holds back only what may still be a tag or the reasoning's
trailing whitespace, and its pieces join to exactly what `parse` returns. With
`stream_reasoning=False` the reasoning comes as one piece, once it is complete.
"""

from __future__ import annotations

REASONING_PARSERS = {"deepseek-r1": True, "qwen3": False, "qwen3-thinking": True}  # → forced


class ReasoningParser:
    START, END = "<think>", "</think>"

    def __init__(
        self, kind: str, stream_reasoning: bool = True, forced: bool = True, opened: bool = False
    ) -> None:
        """`forced=False`: reasoning only where the output itself opens `<think>`, whatever the
        kind (constrained output: the grammar, not the template, decides how it starts).
        `opened`: the prompt ended inside a `<think>` it opened, so the output starts inside
        the reasoning whatever the kind."""
        if kind not in REASONING_PARSERS:
            known = sorted(REASONING_PARSERS)
            raise ValueError(f"unknown reasoning parser {kind!r}; expected one of {known}")
        self.force_reasoning = (REASONING_PARSERS[kind] or opened) and forced
        self.stream_reasoning = stream_reasoning
        # open (may see the opening tag) | reasoning | after (skip whitespace) | content
        self._mode = "open"
        self._buf = ""
        self._reasoning_started = False  # leading whitespace of the reasoning is dropped
        self._reasoning_done = False
        self._held_reasoning = ""  # the reasoning not yet sent (stream_reasoning=False)

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content); reasoning is None when the output has none."""
        body = text.lstrip()
        if body.startswith(self.START):
            body = body[len(self.START) :]
        elif not self.force_reasoning:
            return None, text
        reasoning, end, content = body.partition(self.END)
        return reasoning.strip(), content.lstrip() if end else ""

    def parse_streaming(self, delta: str) -> tuple[str, str]:
        """Feed the next piece of output; return the (reasoning, content) to send now."""
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """The output has ended: release whatever is held back."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._mode == "open":
                body = self._buf.lstrip()
                if body.startswith(self.START):
                    self._buf, self._mode = body[len(self.START) :], "reasoning"
                elif self.START.startswith(body) and not final:
                    break  # may still be the opening tag
                else:
                    self._mode = "reasoning" if self.force_reasoning else "content"
            elif self._mode == "reasoning":
                if not self._reasoning(reasoning, final):
                    break
            elif self._mode == "after":
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._mode = "content"
            else:
                content.append(self._buf)
                self._buf = ""
                break
        return self._flush_reasoning(reasoning, final), "".join(content)

    def _reasoning(self, out: list[str], final: bool) -> bool:
        """Send the reasoning up to `</think>` or to what must be held; True when it ended."""
        head, end, tail = self._buf.partition(self.END)
        if end or final:
            self._send_reasoning(out, head.rstrip())
            self._buf, self._mode = tail, "after"
            self._reasoning_done = True
            return True
        keep = _partial_suffix(self._buf, self.END)
        ready = self._buf[: len(self._buf) - keep]
        text = ready.rstrip()  # trailing whitespace may end the reasoning: hold it
        self._send_reasoning(out, text)
        self._buf = ready[len(text) :] + self._buf[len(self._buf) - keep :]
        return False

    def _send_reasoning(self, out: list[str], text: str) -> None:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        out.append(text)

    def _flush_reasoning(self, pieces: list[str], final: bool) -> str:
        """What to send of the reasoning now: all of it when streamed, else once complete."""
        self._held_reasoning += "".join(pieces)
        if not (self.stream_reasoning or final or self._reasoning_done):
            return ""
        text, self._held_reasoning = self._held_reasoning, ""
        return text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
