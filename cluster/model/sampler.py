"""Turns the model's last-position logits into one next token per request, the way vLLM does.

Per step, for each row (one request):
  0. structured output: tokens the row's grammar forbids are masked to -inf (`grammar_masks`);
  1. min_tokens: while too few tokens are out, EOS and stop token ids are masked to -inf;
     logit_bias: each row's biases are added to its tokens' logits (OpenAI's semantics);
  2. penalties: repetition over prompt and output tokens, presence and frequency over output tokens;
  3. greedy rows (temperature ~ 0) take the argmax here; random rows go on:
  4. temperature, then top-k, top-p and min-p filtering (vLLM v0's order);
  5. sampling by exponential race: argmax(probs / q) with q ~ Exponential(1), which picks token i
     with probability probs[i] and needs no cumulative sum. Rows with a seed draw q from their own
     generator, so their tokens do not depend on the rest of the batch.

Log-probabilities are taken from the raw logits, before any of the above (vLLM's default).
Everything is batched over rows with per-row parameter tensors; Python only loops over requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cluster.common.events import TokenLogprobs
from cluster.engine.request import Request
from cluster.model.grammar_masks import GrammarMasks, apply_grammar_masks, fill_grammar_masks
from pdserve_kernels import cpu_fused

# Top-p first ranks only this many tokens per row: language models rarely spread top_p of their
# mass wider, and a partial sort of 1024 costs a tenth of a full sort of a 50k vocabulary on CPU.
TOP_P_PREFIX = 1024

# Below this temperature a row is greedy, as in vLLM: dividing by a tinier one overflows float32.
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one sampled token per row
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


@dataclass(slots=True)
class BatchPlan:
    """Which rows need which work, found in one pass over the requests."""

    greedy_rows: list[int] = field(default_factory=list)
    random_rows: list[int] = field(default_factory=list)
    min_tokens_rows: list[int] = field(default_factory=list)
    penalty_rows: list[int] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)
    grammar_rows: list[int] = field(default_factory=list)
    logit_bias_rows: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, requests: Sequence[Request]) -> BatchPlan:
        plan = cls()
        for row, request in enumerate(requests):
            params = request.sampling_params
            is_greedy = params.temperature < GREEDY_TEMPERATURE
            (plan.greedy_rows if is_greedy else plan.random_rows).append(row)
            if request.num_output_tokens < params.min_tokens:
                plan.min_tokens_rows.append(row)
            if params.uses_penalties:
                plan.penalty_rows.append(row)
            if params.logprobs is not None:
                plan.logprob_rows.append(row)
            if request.grammar is not None:
                plan.grammar_rows.append(row)
            if params.logit_bias:
                plan.logit_bias_rows.append(row)
        return plan

    @property
    def modifies_logits(self) -> bool:
        return bool(self.min_tokens_rows or self.penalty_rows or self.grammar_rows or self.logit_bias_rows)


class Sampler:
    """Samples one token per row; keeps one generator per seeded request until `free`."""

    def __init__(self, vocab_size: int, seed: int | None = None) -> None:
        """`seed` makes unseeded rows reproducible too (one shared generator); None uses torch's
        default generator, so `torch.manual_seed` governs them."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self._shared_seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        self._request_generators: dict[str, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 grammar_masks: GrammarMasks | None = None) -> SamplerOutput:
        """`logits` is [len(requests), >= vocab_size]; row i belongs to requests[i]. Columns past
        vocab_size (an embedding padded for alignment) are never sampled. `grammar_masks`: the
        masks of the rows with a grammar, computed ahead (`GrammarMasker`); else computed here."""
        self._check_shape(logits, requests)
        raw = logits[:, : self.vocab_size]
        plan = BatchPlan.build(requests)
        if plan.grammar_rows and grammar_masks is None:
            grammar_masks = fill_grammar_masks(requests, plan.grammar_rows)
        processed = process_logits(raw, requests, plan, grammar_masks)
        token_ids = self._sample(processed, requests, plan)
        logprobs = compute_logprobs(raw, token_ids, requests, plan.logprob_rows)
        return SamplerOutput(token_ids.tolist(), logprobs)

    def free(self, request_id: str) -> None:
        """Forget a finished request's generator; a later request with the same id starts afresh."""
        self._request_generators.pop(request_id, None)

    def _check_shape(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [{len(requests)}, vocab], got {list(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, vocab_size is {self.vocab_size}")

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request], plan: BatchPlan) -> torch.Tensor:
        if not plan.random_rows:
            # The fast path: an all-greedy batch is one argmax.
            return greedy_argmax(logits)
        device = logits.device
        random_index = torch.tensor(plan.random_rows, device=device)
        random_requests = [requests[row] for row in plan.random_rows]
        # index_select copies, so the in-place steps below never touch the caller's tensor.
        random_logits = logits.index_select(0, random_index).float()
        random_tokens = self._sample_random(random_logits, random_requests)
        if not plan.greedy_rows:
            return random_tokens
        token_ids = torch.empty(len(requests), dtype=torch.long, device=device)
        greedy_index = torch.tensor(plan.greedy_rows, device=device)
        token_ids[greedy_index] = greedy_argmax(logits.index_select(0, greedy_index))
        token_ids[random_index] = random_tokens
        return token_ids

    def _sample_random(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Temperature, filters and the exponential race, on a float32 copy owned by us."""
        probs = random_probs(logits, requests)
        return race(probs, self.draw_uniforms(probs.shape, requests, probs.device))

    def draw_uniforms(self, shape: torch.Size, requests: Sequence[Request], device: torch.device) -> torch.Tensor:
        """[rows, vocab] uniforms in [0, 1), row i from requests[i]'s own generator where it has a seed
        (rows of one request drawn in order), else from the shared one."""
        uniforms = torch.empty(shape, device=device)
        unseeded = [row for row, request in enumerate(requests) if request.sampling_params.seed is None]
        shared = self._shared_generator(device)
        if len(unseeded) == len(requests):
            uniforms.uniform_(generator=shared)
        elif unseeded:
            drawn = torch.empty((len(unseeded), shape[1]), device=device).uniform_(generator=shared)
            uniforms[torch.tensor(unseeded, device=device)] = drawn
        for row, request in enumerate(requests):
            if request.sampling_params.seed is not None:
                uniforms[row].uniform_(generator=self._request_generator(request, shape[1], device))
        return uniforms

    def _shared_generator(self, device: torch.device) -> torch.Generator | None:
        if self._shared_seed is None:
            return None
        if device not in self._shared_generators:
            self._shared_generators[device] = torch.Generator(device=device).manual_seed(self._shared_seed)
        return self._shared_generators[device]

    def _request_generator(self, request: Request, vocab_size: int, device: torch.device) -> torch.Generator:
        """The request's own generator. Made where the request samples for the first time; if tokens
        were sampled before that (a decode worker after the prefill's first token, a run resumed
        after `seed_offset` tokens), it skips their draws (one row of `vocab_size` per token, a row
        per call as the sampling drew them), so the seed gives the tokens it gives in one run."""
        generator = self._request_generators.get(request.request_id)
        if generator is None:
            seed = request.sampling_params.seed
            assert seed is not None
            generator = torch.Generator(device=device).manual_seed(seed)
            row = torch.empty(vocab_size, device=device)
            for _ in range(request.sampling_params.seed_offset + len(request.output_token_ids)):
                row.uniform_(generator=generator)
            self._request_generators[request.request_id] = generator
        return generator


def random_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """The distribution a random row samples from: temperature, top-k and top-p, softmax, min-p, in
    place on `logits` (a float32 copy the caller owns)."""
    params = [request.sampling_params for request in requests]
    temperatures = torch.tensor([p.temperature for p in params], device=logits.device)
    logits.div_(temperatures.unsqueeze(1))
    apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
    probs = logits.softmax(dim=-1)
    apply_min_p(probs, [p.min_p for p in params])
    return probs


def race(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's sample by exponential race: argmax(probs / q), q = -log(uniform) ~ Exponential(1),
    picks token i with probability probs[i] (-log: on CPUs several times faster than `exponential_`).
    uniform_ is in [0, 1), so draws are > 0 (no 0 / 0 = NaN, which argmax would rank first); a 0
    gives an infinite draw, which only makes p / q = 0. Both tensors are overwritten."""
    return probs.div_(uniforms.log_().neg_()).argmax(dim=-1)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum. The runner hands bf16 models' logits over in bf16 (widening them to
    fp32 is exact, so every token and logprob is what the fp32 copy gives): on CPUs their argmax is a C
    kernel, since torch's bf16 argmax is not vectorized there (faster than widening then argmax, and
    than torch's bf16 argmax: docs/performance.md)."""
    if logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.stride(-1) == 1 \
            and logits.shape[-1] > 0 and cpu_fused.available(torch.bfloat16):
        return cpu_fused.argmax_rows(logits)
    if logits.dtype != torch.float32 and logits.device.type == "cpu":
        return logits.float().argmax(dim=-1)
    return logits.argmax(dim=-1)


def process_logits(
    logits: torch.Tensor, requests: Sequence[Request], plan: BatchPlan | None = None,
    grammar_masks: GrammarMasks | None = None,
) -> torch.Tensor:
    """Grammar masks, min_tokens masking, then penalties: everything that also applies to greedy rows.

    Returns `logits` itself when no row needs any (no copy); otherwise a float32 copy.
    """
    plan = plan or BatchPlan.build(requests)
    if not plan.modifies_logits:
        return logits
    logits = logits.to(torch.float32, copy=True)
    if grammar_masks is not None:
        if grammar_masks.rows != plan.grammar_rows:
            raise ValueError(f"grammar masks for rows {grammar_masks.rows}, but rows {plan.grammar_rows} "
                             "have a grammar")
        apply_grammar_masks(logits, grammar_masks)
    elif plan.grammar_rows:
        raise ValueError(f"rows {plan.grammar_rows} have a grammar but no masks were given")
    if plan.min_tokens_rows:
        apply_min_tokens(logits, [requests[row] for row in plan.min_tokens_rows], plan.min_tokens_rows)
    if plan.logit_bias_rows:
        apply_logit_bias(logits, [requests[row] for row in plan.logit_bias_rows], plan.logit_bias_rows)
    if len(plan.penalty_rows) == len(requests):
        apply_penalties(logits, requests)
    elif plan.penalty_rows:
        index = torch.tensor(plan.penalty_rows, device=logits.device)
        penalized = logits.index_select(0, index)
        apply_penalties(penalized, [requests[row] for row in plan.penalty_rows])
        logits[index] = penalized
    return logits


def apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request], rows: Sequence[int]) -> None:
    """Masks EOS and stop token ids in `rows` (requests[i] owns rows[i]), in place.

    Like vLLM, EOS is masked even under ignore_eos. Ids past the vocabulary are skipped.
    """
    vocab_size = logits.shape[1]
    mask_rows: list[int] = []
    mask_columns: list[int] = []
    for row, request in zip(rows, requests, strict=True):
        stop_ids = {*request.eos_token_ids, *request.sampling_params.stop_token_ids}
        columns = [token for token in stop_ids if token < vocab_size]
        mask_rows.extend([row] * len(columns))
        mask_columns.extend(columns)
    if mask_rows:
        device = logits.device
        index = (torch.tensor(mask_rows, device=device), torch.tensor(mask_columns, device=device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=device))


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request], rows: Sequence[int]) -> None:
    """Adds each request's biases to its row (requests[i] owns rows[i]), in place, in one scatter.
    Ids past the vocabulary are skipped (the engine refuses them; a padded column is never sampled)."""
    vocab_size = logits.shape[1]
    entries = [(row, token, bias) for row, request in zip(rows, requests, strict=True)
               for token, bias in request.sampling_params.logit_bias if token < vocab_size]
    if not entries:
        return
    device = logits.device
    bias_rows, tokens, biases = zip(*entries, strict=True)
    index = (torch.tensor(bias_rows, device=device), torch.tensor(tokens, device=device))
    logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """vLLM's penalties, in place; row i belongs to requests[i].

    repetition (prompt and output tokens): logit / p where logit > 0, else logit * p;
    then logit -= presence * (output count > 0) + frequency * output count.
    Only the (row, token) pairs that occur are touched: a few hundred per row, not a vocabulary.
    """
    params = [request.sampling_params for request in requests]
    device, vocab_size = logits.device, logits.shape[1]
    if any(p.repetition_penalty != 1 for p in params):
        rows, tokens, _ = token_occurrences([r.all_token_ids for r in requests], vocab_size, device)
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[rows]
        values = logits[rows, tokens]
        logits[rows, tokens] = torch.where(values > 0, values / penalty, values * penalty)
    if any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params):
        rows, tokens, counts = token_occurrences([r.output_token_ids for r in requests], vocab_size, device)
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[rows]
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[rows]
        logits[rows, tokens] -= frequency * counts + presence


