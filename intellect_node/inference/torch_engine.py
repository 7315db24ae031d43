"""The default engine: batched sampling with a static KV cache over :class:`DecoderRunner` (CPU, GPU).

One prefill of the left-padded prompts (each distinct prompt once: a GRPO group repeats one), then one
token per step for the whole batch until every row has emitted one of the model's EOS IDs or
``max_new_tokens`` is reached. Rows that finished keep stepping
(a static batch wastes a little compute but never reshapes the cache); their extra tokens are discarded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from intellect_node.errors import ConfigError
from intellect_node.inference.base import Generation, SamplingConfig
from intellect_node.inference.decoder import DecoderRunner, KVCache, left_pad
from intellect_node.models.loader import LoadedModel, load_model
from intellect_node.proofs import sampling as S

Pair = tuple[Sequence[int], Sequence[int]]
"""(prompt, completion) token IDs."""


class TorchEngine:
    name = "torch"

    def __init__(self, loaded: LoadedModel, device: str = "cpu") -> None:
        self.loaded = loaded
        self.dtype = loaded.dtype
        self.runner = DecoderRunner(loaded, device)
        self.device = self.runner.device
        self.eos_id = loaded.tokenizer.eos_id
        self.eos_ids = loaded.tokenizer.eos_ids
        self.pad_id = loaded.tokenizer.pad_id

    @classmethod
    def from_dir(cls, model: str | Path | None = None, dtype: str = "float32",
                 device: str = "cpu") -> "TorchEngine":
        return cls(load_model(model, dtype=dtype, device=device), device=device)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], keys: Sequence[int],
                 sampling: SamplingConfig) -> list[Generation]:
        if len(prompts) != len(keys) or not prompts:
            raise ConfigError("generate needs one noise key per prompt (and at least one prompt)")
        if any(len(p) == 0 for p in prompts):
            raise ConfigError("empty prompt")
        B, dev, max_new = len(prompts), self.device, sampling.max_new_tokens
        ids, positions, valid = left_pad([list(p) for p in prompts], self.pad_id, dev)
        L = ids.shape[1]
        if L + max_new > self.runner.max_positions:
            raise ConfigError(f"prompt ({L}) + max_new_tokens ({max_new}) exceeds the model's "
                              f"{self.runner.max_positions} positions", field="max_new_tokens")
        cache = self.runner.new_cache(B, L + max_new)
        key_t = torch.tensor(list(keys), dtype=torch.int64, device=dev)
        valid = torch.cat([valid, torch.ones(B, max_new, dtype=torch.bool, device=dev)], dim=1)
        next_pos = positions[:, -1:] + 1
        hidden = self._prefill_prompts(prompts, ids, positions, valid, cache)  # [B, H]
        toks, lps, hids = [], [], []
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        eos_t = torch.tensor(sorted(self.eos_ids), device=dev)
        for step in range(max_new):
            tok, lp = S.sample(self.runner.logits(hidden), key_t, torch.full((B,), step, device=dev),
                               sampling.temperature, sampling.top_p)
            toks.append(tok)
            lps.append(lp)
            hids.append(hidden)
            done |= (tok == self.eos_id) if len(self.eos_ids) == 1 else torch.isin(tok, eos_t)
            if step + 1 == max_new or (not sampling.ignore_eos and bool(done.all())):
                break
            hidden = self.runner.forward(tok.view(B, 1), next_pos, valid, cache)[:, -1]
            next_pos = next_pos + 1
        tok_m = torch.stack(toks, 1).cpu()
        lp_m = torch.stack(lps, 1).cpu()
        hid_m = torch.stack(hids, 1).float().cpu()
        out = []
        for r in range(B):
            row = tok_m[r].tolist()
            ends = [i for i, t in enumerate(row) if t in self.eos_ids]
            n = ends[0] + 1 if ends and not sampling.ignore_eos else len(row)
            out.append(Generation(prompt_tokens=list(prompts[r]), tokens=row[:n],
                                  logprobs=lp_m[r, :n].tolist(), hidden=hid_m[r, :n].clone()))
        return out

    @staticmethod
    def _distinct(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
        """(the first row of each distinct prompt, each row's distinct prompt)."""
        index: dict[tuple[int, ...], int] = {}
        distinct: list[int] = []
        rows: list[int] = []
        for i, p in enumerate(prompts):
            rows.append(index.setdefault(tuple(p), len(distinct)))
            if rows[-1] == len(distinct):
                distinct.append(i)
        return distinct, rows

    def _prompt_cache(self, prompts: Sequence[Sequence[int]], distinct: list[int], rows: list[int],
                      cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute each distinct prompt once, left-padded, and copy its keys and values into ``cache``'s
        first slots for every row that repeats it. Returns (each row's prompt's last hidden state [B, H],
        valid [B, L])."""
        dev = self.device
        ids, positions, valid = left_pad([list(prompts[i]) for i in distinct], self.pad_id, dev)
        L = ids.shape[1]
        once = self.runner.new_cache(len(distinct), L)
        last = self.runner.forward(ids, positions, valid, once)[:, -1]
        expand = torch.tensor(rows, device=dev)
        cache.k[:, :, :, :L] = once.k[:, expand]
        cache.v[:, :, :, :L] = once.v[:, expand]
        cache.length = L
        return last[expand], valid[expand]

    def _prefill_prompts(self, prompts: Sequence[Sequence[int]], ids: torch.Tensor, positions: torch.Tensor,
                         valid: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Fill ``cache`` with the left-padded prompts and return each row's last hidden state [B, H].

        A GRPO group repeats one prompt ``group_size`` times: each distinct prompt is computed once and
        its keys and values copied to every row that repeats it (as a prefix cache would)."""
        distinct, rows = self._distinct(prompts)
        if len(distinct) == len(prompts):
            return self.runner.forward(ids, positions, valid, cache)[:, -1]
        return self._prompt_cache(prompts, distinct, rows, cache)[0]

    @torch.inference_mode()
    def prefill(self, sequences: Sequence[Pair]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For (prompt, completion) pairs: the hidden states [n, H] (float32, CPU) and logits [n, V] that
        produced each completion token, recomputed in one batched forward pass (the verifier's view;
        the verifier itself takes :meth:`prefill_hidden` and :meth:`logits_of` in slices, so that a
        batch's [tokens, vocab] logits never exist all at once)."""
        return self._with_logits(self.prefill_hidden(sequences))

    def _with_logits(self, hidden: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(h.float().cpu(), lg.cpu()) for h, lg in zip(hidden, self.logits_of(hidden))]

    @torch.inference_mode()
    def logits_of(self, hidden: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Float32 logits [n, V] for hidden states [n, H] from :meth:`prefill_hidden`, one matmul for all."""
        logits = self.runner.logits(torch.cat(list(hidden)))
        ends = torch.tensor([h.shape[0] for h in hidden]).cumsum(0).tolist()
        return [logits[e - h.shape[0]:e] for h, e in zip(hidden, ends)]

    @torch.inference_mode()
    def prefill_hidden(self, sequences: Sequence[Pair]) -> list[torch.Tensor]:
        """The final-norm hidden states [n, H] (model dtype, on the engine's device) that produced each
        completion token of the (prompt, completion) pairs, in one batched forward pass.

        Where prompts repeat (a GRPO group), each distinct prompt is computed once and the completions,
        right-padded, continue from its keys and values: every token attends to what it attends to in
        its own sequence, with the prompt's share of the work done once per group."""
        distinct, rows = self._distinct([p for p, _ in sequences])
        if len(distinct) == len(sequences):
            return self._rows_hidden(sequences)
        dev = self.device
        tails = [list(c)[:-1] for _, c in sequences]  # a completion's last token is only ever predicted
        T = max(len(t) for t in tails)
        cache = self.runner.new_cache(len(sequences), max(len(p) for p, _ in sequences) + T)
        last, valid = self._prompt_cache([p for p, _ in sequences], distinct, rows, cache)
        last = last.unsqueeze(1)  # [B, 1, H]: predicts each completion's first token
        if T:
            ids = torch.full((len(sequences), T), self.pad_id, dtype=torch.long, device=dev)
            tail_valid = torch.zeros((len(sequences), T), dtype=torch.bool, device=dev)
            for r, t in enumerate(tails):
                ids[r, :len(t)] = torch.tensor(t, dtype=torch.long, device=dev)
                tail_valid[r, :len(t)] = True
            starts = torch.tensor([len(p) for p, _ in sequences], device=dev).view(-1, 1)
            positions = starts + torch.arange(T, device=dev).view(1, T)
            tail = self.runner.forward(ids, positions, torch.cat([valid, tail_valid], dim=1), cache)
            hidden = torch.cat([last, tail], dim=1)  # slot k predicts completion token k
        else:
            hidden = last
        return [hidden[r, :len(c)] for r, (_, c) in enumerate(sequences)]

    @torch.inference_mode()
    def _prefill_rows(self, sequences: Sequence[Pair]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`prefill` with one left-padded row per sequence, even where prompts repeat (what the
        shared-prompt path must agree with)."""
        return self._with_logits(self._rows_hidden(sequences))

    def _rows_hidden(self, sequences: Sequence[Pair]) -> list[torch.Tensor]:
        """:meth:`prefill_hidden` with one left-padded row per sequence."""
        seqs = [list(p) + list(c)[:-1] for p, c in sequences]
        ids, positions, valid = left_pad(seqs, self.pad_id, self.device)
        hidden = self.runner.forward(ids, positions, valid)
        L = ids.shape[1]
        # The last n slots: the prompt's last token .. the completion's last but one.
        return [hidden[r, L - len(c):L] for r, (_, c) in enumerate(sequences)]
