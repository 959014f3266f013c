"""Verifies draft tokens against the model's own distribution (speculative decoding).

A request with d drafts x_1..x_d has d + 1 logits rows: row j is the model's distribution p_j for
the token after x_1..x_j. Each row goes through every step the sampler applies (grammar masks,
min_tokens, logit_bias, penalties over the history up to that row, temperature, top-k/top-p/min-p):
the row's `positions` entry is the request as it would stand there (`position_views`).

- Greedy requests accept drafts while they equal the row's argmax, then take that argmax:
  exactly the tokens plain greedy decoding gives.
- Random requests use rejection sampling (Leviathan et al.; vLLM's rejection sampler). A draft x
  from a proposer with distribution q is accepted with probability min(1, p(x) / q(x)); an n-gram
  draft is a point mass (q(x) = 1), so with probability p(x). On the first rejection the token is
  drawn from normalize(max(0, p - q)), which for a point mass is p without x, renormalized; when
  every draft is accepted, a bonus token is drawn from the last row. Each emitted token is then
  distributed exactly as the model's, whatever the drafts were.

Every position draws one row of uniforms (`Sampler.draw_uniforms`: a seeded request's from its own
generator): the acceptance test reads the draft's entry, and the exponential race that draws a
recovered or bonus token reads the others. Tokens of a seeded request are reproducible under the
same drafts, but they are not the stream the seed gives without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from cluster.common.events import TokenLogprobs
from cluster.engine.request import Request
from cluster.model.grammar_masks import GrammarMasks, fill_grammar_masks
from cluster.model.sampler import (
    BatchPlan,
    Sampler,
    compute_logprobs,
    greedy_argmax,
    process_logits,
    race,
    random_probs,
)


@dataclass(slots=True)
class VerifiedOutput:
    token_ids: list[list[int]]  # per request: its accepted drafts, then one token of the model's
    logprobs: list[list[TokenLogprobs]]  # per request, one per token where it asked for logprobs, else []


def position_views(request: Request, drafts: Sequence[int]) -> list[Request]:
    """The request as it stands at each of its 1 + len(drafts) rows: at row j, the drafts before j
    are part of its output. Copies only where the sampler reads the history (penalties, min_tokens);
    elsewhere every row is the request itself."""
    params, num_output = request.sampling_params, request.num_output_tokens
    min_tokens_ends = num_output < params.min_tokens <= num_output + len(drafts)  # EOS masked in some rows only
    if not drafts or not (params.uses_penalties or min_tokens_ends):
        return [request] * (1 + len(drafts))
    return [request] + [replace(request, output_token_ids=request.output_token_ids + list(drafts[:j]),
                                all_token_ids=request.all_token_ids + list(drafts[:j]))
                        for j in range(1, len(drafts) + 1)]


def verify(sampler: Sampler, logits: torch.Tensor, positions: Sequence[Request], drafts: Sequence[Sequence[int]],
           grammar_masks: GrammarMasks | None = None) -> VerifiedOutput:
    """`logits`: [len(positions), >= vocab], each request's 1 + len(drafts[i]) rows in turn, `positions`
    their `position_views`. The tokens each request emits this step, and their logprobs."""
    raw = logits[:, : sampler.vocab_size]
    plan = BatchPlan.build(positions)
    if plan.grammar_rows and grammar_masks is None:
        grammar_masks = fill_grammar_masks(positions, plan.grammar_rows)
    processed = process_logits(raw, positions, plan, grammar_masks)
    starts = _starts(drafts)
    emitted: list[list[int]] = [[] for _ in drafts]
    greedy_rows = set(plan.greedy_rows)
    greedy = [i for i, start in enumerate(starts) if start in greedy_rows]
    random = [i for i, start in enumerate(starts) if start not in greedy_rows]
    if greedy:
        _verify_greedy(processed, starts, drafts, greedy, emitted)
    if random:
        _verify_random(sampler, processed, positions, starts, drafts, random, emitted)
    return VerifiedOutput(emitted, _logprobs(raw, positions, starts, emitted, plan.logprob_rows))


def _starts(drafts: Sequence[Sequence[int]]) -> list[int]:
    """Each request's first row."""
    starts, row = [], 0
    for request_drafts in drafts:
        starts.append(row)
        row += 1 + len(request_drafts)
    return starts


