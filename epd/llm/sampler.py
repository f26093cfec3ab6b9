"""Batched sampling: greedy, temperature, top-k, top-p; logprobs.

Invariants: greedy rows take the argmax of the raw logits; a request with a seed draws
only from its own `torch.Generator`, so its tokens do not depend on what else is in the
batch; logprobs are `log_softmax` of the raw (untempered) logits, as OpenAI reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epd.llm.sampling_params import SamplingParams
from epd.llm.sequence import TokenLogprob


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for unseeded random requests

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,  # [N, V]
        params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
    ) -> SamplerOutput:
        logits = logits.float()
        n = logits.shape[0]
        generators = generators or [None] * n
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = self._probs([params[i] for i in random_rows], logits[rows])
            sampled = self._draw(probs, [generators[i] for i in random_rows])
            tokens[rows] = sampled
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(logits, params, token_list))

    @staticmethod
    def _probs(params: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temps[:, None]
        need_k = any(p.top_k > 0 for p in params)
        need_p = any(p.top_p < 1.0 for p in params)
        if not (need_k or need_p):
            return torch.softmax(logits, dim=-1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        if need_k:
            ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
            ranks = torch.arange(vocab, device=device)[None, :]
            sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
        if need_p:
            ps = torch.tensor([p.top_p for p in params], device=device)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the mass before it already reaches top_p (the first stays).
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_logits = sorted_logits.masked_fill(before >= ps[:, None], float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return torch.softmax(filtered, dim=-1)

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            idx = torch.tensor(shared, device=probs.device)
            out[idx] = torch.multinomial(probs[idx], 1, generator=self.generator).squeeze(1)
        for i, g in enumerate(generators):
            if g is not None:
                # Seeded requests sample on the CPU generator: reproducible on any device.
                out[i] = torch.multinomial(probs[i].cpu(), 1, generator=g).item()
        return out

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
    ) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs]
        if not rows:
            return out
        lp = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)], dim=-1)
        chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=lp.device))
        chosen = chosen.squeeze(1).tolist()
        k = max(params[i].top_logprobs for i in rows)
        top_v, top_i = (lp.topk(k, dim=-1) if k else (None, None))
        for j, i in enumerate(rows):
            top: tuple[tuple[int, float], ...] = ()
            kk = params[i].top_logprobs
            if kk:
                top = tuple(zip(top_i[j, :kk].tolist(), top_v[j, :kk].tolist(), strict=True))
            out[i] = TokenLogprob(tokens[i], chosen[j], top)
        return out
