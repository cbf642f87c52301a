"""``kvbridge vllm-proxy``: registered here, built in ``kvbridge.integrations.vllm.proxy``
(the integration's own folder; it imports kvbridge's public API only, and not vLLM)."""

from kvbridge.integrations.vllm.proxy import register

__all__ = ["register"]
