"""Per-request sampling and stopping parameters (the fields of vLLM's SamplingParams we support)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.common.structured_output import StructuredOutput

# Tokens one request may bias: each is a scatter entry in every step the request samples.
MAX_LOGIT_BIAS = 1024


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` disable those filters.
    `logprobs = N` returns the log-probability of each sampled token and the N most likely ones.
    `structured` constrains every sampled token to a grammar (a JSON schema, a regex, ...); the
    request stops where the grammar ends. `logit_bias` adds a bias in [-100, 100] to the logits of
    its token ids before sampling (OpenAI's semantics; -100 in effect bans a token). `priority`
    orders the waiting queue under the scheduler's priority policy, lower values first (as vLLM);
    an engine on the fcfs policy refuses any but 0. `prompt_logprobs = N` returns, for every prompt
    token after the first, its log-probability under the model and the N most likely tokens there
    (vLLM's; such a request skips the prefix cache for the prompt, whose logits it needs).
    `include_stop_str_in_output` keeps a matched stop string at the end of the text;
    `skip_special_tokens = False` keeps special tokens' text in it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, bias) pairs
    # Tokens of this request generated already, elsewhere: the last `seed_offset` prompt tokens (a run
    # resumed after them on another worker). A seeded generator skips their draws and a grammar
    # replays them, so the random stream and the grammar's state go on unbroken.
    seed_offset: int = 0
    # The text the client has of those tokens: the resumed run's text goes on after it (what the lost
    # worker held back, a partial character or the start of a stop string, is not lost).
    resumed_text: str = ""
    structured: StructuredOutput | None = None
    # The prefix cache this request may share blocks in (`cluster.common.block_hashes`): the front
    # door's composition of its cache_salt and tenant; "" is the model's shared domain.
    cache_domain: str = ""

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON bodies), store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(token), float(value)) for token, value in bias))
        self.validate()

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative"),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias token ids must be non-negative"),
            (all(-100 <= b <= 100 for _, b in self.logit_bias), "logit_bias values must be in [-100, 100]"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens"),
            # torch's generators take 64-bit seeds; a larger one would fail the step of every request in it
            (self.seed is None or -(2**63) <= self.seed < 2**64, f"seed must fit in 64 bits, got {self.seed}"),
            (self.seed_offset >= 0, f"seed_offset must be >= 0, got {self.seed_offset}"),
            (isinstance(self.cache_domain, str), f"cache_domain must be a str, got {type(self.cache_domain).__name__}"),
            (self.structured is None or isinstance(self.structured, StructuredOutput),
             f"structured must be a StructuredOutput, got {type(self.structured).__name__}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # as the sampler: dividing by less overflows float32

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
