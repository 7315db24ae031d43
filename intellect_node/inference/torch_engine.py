"""The default engine: batched sampling with a static KV cache over :class:`DecoderRunner` (CPU, GPU).

One prefill of the left-padded prompts, then one token per step for the whole batch until every row has
emitted one of the model's EOS IDs or ``max_new_tokens`` is reached. Rows that finished keep stepping
(a static batch wastes a little compute but never reshapes the cache); their extra tokens are discarded.
"""

from __future__ import annotations

from typing import Sequence

import torch

from intellect_node.errors import ConfigError
from intellect_node.inference.base import Generation, SamplingConfig
from intellect_node.inference.decoder import DecoderRunner, left_pad
from intellect_node.models.loader import LoadedModel, load_model
from intellect_node.proofs import sampling as S


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
    def from_dir(cls, model: str | None = None, dtype: str = "float32", device: str = "cpu") -> "TorchEngine":
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
        hidden = self.runner.forward(ids, positions, valid, cache)[:, -1]  # [B, H]
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

    @torch.inference_mode()
    def prefill(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[torch.Tensor,
                                                                                              torch.Tensor]]:
        """For (prompt, completion) pairs: the hidden states [n, H] (float32, CPU) and logits [n, V] that
        produced each completion token, recomputed in one batched forward pass (the verifier's view)."""
        seqs = [list(p) + list(c)[:-1] for p, c in sequences]
        ids, positions, valid = left_pad(seqs, self.pad_id, self.device)
        hidden = self.runner.forward(ids, positions, valid)
        logits = self.runner.logits(hidden)
        L = ids.shape[1]
        out = []
        for r, (_, c) in enumerate(sequences):
            n = len(c)
            sl = slice(L - n, L)  # the last n slots: the prompt's last token .. the completion's last but one
            out.append((hidden[r, sl].float().cpu(), logits[r, sl].float().cpu()))
        return out
