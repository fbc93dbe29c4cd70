"""``smp.nn.huggingface``: Hugging Face models as SMP's distributed modules, and their state
dicts translated both ways. Only GPT-2 so far; ``transformers`` is imported when needed."""

from dtrain.modelparallel.tensor.huggingface import gpt2

__all__ = ["gpt2"]
