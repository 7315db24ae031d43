"""Inference engines behind one seam (:class:`InferenceEngine`), rollout building and verification.

``torch_engine`` is the default; ``vllm_engine`` is imported lazily (extra ``intellect-node[vllm]``).
"""

from intellect_node.inference.base import Generation, InferenceEngine, SamplingConfig

__all__ = ["Generation", "InferenceEngine", "SamplingConfig"]
