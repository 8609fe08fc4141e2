"""Token sampling and the two lossless speculative acceptance rules the golden loop offers at temperature > 0.

`engine` (the default, what the DFlash engine runs): argmax drafts; at each verified position one target token is
sampled from softmax(z / T) by inverse CDF with one uniform; drafts are accepted while the sample equals them and the
first mismatching sample is the bonus token. `reference` (parity with `dflash.model.dflash_generate`): drafts sampled
from the drafter, then rejection sampling with the reference's temperature / top-k / top-p semantics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.errors import DFlashTrtError
from dflash_trt.sampling_rules import ENGINE, METHODS, effective_temperature, is_greedy


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    method: str = ENGINE

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise DFlashTrtError("temperature and top_k must be >= 0 and top_p must be in (0, 1]")
        if self.method not in METHODS:
            raise DFlashTrtError(f"sampling method must be one of {', '.join(METHODS)}, got {self.method!r}")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distribution after temperature, then top-k, then top-p (nucleus over the top-k survivors)."""
    scores = logits.float() / effective_temperature(params.temperature)
    indices = None
    if 0 < params.top_k < scores.shape[-1]:
        scores, indices = torch.topk(scores, params.top_k, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < params.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if indices is not None:
        probs = torch.zeros_like(logits, dtype=probs.dtype).scatter(-1, indices, probs)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def pick_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample_from(sampling_probs(logits, params), generator)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)); falls back to p where the residual has no mass (p == q)."""
    residual = (target_probs - draft_probs).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), target_probs)


def count_accepted(target_p: torch.Tensor, draft_q: torch.Tensor, uniforms: torch.Tensor) -> int:
    """Leading drafts kept: draft i survives when u_i · q(x_i) < p(x_i), i.e. with probability min(1, p/q)."""
    return int((uniforms * draft_q < target_p).to(torch.int64).cumprod(0).sum())


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling for one sequence: accept draft i while u·q(x_i) < p(x_i), then one corrective token.

    draft_tokens `[n]`, draft_probs `[n, V]`, target_probs `[n + 1, V]` → (accepted drafts, next token). The
    output is distributed exactly as sampling from the target alone.
    """
    n = draft_tokens.shape[0]
    p = target_probs[:n].gather(-1, draft_tokens[:, None])[:, 0]
    q = draft_probs.gather(-1, draft_tokens[:, None])[:, 0]
    accepted = count_accepted(p, q, torch.rand(n, generator=generator))
    if accepted == n:
        return accepted, int(sample_from(target_probs[n], generator))
    residual = residual_distribution(target_probs[accepted], draft_probs[accepted])
    return accepted, int(sample_from(residual, generator))


def sample_by_uniform(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `logits` `[..., V]` from softmax(logits / T), by inverse CDF: the smallest token whose
    cumulative probability reaches the row's uniform, at the effective temperature (sampling_rules: 0 and anything
    below the minimum is argmax). This is the engine's sampling rule."""
    temperature = effective_temperature(temperature)
    if temperature == 0:
        return logits.argmax(dim=-1)
    scaled = (logits.double() - logits.double().amax(dim=-1, keepdim=True)) / temperature
    cumulative = torch.exp(scaled).cumsum(dim=-1)
    threshold = uniforms.double()[..., None] * cumulative[..., -1:]
    return (cumulative < threshold).sum(dim=-1).clamp_max(logits.shape[-1] - 1)


def exact_match_accept(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, temperature: float, uniforms: torch.Tensor
) -> tuple[int, int]:
    """The engine's verification of argmax drafts: sample position i with uniform i, accept while it equals draft i.

    draft_tokens `[n]`, target_logits `[n + 1, V]`, uniforms `[n + 1]` -> (accepted drafts, next token). The next token
    is the first mismatching sample (or the sample after the last draft), so the output is distributed exactly as
    sampling from the target alone: each emitted token is a fresh target sample given the tokens before it.
    """
    n = draft_tokens.shape[0]
    samples = sample_by_uniform(target_logits, temperature, uniforms)
    accepted = int((samples[:n] == draft_tokens).to(torch.int64).cumprod(0).sum())
    return accepted, int(samples[accepted])
