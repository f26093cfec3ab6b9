"""Per-request sampling parameters (frozen), validated against the model's context.

Validation raises `epd.errors.EPDError` (400) naming the offending parameter so the
server can render an OpenAI error without translating.
"""

from __future__ import annotations

from dataclasses import dataclass

from epd.errors import EPDError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 -> disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1

    def __post_init__(self) -> None:
        # Accept lists / a single string from callers, store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, max_model_len: int | None = None, num_prompt_tokens: int = 0,
                 prompt_param: str = "messages") -> None:
        """Raise EPDError(400) naming the first bad parameter."""
        def bad(message: str, param: str) -> EPDError:
            return EPDError(message, param=param, code="invalid_value")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise bad(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}", "top_k")
        if self.n != 1:
            raise bad(f"n={self.n} is not supported: only n=1", "n")
        if self.top_logprobs < 0 or self.top_logprobs > MAX_TOP_LOGPROBS:
            raise bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                      "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs requires logprobs=true", "top_logprobs")
        if any(not s for s in self.stop):
            raise bad("stop strings must be non-empty", "stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative", "stop_token_ids")
        if max_model_len is not None:
            if num_prompt_tokens >= max_model_len:
                raise bad(
                    f"the prompt has {num_prompt_tokens} tokens, the model's context length "
                    f"is {max_model_len}", prompt_param)
            if num_prompt_tokens + self.max_tokens > max_model_len:
                raise bad(
                    f"prompt ({num_prompt_tokens} tokens) + max_tokens ({self.max_tokens}) "
                    f"exceeds the model's context length of {max_model_len}", prompt_param)
