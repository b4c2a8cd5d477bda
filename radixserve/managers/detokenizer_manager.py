"""DetokenizerManager: token-id deltas → text deltas, in its own process.

Incremental decoding with two offsets (surrogate, read): a token whose bytes end inside a
multi-byte character is held until the character completes, so streamed text never shows a
broken character. Text that could be the start of a stop string is held back too; when the
request finishes on a stop string (or stop token) the output is trimmed there unless
no_stop_trim. Control messages (cache flush, server info, errors) pass straight through.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.io_struct import BatchStrOutput, BatchTokenIDOutput
from radixserve.managers.tokenizer_utils import before_a_cut_character, from_a_character_start

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Tokens decoded before the last one to see what it added: a UTF-8 character spans 4 at most.
LAST_TOKEN_WINDOW = 4
HEARTBEAT_POLL_MS = 500


@dataclass
class DecodeStatus:
    ids: list[int] = field(default_factory=list)
    surr_offset: int = 0
    read_offset: int = 0
    decoded: str = ""  # text confirmed complete so far
    prompt_text: str | None = None  # the prompt's last tokens' text, until the first output
    sent: int = 0  # characters of `decoded` already sent


class DetokenizerManager:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeStatus] = {}
        self.failed: set[str] = set()  # failed here; still running in the scheduler

    def handle_batch_token_id_out(self, out: BatchTokenIDOutput) -> BatchStrOutput:
        """Decode each request's delta. A request whose decoding fails finishes with an abort
        naming the error (its later deltas are dropped); the others are unaffected."""
        texts: list[str] = []
        reasons = list(out.finished_reasons)
        failed_now: list[str] = []
        for i, rid in enumerate(out.rids):
            if rid in self.failed:
                texts.append("")
                if reasons[i] is not None:
                    self.failed.discard(rid)  # the scheduler is done with it too
                continue
            try:
                texts.append(self._decode_one(out, i, rid))
            except Exception as e:
                logger.exception("detokenizing request %s failed", rid)
                self.states.pop(rid, None)
                texts.append("")
                if reasons[i] is None:
                    self.failed.add(rid)
                    failed_now.append(rid)
                reasons[i] = {"type": "abort", "message": f"detokenization failed: {e!r}"}
        return BatchStrOutput(
            rids=out.rids,
            finished_reasons=reasons,
            failed_rids=failed_now,
            output_strs=texts,
            output_ids=out.output_ids,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            output_token_logprobs=out.output_token_logprobs,
            output_top_logprobs=out.output_top_logprobs,
            input_token_logprobs=out.input_token_logprobs,
            input_top_logprobs=out.input_top_logprobs,
            spec_verify_ct=out.spec_verify_ct,
            spec_accept_length=out.spec_accept_length,
            spec_draft_tokens=out.spec_draft_tokens,
            spec_accepted_tokens=out.spec_accepted_tokens,
        )

    def _decode_one(self, out: BatchTokenIDOutput, i: int, rid: str) -> str:
        st = self.states.get(rid)
        decode_kw = {
            "skip_special_tokens": out.skip_special_tokens[i],
            "spaces_between_special_tokens": out.spaces_between_special_tokens[i],
        }
        if st is None:  # the first message: decoded after the prompt's last tokens
            context = out.decode_context[i] if i < len(out.decode_context) else []
            st = self.states[rid] = self._start(list(context), decode_kw)
        finished = out.finished_reasons[i]
        new_ids = out.output_ids[i]
        if finished and not out.no_stop_trim[i]:
            matched = finished.get("matched")
            if isinstance(matched, int) and new_ids and new_ids[-1] == matched:
                new_ids = new_ids[:-1]  # the stop token's own text is not output
        st.ids.extend(new_ids)
        surr = self.tokenizer.decode(st.ids[st.surr_offset : st.read_offset], **decode_kw)
        full = self.tokenizer.decode(st.ids[st.surr_offset :], **decode_kw)
        if finished and full.endswith(REPLACEMENT_CHAR):
            full = self._cut_in_a_character(st, full, decode_kw)
        # The first text starts where it parts from the prompt's: inside the prompt's last
        # character where the output completes it (then whole, not U+FFFD).
        start = (
            len(surr)
            if st.prompt_text is None
            else len(os.path.commonprefix((st.prompt_text, full)))
        )
        if len(full) > start and (finished or not full.endswith(REPLACEMENT_CHAR)):
            st.decoded += full[start:]
            st.surr_offset, st.read_offset = st.read_offset, len(st.ids)
            st.prompt_text = None
        stops = out.stop_strs[i]
        if finished:
            self.states.pop(rid, None)
            text = st.decoded
            matched = finished.get("matched")
            if isinstance(matched, str) and not out.no_stop_trim[i]:
                # The occurrence that ended the request is the first that ends in the newest
                # token's text (the scheduler's rule: that token can hold it twice, "\n\n"
                # for "\n"); one written before min_new_tokens was reached stays.
                start = len(text) - self._last_token_len(st, decode_kw)
                pos = text.find(matched, max(0, st.sent - len(matched), start - len(matched) + 1))
                if pos < 0:
                    pos = text.rfind(matched, max(0, st.sent - len(matched)))
                if pos >= 0:
                    text = text[:pos]
            return text[st.sent :]
        # Hold back a tail that might grow into a stop string.
        hold = _stop_prefix_len(st.decoded, stops) if stops else 0
        end = max(st.sent, len(st.decoded) - hold)
        delta = st.decoded[st.sent : end]
        st.sent = end
        return delta

    def _start(self, context: list[int], decode_kw: dict[str, Any]) -> DecodeStatus:
        """A request's state before its first output: decoded after `context`, the prompt's
        last tokens, from a character's start as the scheduler's match decodes them. Where
        they end inside a character, its tokens are read again with the output's (a
        byte-fallback decoder makes a byte run that starts inside a character all U+FFFD)."""
        text = self.tokenizer.decode(context, **decode_kw)
        context, text = from_a_character_start(self.tokenizer, context, text, **decode_kw)
        read = len(context)
        if text.endswith(REPLACEMENT_CHAR):  # (or with a U+FFFD of its own)
            whole = self._whole_characters(context, len(context), decode_kw)
            if whole is not None:
                read = len(context) - whole[0]
        return DecodeStatus(context, 0, read, prompt_text=text)

    def _whole_characters(
        self, ids: list[int], most: int, decode_kw: dict[str, Any]
    ) -> tuple[int, str] | None:
        """`before_a_cut_character`, decoded as the request's text is."""
        return before_a_cut_character(lambda t: self.tokenizer.decode(t, **decode_kw), ids, most)

    def _cut_in_a_character(self, st: DecodeStatus, full: str, decode_kw: dict[str, Any]) -> str:
        """The text of an output that ends inside a character (cut by max_tokens): the
        characters before the cut, then one U+FFFD. A byte-fallback decoder (Llama 2, Mistral,
        Gemma) makes a whole run of byte tokens U+FFFD when it is not UTF-8 as a whole: the
        complete characters before the cut were lost ('你好世' read as 11 U+FFFD)."""
        new = len(st.ids) - st.read_offset  # (the tokens before were decoded whole already)
        whole = self._whole_characters(st.ids[st.surr_offset :], new, decode_kw)
        if whole is None:
            return full
        head = whole[1]
        # The whole text where it keeps those characters: a byte-level token can hold more
        # than the cut character's first byte (' ' and it: 'Ġè'), which the head alone lost
        # (and a stop string ", " its space: ",\ufffd" leaked).
        return full if full.startswith(head) else head + REPLACEMENT_CHAR

    def _last_token_len(self, st: DecodeStatus, decode_kw: dict[str, Any]) -> int:
        """How many characters the last token added to the text (decoded after the tokens
        before it, as many as a character's bytes can span, so that it is not the first)."""
        window = st.ids[-(LAST_TOKEN_WINDOW + 1) :]
        after = self.tokenizer.decode(window, **decode_kw)
        before = self.tokenizer.decode(window[:-1], **decode_kw)
        # (the last token may complete a character the tokens before it began)
        prior = len(os.path.commonprefix((after, before)))
        if before.endswith(REPLACEMENT_CHAR):
            # Or after the characters before the one they end inside: a byte-fallback decoder
            # read the complete ones in their byte run U+FFFD too ('🙂' before the first byte
            # of 'Ω'), and a stop string they completed was taken for the last token's (found
            # where min_new_tokens had let it pass, and cut from text already sent).
            whole = self._whole_characters(window[:-1], len(window) - 1, decode_kw)
            if whole is not None:
                prior = max(prior, len(os.path.commonprefix((after, whole[1]))))
        return len(after) - prior


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.
    Only where the stop's first character is are candidates tried, first to last (the first
    that matches is the longest): a try of every length cost a stream with 200 stops of 3000
    characters a quarter of a second a token, in the process that detokenizes for all."""
    best = 0
    for s in set(stops):
        if len(s) < 2:
            continue
        tail = text[-(len(s) - 1) :]
        i = tail.find(s[0])
        while 0 <= i < len(tail) - best:
            if s.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(s[0], i + 1)
    return best


def run_detokenizer_process(
    server_args: Any, port_args: Any, ready: Any = None, heartbeat: Any = None
) -> None:
    """Process entry: PULL BatchTokenIDOutput from the scheduler, PUSH BatchStrOutput. The loop
    writes the time into `heartbeat` at least every HEARTBEAT_POLL_MS, busy or idle, so the
    server's watchdog tells a stuck detokenizer from an idle one."""
    from radixserve.utils import configure_child_process, exit_failed_start, zmq_socket

    configure_child_process("detokenizer", server_args.log_level)
    import zmq

    from radixserve.managers.tokenizer_utils import load_tokenizer_for

    try:
        tokenizer = load_tokenizer_for(server_args)
        ctx = zmq.Context(2)
        recv = zmq_socket(ctx, zmq.PULL, port_args.detokenizer_ipc, bind=True)
        send = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc, bind=False)
    except Exception as e:  # the parent reports it in one line (an unhandled one: a traceback)
        exit_failed_start("detokenizer", ready, e)
    manager = DetokenizerManager(tokenizer)
    if ready is not None:
        ready.send({"status": "ready"})
        ready.close()
    while True:
        if heartbeat is not None:
            heartbeat.value = time.monotonic()  # system-wide clock: the parent compares
            if not recv.poll(HEARTBEAT_POLL_MS):
                continue
        try:
            msg = recv.recv_pyobj()
            if isinstance(msg, BatchTokenIDOutput):
                msg = manager.handle_batch_token_id_out(msg)
            send.send_pyobj(msg)
        except Exception:  # one bad message must not take the process down
            logger.exception("the detokenizer failed to handle a message")
