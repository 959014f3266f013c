"""vLLM's `/tokenize` and `/detokenize`: the served model's tokenizer, as the generation routes use it.

`/tokenize` takes a completion's `prompt` (with the tokenizer's special tokens, unless
`add_special_tokens` is false) or a chat's `messages` (rendered by the chat template, which has them
already), so its count is the `usage.prompt_tokens` the same body would cost. `/detokenize` decodes
token ids back to text, special tokens kept, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from cluster.serving.http.openai_protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, ToolDefinition
from cluster.serving.request_limits import RequestLimits
from cluster.weights.tokenizer import Tokenizer


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def token_ids(self, tokenizer: Tokenizer, limits: RequestLimits) -> list[int]:
        request = CompletionRequest.model_validate(self.model_dump(include={"prompt", "add_special_tokens"}))
        request.check_limits(limits)
        return request.prompt_ids(tokenizer)


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template has them
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False

    def token_ids(self, tokenizer: Tokenizer, limits: RequestLimits) -> list[int]:
        """The chat's prompt exactly as `/v1/chat/completions` would build it."""
        request = ChatCompletionRequest.model_validate(self.model_dump(exclude={"model", "return_token_strs"}))
        request.check_limits(limits)
        return request.prompt_ids(tokenizer)


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]

    def text(self, tokenizer: Tokenizer) -> str:
        if any(token_id >= tokenizer.vocab_size for token_id in self.tokens):
            raise ValueError(f"tokens must be in [0, {tokenizer.vocab_size})")
        return tokenizer.decode(self.tokens, skip_special_tokens=False)


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(body: TokenizeRequest, tokenizer: Tokenizer, limits: RequestLimits,
             max_model_len: int) -> TokenizeResponse:
    """Blocking (a chat template, a long prompt): the gateway runs it off its event loop."""
    token_ids = body.token_ids(tokenizer, limits)
    strs = [tokenizer.decode([token_id], skip_special_tokens=False) for token_id in token_ids] \
        if body.return_token_strs else None
    return TokenizeResponse(count=len(token_ids), max_model_len=max_model_len, tokens=token_ids, token_strs=strs)
