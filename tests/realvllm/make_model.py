"""Generate the real-vLLM tier's tiny model: tokenizer, random-weight Llama and a LoRA adapter.

Run with the vLLM venv's python (it needs torch, transformers and tokenizers, which the project's
own environment does not install)::

    python tests/realvllm/make_model.py OUT_DIR

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a generated corpus (by
``epp/testing/tokenizer.py``'s ``train_bpe``, which the unit tests use too), the
model's weights come from a seeded generator, and the adapter's two safetensors tensors per target
module are written directly in peft's on-disk layout (peft is not in that venv). The same seed
gives the same files, so a CI cache keyed on this script's content stays valid.

Layout written under OUT_DIR::

    llama/            config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with a
                      chat template), special_tokens_map.json, generation_config.json
    lora/             adapter_config.json, adapter_model.safetensors (rank 8, q_proj and v_proj)
    READY             written last: other processes wait for it

Sizes are chosen for a 2-core CPU: 2 layers, hidden 128, 2 heads of 64 (a head size vLLM's CPU
attention supports), a 512-token vocabulary the model's embedding matches exactly.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["make_model"]

_SEED = 1234
_VOCAB = 512
_HIDDEN = 128
_LAYERS = 2
_HEADS = 2
_RANK = 8


def _shared_tokenizer_module() -> ModuleType:
    # epp/testing/tokenizer.py trains the BPE (the unit tests' tokenizer is the same one); loaded by
    # path because this script runs in the vLLM virtualenv, where epp is not installed.
    path = Path(__file__).resolve().parents[2] / "epp" / "testing" / "tokenizer.py"
    spec = importlib.util.spec_from_file_location("_epp_testing_tokenizer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tokenizer(out: Path, rng: random.Random) -> int:
    from transformers import PreTrainedTokenizerFast

    shared = _shared_tokenizer_module()
    assert shared.SEED == _SEED
    del rng  # the corpus comes from random.Random(_SEED), as it did when it was drawn here
    tok = shared.train_bpe(_VOCAB)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    template = shared.TEMPLATES["tiny"]
    fast.chat_template = template
    fast.model_max_length = 4096
    fast.save_pretrained(out)
    # transformers 5 writes the template to chat_template.jinja only; older readers look in
    # tokenizer_config.json, so it goes in both.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return int(tok.get_vocab_size())


def _llama(out: Path, vocab: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(_SEED)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=_HIDDEN,
        intermediate_size=2 * _HIDDEN,
        num_hidden_layers=_LAYERS,
        num_attention_heads=_HEADS,
        num_key_value_heads=_HEADS,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out)


def _lora(out: Path, base: Path) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(_SEED + 1)
    tensors = {}
    for layer in range(_LAYERS):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            # lora_B non-zero (peft starts it at zero) so the adapter really changes the output.
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(_RANK, _HIDDEN, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(_HIDDEN, _RANK, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": _RANK,
        "lora_alpha": 2 * _RANK,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_model(out: Path) -> Path:
    """Write the tiny model under ``out`` (see the module docstring) and return ``out``."""
    rng = random.Random(_SEED)
    out.mkdir(parents=True, exist_ok=True)
    (out / "READY").unlink(missing_ok=True)
    base = out / "llama"
    vocab = _tokenizer(base, rng)
    if vocab > _VOCAB:
        raise SystemExit(f"tokenizer has {vocab} tokens, more than the model's {_VOCAB}")
    _llama(base, vocab)
    _lora(out / "lora", base)
    (out / "READY").write_text(f"llama={base}\nlora={out / 'lora'}\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: make_model.py OUT_DIR")
    print(make_model(Path(sys.argv[1])))
