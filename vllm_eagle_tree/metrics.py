"""Read vLLM's speculative-decoding counters from ``LLM.get_metrics()``.

Needs ``LLM(..., disable_log_stats=False)``. Counters are cumulative, so
callers take differences of two snapshots around the work they measure.
"""
from __future__ import annotations

from dataclasses import dataclass

_NAMES = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


@dataclass
class SpecCounters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        return SpecCounters(self.drafts - other.drafts,
                            self.draft_tokens - other.draft_tokens,
                            self.accepted_tokens - other.accepted_tokens)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify step: accepted drafts + 1 bonus."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


def spec_counters(llm) -> SpecCounters:
    out = SpecCounters()
    for m in llm.get_metrics():
        field = _NAMES.get(m.name)
        if field is not None:
            setattr(out, field, getattr(out, field) + int(m.value))
    return out
