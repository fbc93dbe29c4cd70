"""``smp.nn.huggingface``: Hugging Face models made tensor-parallel, and SMP's state-dict
translations. GPT-2's LM head model becomes a ``DistributedTransformerLMHead`` (:mod:`.gpt2`),
and so do GPT-NeoX's and GPT-J's marked with ``zero_init=False`` (:mod:`.gptneox`,
:mod:`.gptj`); GPT-NeoX, Llama, GPT-J, BERT, RoBERTa and GPT-Neo models otherwise, and T5 and
ViT models, keep their modules, split in place (:mod:`.inplace`). ``transformers`` is imported
when needed."""

from dtrain.modelparallel.tensor.huggingface import (
    bert,
    gpt2,
    gptj,
    gptneo,
    gptneox,
    llama,
    roberta,
    t5,
    vit,
)

__all__ = ["bert", "gpt2", "gptj", "gptneo", "gptneox", "llama", "roberta", "t5", "vit"]
