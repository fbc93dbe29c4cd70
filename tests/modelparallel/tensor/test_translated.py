"""Hugging Face GPT-NeoX and GPT-J marked with SMP's distributed-transformer intent
(``zero_init=False``) become a ``DistributedTransformerLMHead``: in one process each config
option (rotary share and base, parallel or sequential residual, one norm or two, tying,
activation) gives HF's logits and loss, and the state dict translates to HF's and back exactly;
on two tensor-parallel ranks both train as the plain HF models. Without the intent a model is
split in place, as before; what the translation cannot honour is refused by name, a head
count the translation functions cannot know too; checkpointing
marks on a parallel layer's blocks apply."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor import swap
from dtrain.modelparallel.tensor.attention import Rotary
from dtrain.modelparallel.tensor.huggingface import gptj, gptneox
from tests.modelparallel import hf_cases
from tests.modelparallel.harness import run_ranks, single_process

pytest.importorskip("transformers")

STEPS = 3

SIZES = {
    "GPTNeoX": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": hf_cases.SEQ,
    },
    "GPTJ": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": hf_cases.SEQ},
}

TRANSLATIONS = {
    "GPTNeoX": (
        functools.partial(gptneox.translate_state_dict_to_hf_gptneox, num_attention_heads=4),
        functools.partial(
            gptneox.translate_hf_state_dict_to_smdistributed_gptneox, num_attention_heads=4
        ),
    ),
    "GPTJ": (
        gptj.translate_state_dict_to_hf_gptj,
        gptj.translate_hf_state_dict_to_smdistributed_gptj,
    ),
}
"""Each family's translations: to HF's names, and from them."""

OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "neox: parallel residual, a quarter rotary, untied": ("GPTNeoX", {}),
    "neox: sequential residual, whole rotary, tied, gelu_new": (
        "GPTNeoX",
        {
            "use_parallel_residual": False,
            "rotary_pct": 1.0,
            "rotary_emb_base": 500,
            "tie_word_embeddings": True,
            "hidden_act": "gelu_new",
        },
    ),
    "gptj: rotary on 4 of 8, untied head with a bias": ("GPTJ", {"rotary_dim": 4}),
    "gptj: whole rotary, tied, inner 48": (
        "GPTJ",
        {"rotary_dim": 8, "tie_word_embeddings": True, "n_inner": 48},
    ),
}


def _plain(family: str = "GPTNeoX", seed: int = 0, **options: Any) -> Any:
    import transformers

    config_class = getattr(transformers, f"{family}Config")
    config = config_class(vocab_size=hf_cases.VOCAB, **SIZES[family], **options)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")
    return model._from_config(config, attn_implementation="eager").train()


def _swapped(family: str = "GPTNeoX", **options: Any) -> tuple[Any, Any]:
    plain = _plain(family, **options)
    smp.set_tensor_parallelism(plain, zero_init=False)
    return plain, swap.distribute(plain)


@pytest.mark.parametrize(("family", "options"), OPTIONS.values(), ids=list(OPTIONS))
def test_translated_model_computes_as_hf_and_its_state_dict_translates_both_ways(
    family: str, options: dict[str, Any]
) -> None:
    batch = hf_cases.CASES["gpt2"].batch(0)  # padded rows, labels -100 on the padding
    to_hf, from_hf = TRANSLATIONS[family]
    with single_process({}):
        plain, dist = _swapped(family, **options)
        assert type(dist).__name__ == "DistributedTransformerLMHead"
        tied = dist.lm_head.weight is dist.word_embedding.weight
        assert tied == bool(options.get("tie_word_embeddings", False))
        expected, got = plain(**batch), dist(**batch)
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.loss, expected.loss)
        mine = dist.state_dict()
    theirs = plain.state_dict()
    back = to_hf(mine)
    assert back.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(back[key], value), key
    again = from_hf(back)
    assert again.keys() == mine.keys()
    for key, value in again.items():
        assert torch.equal(value, mine[key]), key


def test_rotary_pairs_gpt_j_style_turn_neighbouring_dimensions() -> None:
    """Pairs (2i, 2i+1) turned by position p times base**(-2i/dim); dimensions past ``dim``
    kept: checked against complex multiplication."""
    x = torch.randn(1, 2, 5, 6)
    turned = Rotary("test", 4, 6, 100.0, halves=False)(x)
    pairs = torch.view_as_complex(x[..., :4].reshape(1, 2, 5, 2, 2).contiguous())
    angle = torch.arange(5.0)[:, None] * 100.0 ** (-torch.arange(0, 4, 2) / 4)
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    torch.testing.assert_close(turned[..., :4], expected)
    assert torch.equal(turned[..., 4:], x[..., 4:])


@pytest.mark.parametrize("family", list(SIZES))
def test_without_the_intent_the_model_is_split_in_place(family: str) -> None:
    with single_process({}):
        plain = _plain(family)
        smp.set_tensor_parallelism(plain, zero_init=True)
        assert swap.distribute(plain) is plain


def test_what_the_translation_cannot_honour_is_refused_by_name() -> None:
    ids = torch.zeros(2, 4, dtype=torch.long)
    with single_process({}):
        for family, options, message in (
            ("GPTNeoX", {"attention_bias": False}, "attention_bias=False is not supported"),
            ("GPTNeoX", {"hidden_act": "silu"}, "hidden_act='silu'; allowed: gelu, gelu_new"),
            ("GPTNeoX", {"rotary_pct": 0.1}, "rotary_dim=0; allowed: an even number from 2"),
            ("GPTJ", {"activation_function": "silu"}, "activation_function='silu'; allowed"),
            ("GPTJ", {"rotary_dim": 3}, "rotary_dim=3; allowed: an even number from 2"),
        ):
            with pytest.raises((ModelParallelError, ValueError), match=message):
                _swapped(family, **options)
        _, neox = _swapped("GPTNeoX")
        with pytest.raises(ModelParallelError, match=r"does not take \['position_ids'\]"):
            neox(input_ids=ids, position_ids=ids)
        with pytest.raises(ModelParallelError, match=r"does not take \['use_cache'\]"):
            neox(input_ids=ids, use_cache=True)
        _, gpt_j = _swapped("GPTJ", rotary_dim=4)
        with pytest.raises(ModelParallelError, match=r"does not take \['token_type_ids'\]"):
            gpt_j(input_ids=ids, token_type_ids=ids)


def test_neox_translations_refuse_a_head_count_they_cannot_know() -> None:
    # Splitting query_key_value by another head count succeeds too, into wrong weights.
    import transformers

    translate = gptneox.translate_hf_state_dict_to_smdistributed_gptneox
    hf = _plain().state_dict()
    two_heads = transformers.GPTNeoXConfig(**{**SIZES["GPTNeoX"], "num_attention_heads": 2})
    with single_process({}):
        with pytest.raises(ModelParallelError, match="no GPT-NeoX config was translated"):
            translate(hf)
        gptneox.init_hook(_plain().config)
        guessed = translate(hf)
        for key, value in translate(hf, num_attention_heads=4).items():
            assert torch.equal(guessed[key], value), key
        gptneox.init_hook(two_heads)
        with pytest.raises(
            ModelParallelError, match=r"several GPT-NeoX configs were translated \(2, 4 heads\)"
        ):
            translate(hf)
        with pytest.raises(ModelParallelError, match="pass num_attention_heads"):
            gptneox.translate_state_dict_to_hf_gptneox(translate(hf, num_attention_heads=4))
        swapped = _swapped()[1].state_dict()  # by its own config's head count, whatever others
        for key, value in translate(hf, num_attention_heads=4).items():
            assert torch.equal(swapped[key], value), key
        smp.reset()
        with pytest.raises(ModelParallelError, match="no GPT-NeoX config was translated"):
            translate(hf)


TRAINED = (
    OPTIONS["neox: parallel residual, a quarter rotary, untied"],
    OPTIONS["gptj: rotary on 4 of 8, untied head with a bias"],
)
"""Trained on two ranks: GPT-NeoX as AWS's script makes it (inside ``smp.model_creation``, without
memory), GPT-J marked after creation and fine-tuned from an HF state dict, as AWS's GPT-J script
does (``--fine_tune``)."""


def _train(root: str) -> list[dict[str, Any]]:
    """Each of ``TRAINED`` at tp=2, saved whole under ``root`` after training (with HF's names,
    and GPT-J with SMP's too). GPT-J is made from another seed and resumes from the plain
    model's HF state dict (``{family}_hf.pt``, written by rank 0)."""
    dist.init_process_group("gloo")
    results = []
    for family, options in TRAINED:
        delayed = family == "GPTNeoX"
        smp.init(
            {"tensor_parallel_degree": 2, "ddp": True, "delayed_parameter_initialization": delayed}
        )
        if delayed:
            with smp.model_creation(tensor_parallelism=True, zero_init=False):
                plain = _plain(family, **options)
        else:
            if smp.rank() == 0:
                torch.save(_plain(family, **options).state_dict(), f"{root}/{family}_hf.pt")
            smp.barrier()
            plain = _plain(family, seed=1, **options)
            smp.set_tensor_parallelism(plain, zero_init=False)
        model = smp.DistributedModel(plain)
        if not delayed:
            smp.resume_from_checkpoint(root, tag=f"{family}_hf.pt", partial=False)
        losses = hf_cases.train_wrapped(model, "gpt2", STEPS)
        kind = type(model.module).__name__
        results.append({"losses": losses, "state": model.state_dict(), "kind": kind})
        smp.save_checkpoint(root, f"{family}_full", partial=False, model=model)
        if not delayed:
            smp.save_checkpoint(
                root, f"{family}_smp", partial=False, model=model, translate_if_full=False
            )
        smp.shutdown()
    dist.destroy_process_group()
    return results


def test_translated_models_train_on_two_ranks_as_the_plain_models(tmp_path: Path) -> None:
    """The mean loss and the parameters are the plain model's; the full checkpoints load
    strictly into the plain HF models (``translate_if_full``, SMP's default); GPT-J's HF state
    dict resumed into its translation gives the plain model's weights."""
    ranks = run_ranks(2, _train, str(tmp_path), timeout=180, env=hf_cases.HF_ENV)
    for index, (family, options) in enumerate(TRAINED):
        first, second = ranks[0][index], ranks[1][index]
        expected = hf_cases.reference("gpt2", STEPS, model=_plain(family, **options))
        assert first["kind"] == "DistributedTransformerLMHead"
        mean = [(first["losses"][s] + second["losses"][s]) / 2 for s in range(STEPS)]
        assert mean == pytest.approx(expected.losses, rel=1e-5), family
        back = TRANSLATIONS[family][0](second["state"])
        saved = torch.load(tmp_path / f"{family}_full", weights_only=True)
        assert saved.keys() == back.keys()
        _plain(family, **options).load_state_dict(saved)  # strict: every key of the HF model
        for key, value in expected.params.items():
            torch.testing.assert_close(back[key], value, rtol=1e-4, atol=1e-6, msg=key)
            assert torch.equal(saved[key], back[key]), key
    gpt_j = ranks[0][1]["state"]
    with_smp_names = torch.load(tmp_path / "GPTJ_smp", weights_only=True)
    assert with_smp_names.keys() == gpt_j.keys()
    _resumes_and_translates(tmp_path, gpt_j)


def _resumes_and_translates(root: Path, trained: dict[str, torch.Tensor]) -> None:
    """In one process: GPT-J's full checkpoint with SMP's names resumes as it is, and
    ``model.load_state_dict`` takes HF's; a ``translate_function`` is used in place of the
    automatic translation, and one returning other keys fails naming them; so does an HF state
    dict with a key neither model has.
    Options that would be ignored are refused: ``translate_function`` with a partial
    checkpoint, ``load_sharded_optimizer_state=False`` without sharded data parallelism or with a
    full one."""
    family, options = TRAINED[1]
    hf_file = root / f"{family}_hf.pt"
    hf = torch.load(hf_file)
    with single_process({}):
        plain = _plain(family, seed=1, **options)
        smp.set_tensor_parallelism(plain, zero_init=False)
        model = smp.DistributedModel(plain)
        smp.resume_from_checkpoint(root, tag=f"{family}_smp", partial=False)
        resumed = {key: value.clone() for key, value in model.state_dict().items()}
        calls: list[list[str]] = []

        def spy(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            calls.append(sorted(state_dict))
            translated = gptj.translate_hf_state_dict_to_smdistributed_gptj(state_dict)
            return {key: value + 1 for key, value in translated.items()}

        smp.resume_from_checkpoint(root, tag=hf_file.name, partial=False, translate_function=spy)
        by_spy = {key: value.clone() for key, value in model.state_dict().items()}
        model.load_state_dict(hf)  # SMP's model translates an HF state dict too
        by_load = {key: value.clone() for key, value in model.state_dict().items()}
        stray = {**by_load, "transformer.stray": torch.zeros(1)}  # SMP's names and one more
        model.load_state_dict(stray, strict=False)  # ignored, as torch ignores it
        with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"transf"):
            model.load_state_dict(stray)
        wrong = functools.partial(_renamed, "lm_head.weight", "lm_head.weights")
        with pytest.raises(ModelParallelError) as wrong_keys:
            smp.resume_from_checkpoint(
                root, tag=hf_file.name, partial=False, translate_function=wrong
            )
        with pytest.raises(TypeError, match=r"returned list; allowed: a state dict \(dict\)"):
            smp.resume_from_checkpoint(root, hf_file.name, partial=False, translate_function=list)
        with pytest.raises(ValueError, match=r"function of a full state dict \(partial=False\)"):
            smp.resume_from_checkpoint(root, tag=f"{family}_smp", translate_function=spy)
        with pytest.raises(ValueError, match="sharded_data_parallel_degree above 1"):
            smp.resume_from_checkpoint(root, f"{family}_smp", load_sharded_optimizer_state=False)
        with pytest.raises(ValueError, match=r"applies to partial checkpoints \(partial=True\)"):
            smp.resume_from_checkpoint(
                root, f"{family}_smp", partial=False, load_sharded_optimizer_state=False
            )
        torch.save({**hf, "transformer.h.0.attn.extra": torch.zeros(1)}, hf_file)
        with pytest.raises(ModelParallelError) as unknown:
            smp.resume_from_checkpoint(root, tag=hf_file.name, partial=False)
    for key, value in trained.items():
        assert torch.equal(resumed[key], value), key
    assert calls == [sorted(hf)]  # the file as saved, not translated before
    for key, value in gptj.translate_hf_state_dict_to_smdistributed_gptj(hf).items():
        assert torch.equal(by_spy[key], value + 1), key
        assert torch.equal(by_load[key], value), key
    assert (
        f"translate_function {wrong!r} returned keys the model does not have: "
        "['lm_head.weights']; missing the model's keys: ['lm_head.weight']"
    ) in str(wrong_keys.value)
    assert "'transformer.h.0.attn.extra'" in str(unknown.value)
    assert "pass translate_function" in str(unknown.value)


def _renamed(old: str, new: str, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-J's translation with key ``old`` named ``new``: a translate function gone wrong."""
    translated = gptj.translate_hf_state_dict_to_smdistributed_gptj(state_dict)
    translated[new] = translated.pop(old)
    return translated


def test_checkpointing_marks_on_a_parallel_layers_blocks_apply() -> None:
    """A parallel layer calls its blocks as modules: marked, the attention recomputes in the
    backward (AWS's script marks each layer's ``attention`` and ``output`` so)."""
    calls: list[int] = []
    with single_process({"ddp": True}):
        plain = _plain()
        smp.set_tensor_parallelism(plain, zero_init=False)
        model = smp.DistributedModel(plain)
        attention = model.module.transformer.seq_layers[0].attention
        smp.set_activation_checkpointing(attention)
        attend = attention.attend
        attention.attend = lambda *args: calls.append(1) or attend(*args)
        hf_cases.train_wrapped(model, "gpt2", 1)
    assert len(calls) == 2  # the forward, and its recomputation in the backward
