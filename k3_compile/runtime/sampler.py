"""Token sampling on the host: greedy, temperature, top-k, top-p, repetition penalty.

Works on one row of float32 logits ``[vocab]`` at a time with a seeded numpy Generator
(reproducible for a given seed). Formulas follow common practice (HF transformers'
``TopKLogitsWarper`` / ``TopPLogitsWarper`` / CTRL repetition penalty, arXiv 1909.05858).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (dividing by them only overflows)."""


@dataclass
class SamplingParams:
    """Generation settings of one request.

    Attributes:
        temperature: 0 (or below 1e-5) means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 disables.
        repetition_penalty: > 1 discourages tokens already in the context (CTRL); 1 disables.
        seed: RNG seed; None draws from OS entropy.
        max_tokens: generated-token limit.
        stop: stop strings (the text is cut before the first match).
        ignore_eos: keep generating after an EOS token.
    Raises:
        ValueError: out-of-range values (named).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.stop = tuple(self.stop or ())


def sampling_with_defaults(defaults: dict, *, temperature: float | None = None, top_p: float | None = None,
                           top_k: int | None = None, repetition_penalty: float | None = None,
                           seed: int | None = None, max_tokens: int, stop=(), ignore_eos: bool = False
                           ) -> SamplingParams:
    """SamplingParams from a request's settings, each ``None`` one taken from the model's
    ``generation_config.json`` (``defaults``): temperature only where it sets ``do_sample``
    (else greedy), ``top_p`` / ``top_k`` / ``repetition_penalty`` where present, else neutral.
    Used by ``k3 generate`` / ``k3 chat`` and the server alike.

    Raises:
        ValueError: an out-of-range value (SamplingParams).
    """
    if temperature is None:
        temperature = float(defaults.get("temperature", 1.0)) if defaults.get("do_sample") else 0.0
    return SamplingParams(
        temperature=temperature,
        top_p=top_p if top_p is not None else float(defaults.get("top_p", 1.0)),
        top_k=top_k if top_k is not None else int(defaults.get("top_k", 0)),
        repetition_penalty=(repetition_penalty if repetition_penalty is not None
                            else float(defaults.get("repetition_penalty", 1.0))),
        seed=seed, max_tokens=max_tokens, stop=tuple(stop), ignore_eos=ignore_eos)


class Sampler:
    """Samples one token from a logits row; holds the request's RNG."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, context: list[int] | None = None) -> int:
        """Pick a token id from ``logits`` (float32 ``[vocab]``); ``context`` for the penalty."""
        p = self.params
        x = np.asarray(logits, dtype=np.float64).copy()
        if p.repetition_penalty != 1.0 and context:
            ids = np.unique(np.asarray(context, dtype=np.int64))
            ids = ids[(ids >= 0) & (ids < x.shape[0])]
            v = x[ids]
            with np.errstate(over="ignore", under="ignore"):
                x[ids] = np.clip(np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty),
                                 -1e300, 1e300)
        if p.temperature < GREEDY_BELOW:
            return int(np.argmax(x))
        # float64 and clipped: extreme temperatures or penalties give huge but finite logits
        # (never inf - inf = NaN), and a tiny top_p still keeps the most likely token
        with np.errstate(over="ignore"):
            x = np.clip(x / p.temperature, -1e300, 1e300)
        if p.top_k and p.top_k < x.shape[0]:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x = np.where(x < kth, -np.inf, x)
        x = x - x.max()
        probs = np.exp(x)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = cum - probs[order] < p.top_p
            keep[0] = True  # the most likely token, whatever the rounding
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return int(self.rng.choice(probs.shape[0], p=probs))