def token_occurrences(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of `token_lists` (row i is token_lists[i]) and how often
    each occurs; tokens outside the vocabulary are skipped."""
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    lengths = torch.tensor([len(tokens_of_row) for tokens_of_row in token_lists], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    flat = (rows * vocab_size + tokens)[(tokens >= 0) & (tokens < vocab_size)]
    distinct, counts = torch.unique(flat.to(device), return_counts=True)
    return distinct // vocab_size, distinct % vocab_size, counts.float()


def apply_top_k_top_p(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> None:
    """Masks to -inf, in place, what top-k then top-p drop.

    vLLM's semantics: top-p works on the distribution top-k left and keeps a token while the mass
    ranked strictly above it is below top_p; ties with a cutoff are kept; the best token survives.
    """
    vocab_size = logits.shape[1]
    pairs = zip(top_k, top_p, strict=True)
    rows = [row for row, (k, p) in enumerate(pairs) if 0 < k < vocab_size or p < 1]
    if not rows:
        return
    if len(rows) == logits.shape[0]:
        cutoffs = top_k_top_p_cutoffs(logits, top_k, top_p)
    else:
        index = torch.tensor(rows, device=logits.device)
        subset = logits.index_select(0, index)
        cutoffs = torch.full((logits.shape[0], 1), float("-inf"), device=logits.device)
        cutoffs[index] = top_k_top_p_cutoffs(subset, [top_k[r] for r in rows], [top_p[r] for r in rows])
    logits.masked_fill_(logits < cutoffs, float("-inf"))


def top_k_top_p_cutoffs(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], width: int = TOP_P_PREFIX
) -> torch.Tensor:
    """[rows, 1]: per row, the smallest logit that top-k and top-p keep (-inf: keep all).

    Top-p first ranks the `width` best tokens only (a partial sort, much cheaper than a full one);
    rows whose best tokens hold too little mass to decide it are then ranked in full.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    k_enabled = torch.tensor([0 < k < vocab_size for k in top_k], device=device).unsqueeze(1)
    k = torch.tensor([k if 0 < k < vocab_size else vocab_size for k in top_k], device=device).unsqueeze(1)
    needs_top_p = any(p < 1 for p in top_p)
    largest_k = max((k for k in top_k if 0 < k < vocab_size), default=1)
    width = min(vocab_size, max(largest_k, width) if needs_top_p else largest_k)
    best = logits.topk(width, dim=-1).values  # descending
    k_cutoff = best.gather(1, k.clamp(max=width) - 1).masked_fill_(~k_enabled, float("-inf"))
    if not needs_top_p:
        return k_cutoff
    p_cutoff, decided = _top_p_cutoffs(logits, best, k_cutoff, k_enabled, top_p)
    cutoffs = torch.maximum(k_cutoff, p_cutoff)
    if width < vocab_size and not bool(decided.all()):
        rows = (~decided).nonzero().squeeze(1)
        row_list = rows.tolist()
        cutoffs[rows] = top_k_top_p_cutoffs(
            logits[rows], [top_k[r] for r in row_list], [top_p[r] for r in row_list], width=vocab_size
        )
    return cutoffs


def _top_p_cutoffs(
    logits: torch.Tensor,
    best: torch.Tensor,
    k_cutoff: torch.Tensor,
    k_enabled: torch.Tensor,
    top_p: Sequence[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p cutoffs from the `best` (descending) logits of each row, and per row whether they
    sufficed to decide it."""
    kept_by_k = best >= k_cutoff
    # Top-k rows keep only tokens inside `best`, so it normalizes them; other rows need the whole row.
    norm = best.masked_fill(~kept_by_k, float("-inf")).logsumexp(dim=-1, keepdim=True)
    if not bool(k_enabled.all()):
        norm = torch.where(k_enabled, norm, logits.logsumexp(dim=-1, keepdim=True))
    probs = (best - norm).exp_().masked_fill_(~kept_by_k, 0.0)
    inclusive = probs.cumsum(dim=-1)
    p_enabled = torch.tensor([p < 1 for p in top_p], device=logits.device).unsqueeze(1)
    p = torch.tensor([p if p < 1 else float("inf") for p in top_p], device=logits.device).unsqueeze(1)
    keep = (inclusive - probs) < p
    cutoff = best.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    cutoff.masked_fill_(~p_enabled, float("-inf"))
    # A row is decided once `best` holds top_p of its mass: every token past it is then dropped.
    decided = (inclusive[:, -1:] >= p).logical_or_(k_enabled).logical_or_(~p_enabled).squeeze(1)
    return cutoff, decided


def apply_min_p(probs: torch.Tensor, min_p: Sequence[float]) -> None:
    """Zeroes, in place, probabilities below min_p times the row's largest."""
    if not any(p > 0 for p in min_p):
        return
    threshold = torch.tensor(list(min_p), device=probs.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    probs.masked_fill_(probs < threshold, 0.0)


def compute_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[Request], rows: Sequence[int]
) -> list[TokenLogprobs | None]:
    """For `rows`, the sampled token's log-probability and the top N, from the raw logits."""
    result: list[TokenLogprobs | None] = [None] * len(requests)
    if not rows:
        return result
    device = raw_logits.device
    index = torch.tensor(list(rows), device=device)
    logprobs = raw_logits.index_select(0, index).float().log_softmax(dim=-1)
    sampled = logprobs.gather(1, token_ids.index_select(0, index).unsqueeze(1)).squeeze(1).tolist()
    top_counts = [requests[row].sampling_params.logprobs or 0 for row in rows]
    top_values, top_ids = logprobs.topk(max(top_counts), dim=-1)
    top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    sampled_ids = token_ids.index_select(0, index).tolist()
    for i, row in enumerate(rows):
        count = top_counts[i]
        top = list(zip(top_ids_list[i][:count], top_values_list[i][:count], strict=True))
        result[row] = TokenLogprobs(sampled_ids[i], sampled[i], top)
    return result