def _verify_greedy(processed: torch.Tensor, starts: list[int], drafts: Sequence[Sequence[int]],
                   requests: list[int], emitted: list[list[int]]) -> None:
    rows = [row for i in requests for row in range(starts[i], starts[i] + 1 + len(drafts[i]))]
    targets = iter(greedy_argmax(processed[torch.tensor(rows, device=processed.device)]).tolist())
    for i in requests:
        row_targets = [next(targets) for _ in range(1 + len(drafts[i]))]
        accepted = 0
        while accepted < len(drafts[i]) and drafts[i][accepted] == row_targets[accepted]:
            accepted += 1
        emitted[i] = [*drafts[i][:accepted], row_targets[accepted]]


def _verify_random(sampler: Sampler, processed: torch.Tensor, positions: Sequence[Request], starts: list[int],  # noqa: PLR0913
                   drafts: Sequence[Sequence[int]], requests: list[int], emitted: list[list[int]]) -> None:
    """Rejection sampling for every random request at once: one acceptance test per draft, then one
    race per request over its first rejected row (that draft removed) or its last row (the bonus)."""
    device = processed.device
    rows = [row for i in requests for row in range(starts[i], starts[i] + 1 + len(drafts[i]))]
    index = torch.tensor(rows, device=device)
    probs = random_probs(processed.index_select(0, index).float(), [positions[row] for row in rows])
    uniforms = sampler.draw_uniforms(probs.shape, [positions[row] for row in rows], device)
    # Row k of `probs` proposes draft `tested[k]` (-1: a last row, no draft to test).
    tested = [token for i in requests for token in (*drafts[i], -1)]
    columns = torch.tensor(tested, device=device).clamp(min=0).unsqueeze(1)
    accepts = (uniforms.gather(1, columns) < probs.gather(1, columns)).squeeze(1).tolist()
    final_rows, removed = [], []
    offset = 0
    for i in requests:
        count = len(drafts[i])
        accepted = next((j for j in range(count) if not accepts[offset + j]), count)
        emitted[i] = list(drafts[i][:accepted])
        final_rows.append(offset + accepted)
        removed.append(drafts[i][accepted] if accepted < count else -1)
        offset += count + 1
    for i, token in zip(requests, _draw_final(probs, uniforms, final_rows, removed), strict=True):
        emitted[i].append(token)


def _draw_final(probs: torch.Tensor, uniforms: torch.Tensor, rows: list[int], removed: list[int]) -> list[int]:
    """Per request, a token from row `rows[i]` of `probs` with token `removed[i]` taken out (-1: none),
    renormalized: the race needs no normalization, only the zero."""
    device = probs.device
    index = torch.tensor(rows, device=device)
    chosen = probs.index_select(0, index)
    rejected = [k for k, token in enumerate(removed) if token >= 0]
    if rejected:
        chosen[torch.tensor(rejected, device=device), torch.tensor([removed[k] for k in rejected], device=device)] = 0
    # A rejected draft that held all the mass (rounding: p(x) just under 1) leaves nothing to draw:
    # the draft it is, as an exact p would have accepted it.
    empty = (chosen.amax(dim=-1) <= 0).tolist()
    tokens = race(chosen, uniforms.index_select(0, index)).tolist()
    return [removed[k] if empty[k] else token for k, token in enumerate(tokens)]


def _logprobs(raw: torch.Tensor, positions: Sequence[Request], starts: list[int], emitted: list[list[int]],
              logprob_rows: list[int]) -> list[list[TokenLogprobs]]:
    """Each emitted token's logprob at the row that emitted it (from the raw logits, as the sampler)."""
    wanted = set(logprob_rows)
    token_of_row = [0] * raw.shape[0]
    rows = []
    for start, tokens in zip(starts, emitted, strict=True):
        for j, token in enumerate(tokens):
            token_of_row[start + j] = token
            if start + j in wanted:
                rows.append(start + j)
    result: list[list[TokenLogprobs]] = [[] for _ in emitted]
    if not rows:
        return result
    token_ids = torch.tensor(token_of_row, device=raw.device)
    by_row = compute_logprobs(raw, token_ids, positions, rows)
    for i, (start, tokens) in enumerate(zip(starts, emitted, strict=True)):
        result[i] = [entry for j in range(len(tokens)) if (entry := by_row[start + j]) is not None]
    return result
