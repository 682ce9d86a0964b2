"""inferplane: a Kubernetes-native managed LLM inference platform.

The offline API mirrors vLLM's so its users feel at home::

    from inferplane import LLM, SamplingParams
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from inferplane.worker.engine.sampling import SamplingParams
    from inferplane.worker.llm import LLM

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Imported lazily: the control plane and operator import this package without needing torch.
    if name == "LLM":
        from inferplane.worker.llm import LLM

        return LLM
    if name == "SamplingParams":
        from inferplane.worker.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
