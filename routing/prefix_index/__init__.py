"""What each prefill engine's radix cache holds, as far as kvgate can know it: the prompts it sent there (per tenant
namespace, bounded by the engine's pool) and, where the engine publishes KV events, what the engine itself reports
stored and evicted. The cache-aware policy routes by it (routing/policies/cache_aware.py)."""

from routing.prefix_index.blocks import PromptTokens, block_tokens_for
from routing.prefix_index.index import CacheIndex, CacheMode

__all__ = ["CacheIndex", "CacheMode", "PromptTokens", "block_tokens_for"]
