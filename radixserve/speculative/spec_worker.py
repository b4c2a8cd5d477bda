"""SpecWorker: the draft / verify / commit stages of one speculative step (seed 000 §15.3).

It wraps the target TpModelWorker (and, for STANDALONE, a draft ModelRunner) and is what the
scheduler calls instead of the plain worker:

* extend and mixed steps run the target as usual; STANDALONE then runs the draft model over the
  same tokens and slots, so the draft's KV is prefilled with the request (never invented at the
  first decode);
* verify steps: STANDALONE first drafts (Stage A): one extend over the tokens whose draft KV is
  missing (the root at least: the catch-up of the last step's accepted tokens, seed's
  draft_extend) and `num_steps - 1` single-token decodes, each draft drawn from the draft's
  distribution. The target then runs every node of every tree in one forward (Stage B, a decode
  of one query per node, see spec_info) and acceptance commits a path per request
  (speculative.verify). Accepted nodes that are off the chain order have their KV moved to the
  chain's slots, so the request's row stays position-ordered; the scheduler frees the rest.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from radixserve.args import ServerArgs
from radixserve.layers.sampler import SamplingBatchInfo, draw_rows, sampling_probs
from radixserve.managers.tp_worker import GenerationBatchResult, TpModelWorker
from radixserve.model_executor.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.speculative.spec_info import (
    DraftTree,
    SpecAlgorithm,
    SpecVerifyInput,
    SpecVerifyOutput,
)
from radixserve.speculative.verify import NodeView, verify_trees


class SpecWorker:
    def __init__(self, server_args: ServerArgs, target: TpModelWorker, tokenizer: Any = None):
        self.algorithm = SpecAlgorithm.of(server_args.speculative_algorithm)
        self.target = target
        self.vocab_size = target.vocab_size
        self.num_steps = server_args.speculative_verify_tokens - 1
        self.draft_runner = None
        if self.algorithm.has_draft_model():
            from radixserve.model_executor.model_runner import ModelRunner

            check_same_tokenizer(server_args, tokenizer)
            self.draft_runner = ModelRunner(server_args, draft_of=target.model_runner)
        self.last_draft: tuple[int, float] | None = None  # (draft forwards, seconds) of a step

    # -- extend ---------------------------------------------------------------------------------
    def forward_extend(
        self, mwb: ModelWorkerBatch, vocab_mask: torch.Tensor | None
    ) -> GenerationBatchResult:
        result = self.target.forward_batch_generation(mwb, vocab_mask)
        if self.draft_runner is not None:  # the draft's KV of the same tokens, same slots
            self.draft_runner.forward_hidden(self._draft_batch(mwb))
        return result

    # -- verify ---------------------------------------------------------------------------------
    def forward_verify(
        self,
        mwb: ModelWorkerBatch,
        spec: SpecVerifyInput,
        reqs: list[Any],
        vocab_mask: torch.Tensor | None,
    ) -> SpecVerifyOutput:
        self.last_draft = None
        if self.draft_runner is not None:
            start = time.perf_counter()
            forwards = self.draft(mwb, spec, reqs)
            self.last_draft = (forwards, time.perf_counter() - start)
        node_mwb = self.node_batch(mwb, spec)
        logits = self.target.forward(node_mwb).next_token_logits
        out = verify_trees(
            logits,
            reqs,
            spec.trees,
            self.vocab_size,
            vocab_mask,
            mwb.return_logprob,
            mwb.top_logprobs_num,
            cpu_kernels=self.target.model_runner.fused_ops,
        )
        self.move_accepted_kv(mwb, spec, out.accepted_nodes)
        return out

    @staticmethod
    def node_batch(mwb: ModelWorkerBatch, spec: SpecVerifyInput) -> ModelWorkerBatch:
        """The verify step as the model sees it: a decode of one query per tree node."""
        seq, owner, rids = [], [], []
        loras: list[str | None] | None = [] if mwb.lora_ids else None
        for b, (s, tree) in enumerate(zip(spec.seq_lens, spec.trees, strict=True)):
            seq.extend(s + d + 1 for d in tree.depths)
            owner.extend([mwb.req_pool_indices[b]] * len(tree))
            rids.extend([mwb.rids[b]] * len(tree))
            if loras is not None:  # each node under its request's LoRA adapter
                loras.extend([mwb.lora_ids[b]] * len(tree))
        return ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=[t for tree in spec.trees for t in tree.tokens],
            positions=[s - 1 for s in seq],
            req_pool_indices=owner,
            seq_lens=seq,
            prefix_lens=[s - 1 for s in seq],
            extend_lens=[1] * len(seq),
            out_cache_loc=mwb.out_cache_loc,
            kv_rows=spec.node_kv_rows(mwb.kv_rows),
            rids=rids,
            lora_ids=loras,
        )

    def move_accepted_kv(
        self, mwb: ModelWorkerBatch, spec: SpecVerifyInput, accepted: list[list[int]]
    ) -> None:
        """Accepted node p_j (depth j) must sit at row position seq_len + j. Its source slot is
        never a later destination (a node's index is at least its depth), so one gather then
        one scatter is safe."""
        src, dst = [], []
        for b, (s, nodes) in enumerate(zip(spec.seq_lens, accepted, strict=True)):
            for j, node in enumerate(nodes, start=1):
                if node != j:
                    src.append(int(mwb.kv_rows[b, s + node]))
                    dst.append(int(mwb.kv_rows[b, s + j]))
        if src:
            self.target.move_kv(torch.tensor(src), torch.tensor(dst))
            if self.draft_runner is not None:
                self.draft_runner.token_to_kv_pool.move_kv(torch.tensor(src), torch.tensor(dst))

    # -- STANDALONE drafting ----------------------------------------------------------------------
    def draft(self, mwb: ModelWorkerBatch, spec: SpecVerifyInput, reqs: list[Any]) -> int:
        """Fill each tree's draft tokens (a chain of len(tree) - 1) and their draft q; returns
        the number of draft forwards run."""
        runner = self.draft_runner
        assert runner is not None
        device = self.target.device
        steps = max(t.num_drafts for t in spec.trees)
        if steps == 0:
            return 0
        # Stage A.0: catch up (draft_extend) on every token whose draft KV is missing.
        ids, pos, loc, prefix, seq, ext = [], [], [], [], [], []
        for b, (s, tokens, dlen) in enumerate(
            zip(spec.seq_lens, spec.draft_catch_up, spec.draft_kv_lens, strict=True)
        ):
            ids.extend(tokens)
            pos.extend(range(dlen, s + 1))
            loc.append(mwb.kv_rows[b, dlen : s + 1])
            prefix.append(dlen)
            seq.append(s + 1)
            ext.append(s + 1 - dlen)
        catch_up = replace(
            mwb,
            forward_mode=ForwardMode.EXTEND,
            input_ids=ids,
            positions=pos,
            seq_lens=seq,
            prefix_lens=prefix,
            extend_lens=ext,
            out_cache_loc=torch.cat(loc),
        )
        logits = self._target_width(runner.forward(self._draft_batch(catch_up)))
        forwards = 1
        chains: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        active = [b for b, t in enumerate(spec.trees) if t.num_drafts > 0]
        logits = logits[torch.tensor(active)]
        for j in range(1, steps + 1):
            # Each request as its draft j sees it: the output so far and its drafts before (the
            # target's penalties, logit_bias and min_new_tokens apply to the draft too; a draft
            # without them was rarely accepted: 2% with a logit_bias, 21% with a penalty).
            views = [
                NodeView(
                    reqs[b].sampling_params,
                    reqs[b].origin_input_ids,
                    reqs[b].output_ids + chains[b],
                    reqs[b].eos_token_ids,
                )
                for b in active
            ]
            info = SamplingBatchInfo.from_reqs(views, self.vocab_size, device)
            tok, q = draft_sample(info.apply_logits_processors(logits.float()), info)
            for i, b in enumerate(active):
                chains[b].append(int(tok[i]))
                qs[b].append(q[i])
            # Requests that want another draft run one decode step over the token just drafted
            # (position seq_len + j, the slot of their node j).
            keep = [i for i, b in enumerate(active) if spec.trees[b].num_drafts > j]
            if not keep:
                break
            forwards += 1
            active = [active[i] for i in keep]
            rows = torch.tensor(active)
            sl = [spec.seq_lens[b] for b in active]
            step = replace(
                mwb,
                forward_mode=ForwardMode.DECODE,
                input_ids=[int(tok[i]) for i in keep],
                positions=[s + j for s in sl],
                req_pool_indices=[mwb.req_pool_indices[b] for b in active],
                seq_lens=[s + j + 1 for s in sl],
                prefix_lens=[s + j for s in sl],
                extend_lens=[1] * len(active),
                out_cache_loc=mwb.kv_rows[rows, torch.tensor(sl) + j],
                kv_rows=mwb.kv_rows[rows],
                rids=[mwb.rids[b] for b in active],
            )
            logits = self._target_width(runner.forward(self._draft_batch(step)))
        for b, tree in enumerate(spec.trees):
            if tree.num_drafts:
                spec.trees[b] = DraftTree.chain([tree.tokens[0], *chains[b]])
                spec.trees[b].draft_probs = torch.stack(qs[b])
        return forwards

    def _draft_batch(self, mwb: ModelWorkerBatch) -> Any:
        """`mwb` for the draft model: ids past its smaller vocabulary (the target's padding
        rows, no token) read its last row rather than past its table."""
        assert self.draft_runner is not None
        fb = mwb.to_forward_batch(self.target.device)
        rows = self.draft_runner.model_config.vocab_size
        if rows < self.vocab_size:
            fb.input_ids = fb.input_ids.clamp(max=rows - 1)
        return fb

    def _target_width(self, out: Any) -> torch.Tensor:
        """The draft's next-token logits over the target's vocabulary: a draft whose
        embedding table is padded otherwise (Qwen2.5-0.5B's 151936 rows for Qwen2.5-7B's
        152064, one tokenizer) has its extra rows cut, or -inf for the target's extra ones."""
        logits = out.next_token_logits
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[:, : self.vocab_size]
        if width < self.vocab_size:
            pad = logits.new_full((logits.shape[0], self.vocab_size - width), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits


def draft_sample(
    logits: torch.Tensor, info: SamplingBatchInfo, ahead: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw each row's draft from the draft model's distribution q (the request's temperature
    and top-k/top-p/min-p; greedy rows take the argmax, q then a point mass). The draft is for
    output position info.steps + `ahead`: a seeded row draws it with that position's noise, the
    noise the target's draw there uses (verify.py: the draft is accepted where both agree)."""
    logits = logits.float()
    argmax = logits.argmax(dim=-1)
    onehot = torch.nn.functional.one_hot(argmax, logits.shape[-1]).float()
    if info.is_all_greedy:
        return argmax, onehot
    q = sampling_probs(logits, info)
    q = q / q.sum(dim=-1, keepdim=True)
    drawn = draw_rows(q, info.seeds, [step + ahead for step in info.steps])
    tok = torch.where(info.greedy, argmax, drawn)
    return tok, torch.where(info.greedy.view(-1, 1), onehot, q)


def check_same_tokenizer(server_args: ServerArgs, tokenizer: Any) -> None:
    """The draft proposes token ids the target verifies: both must mean the same text."""
    from radixserve.model_loader.loader import resolve_model_path
    from radixserve.model_loader.weights import load_tokenizer

    if tokenizer is None:
        return  # tests that drive the scheduler with token ids only
    path = resolve_model_path(
        server_args.speculative_draft_model_path, "--speculative-draft-model-path"
    )
    try:
        draft_tok = load_tokenizer(path, trust_remote_code=server_args.trust_remote_code)
    except Exception as exc:
        raise ValueError(f"cannot load the draft model's tokenizer from {path}: {exc}") from exc
    if draft_tok.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            "the draft model's tokenizer differs from the target's: speculative decoding needs "
            "both to map text to the same token ids"
        )
